//! A request's events as the caller reads them: blocking ([`RequestStream`]) or as a
//! [`futures_core::Stream`] ([`EventStream`], from [`RequestStream::into_async`]).

use super::request::Event;
use crate::Error;
use futures_channel::mpsc::{unbounded, UnboundedReceiver, UnboundedSender};
use futures_core::Stream;
use std::{
    pin::Pin,
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc, Mutex,
    },
    task::{Context, Poll},
};

type Item = Result<Event, Error>;

/// The worker's end of one request's events.
#[derive(Debug, Clone)]
pub(crate) struct EventSender(UnboundedSender<Item>);

/// The request's stream was dropped: nobody listens.
#[derive(Debug)]
pub(crate) struct Closed;

impl EventSender {
    /// Sends `event` to the request's stream.
    pub(crate) fn send(&self, event: Item) -> Result<(), Closed> {
        self.0.unbounded_send(event).map_err(|_| Closed)
    }
}

/// A request's channel: the worker's sender and the caller's stream.
pub(super) fn channel(cancel: Arc<AtomicBool>) -> (EventSender, RequestStream) {
    let (sender, receiver) = unbounded();
    (EventSender(sender), RequestStream { events: Mutex::new(receiver), cancel })
}

/// The receiving end of one request: its events in order, then nothing. Dropping it cancels
/// the request.
#[derive(Debug)]
pub struct RequestStream {
    // A mutex only so that the blocking reads take `&self`; one reader at a time.
    events: Mutex<UnboundedReceiver<Item>>,
    cancel: Arc<AtomicBool>,
}

impl RequestStream {
    /// The next event, waiting for it; `None` once the request is over.
    pub fn next_event(&self) -> Option<Item> {
        let mut events = self.events.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        futures_lite::future::block_on(futures_lite::StreamExt::next(&mut *events))
    }

    /// The events, borrowing the stream (which stays usable to cancel the request).
    pub fn events(&self) -> impl Iterator<Item = Item> + '_ {
        std::iter::from_fn(move || self.next_event())
    }

    /// Stops the request at the worker's next round (its stream then ends with
    /// [`crate::StopReason::Interrupted`]).
    pub fn cancel(&self) {
        self.cancel.store(true, Ordering::SeqCst);
    }

    /// A flag that cancels the request when set, for another thread to hold.
    pub fn cancel_flag(&self) -> Arc<AtomicBool> {
        Arc::clone(&self.cancel)
    }

    /// The same events as a [`futures_core::Stream`], for async code: no thread waits on it.
    /// Dropping it cancels the request.
    pub fn into_async(self) -> EventStream {
        EventStream { inner: self }
    }
}

impl Iterator for RequestStream {
    type Item = Item;

    fn next(&mut self) -> Option<Self::Item> {
        self.next_event()
    }
}

impl Drop for RequestStream {
    fn drop(&mut self) {
        self.cancel.store(true, Ordering::SeqCst);
    }
}

/// A request's events as a [`futures_core::Stream`] ([`RequestStream::into_async`]).
///
/// ```no_run
/// # async fn run(engine: &burn_gemma::engine::Engine, request: burn_gemma::engine::Request) -> Result<(), burn_gemma::Error> {
/// use burn_gemma::engine::Event;
/// use futures_lite::StreamExt;
///
/// let mut events = engine.submit(request)?.into_async();
/// while let Some(event) = events.next().await {
///     match event? {
///         Event::Token(token) => print!("{}", token.text),
///         Event::Done(finish) => println!("{}", finish.text),
///     }
/// }
/// # Ok(()) }
/// ```
#[derive(Debug)]
pub struct EventStream {
    inner: RequestStream,
}

impl EventStream {
    /// Stops the request at the worker's next round.
    pub fn cancel(&self) {
        self.inner.cancel();
    }
}

impl Stream for EventStream {
    type Item = Item;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Item>> {
        let events = self.get_mut().inner.events.get_mut().unwrap_or_else(|poisoned| poisoned.into_inner());
        Pin::new(events).poll_next(cx)
    }
}
