//! When a step is replayed as a CUDA graph, and why it is not: one policy for the generator,
//! the engine's batched steps, the split model and the draft model.
//!
//! ```
//! use burn_gemma::graph_policy::{EagerReason, GraphPolicy};
//! use burn_gemma::{CudaGraph, ModelError};
//!
//! let mut policy = GraphPolicy::default();
//! assert!(policy.replays(CudaGraph::Auto, 64));
//! // A step of 64 rows could not be recorded: under Auto, steps of 64 rows or more run
//! // eagerly, smaller ones still replay.
//! let failure = ModelError::InvalidInput("too many launches".into());
//! assert!(policy.fall_back(CudaGraph::Auto, 64, failure).is_ok());
//! assert!(!policy.replays(CudaGraph::Auto, 64) && policy.replays(CudaGraph::Auto, 32));
//! assert!(matches!(policy.eager_reason(), Some(EagerReason::GraphFailed { rows: 64, .. })));
//! ```

use crate::{CudaGraph, Error, ModelError};
use burn_gemma_kernels::graph::GraphError;

/// Why steps run eagerly under [`CudaGraph::Auto`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EagerReason {
    /// The backend is not CUDA: there are no graphs to replay.
    NotCuda,
    /// Recording or replaying a step of `rows` rows failed (the runtime's words in
    /// `reason`): steps of as many rows or more run eagerly, smaller ones still replay.
    GraphFailed { rows: usize, reason: String },
}

impl std::fmt::Display for EagerReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::NotCuda => write!(f, "the backend is not CUDA"),
            Self::GraphFailed { rows: 1, reason } => write!(f, "{reason}"),
            Self::GraphFailed { rows, reason } => write!(f, "steps of {rows} rows or more: {reason}"),
        }
    }
}

/// Whether a graph failure says the backend has no graphs at all.
pub trait GraphFailure: std::fmt::Display {
    fn not_cuda(&self) -> bool;
}

impl GraphFailure for ModelError {
    fn not_cuda(&self) -> bool {
        matches!(self, ModelError::Graph(GraphError::NotCuda(_)))
    }
}

impl GraphFailure for Error {
    fn not_cuda(&self) -> bool {
        matches!(self, Error::Model(e) if e.not_cuda())
    }
}

/// What a run of steps learned about replaying them: the row counts that still replay, and
/// why the others do not. The mode ([`CudaGraph`]) is passed with each question, since a
/// generator's requests each bring their own.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GraphPolicy {
    /// Steps of more rows than this run eagerly (0: every step does).
    most_rows: usize,
    eager: Option<EagerReason>,
}

impl Default for GraphPolicy {
    fn default() -> Self {
        Self { most_rows: usize::MAX, eager: None }
    }
}

impl GraphPolicy {
    /// A policy for a backend that cannot replay graphs: every step eager, for that reason.
    pub fn not_cuda() -> Self {
        Self { most_rows: 0, eager: Some(EagerReason::NotCuda) }
    }

    /// Whether a step of `rows` rows should be replayed in `mode`.
    pub fn replays(&self, mode: CudaGraph, rows: usize) -> bool {
        mode != CudaGraph::Off && rows <= self.most_rows
    }

    /// The most rows a step replays (0 where none does; unbounded until a failure).
    pub fn most_rows(&self) -> usize {
        self.most_rows
    }

    /// Takes the failure to record or replay a step of `rows` rows. Under
    /// [`CudaGraph::On`] it is the step's error (returned); under `Auto` steps of `rows` or
    /// more run eagerly from here on, the reason kept, and the caller runs this step eagerly.
    /// Row counts are taken as powers of two: steps of half as many still replay.
    pub fn fall_back<E: GraphFailure>(&mut self, mode: CudaGraph, rows: usize, failure: E) -> Result<(), E> {
        if mode == CudaGraph::On {
            return Err(failure);
        }
        let rows = rows.max(1);
        // A backend without graphs replays nothing; a failed recording, only fewer rows.
        let (most_rows, reason) = match failure.not_cuda() {
            true => (0, EagerReason::NotCuda),
            false => (rows.next_power_of_two() / 2, EagerReason::GraphFailed { rows, reason: failure.to_string() }),
        };
        self.most_rows = self.most_rows.min(most_rows);
        self.eager = Some(reason);
        Ok(())
    }

    /// Why some steps run eagerly (`None` while every step replays, or none was tried).
    pub fn eager_reason(&self) -> Option<&EagerReason> {
        self.eager.as_ref()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn failure() -> ModelError {
        ModelError::InvalidInput("recording failed".into())
    }

    #[test]
    fn on_returns_the_failure_and_keeps_replaying() {
        let mut policy = GraphPolicy::default();
        assert!(policy.fall_back(CudaGraph::On, 8, failure()).is_err());
        assert_eq!(policy, GraphPolicy::default());
    }

    #[test]
    fn auto_stops_replaying_from_the_failed_row_count() {
        let mut policy = GraphPolicy::default();
        assert!(!policy.replays(CudaGraph::Off, 1), "off never replays");
        assert!(policy.fall_back(CudaGraph::Auto, 128, failure()).is_ok());
        assert_eq!(policy.most_rows(), 64);
        // A count between powers of two: half the next power.
        assert!(policy.fall_back(CudaGraph::Auto, 24, failure()).is_ok());
        assert_eq!(policy.most_rows(), 16);
        assert_eq!(
            policy.eager_reason().map(ToString::to_string).as_deref(),
            Some("steps of 24 rows or more: invalid input: recording failed")
        );
        // One row failing turns every step eager; a larger failure later does not undo it.
        assert!(policy.fall_back(CudaGraph::Auto, 1, failure()).is_ok());
        assert!(policy.fall_back(CudaGraph::Auto, 64, failure()).is_ok());
        assert_eq!(policy.most_rows(), 0);
        assert!(!policy.replays(CudaGraph::Auto, 1));
    }

    #[test]
    fn a_backend_without_graphs_is_said_so() {
        let mut policy = GraphPolicy::default();
        let not_cuda = ModelError::Graph(GraphError::NotCuda("NdArray".into()));
        assert!(policy.fall_back(CudaGraph::Auto, 64, not_cuda).is_ok());
        assert_eq!((policy.most_rows(), policy.eager_reason()), (0, Some(&EagerReason::NotCuda)));
        assert_eq!(policy, GraphPolicy::not_cuda());
    }
}
