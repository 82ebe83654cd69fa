//! What the worker takes from the engine's front: submitted requests and commands.

use super::request::Tokenized;
use super::stream::EventSender;
use crate::sampling::Sampler;

use std::{
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc,
    },
    time::Instant,
};

/// A request on its way to the worker.
pub(crate) struct Submitted {
    pub(crate) request: Tokenized,
    pub(crate) sampler: Sampler,
    pub(crate) events: EventSender,
    pub(crate) cancel: Arc<AtomicBool>,
    pub(crate) submitted: Instant,
}

pub(crate) enum Command {
    Submit(Box<Submitted>),
    /// Finish the running and waiting requests, take no more, then stop.
    Drain,
    /// Cancel everything and stop.
    Abort,
    /// Test builds: a panic at a chosen place of the worker, to check what survives it.
    #[cfg(test)]
    Fault(Fault),
}

/// Where a test makes the worker panic.
#[cfg(test)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Fault {
    /// In the next round with a request running (caught there: the running requests fail, the
    /// worker goes on).
    Round,
    /// Outside any round (the worker thread ends: the engine reports it failed).
    Worker,
}

impl Submitted {
    pub(super) fn cancelled(&self) -> bool {
        self.cancel.load(Ordering::SeqCst)
    }
}
