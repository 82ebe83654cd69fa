//! How batched decode steps run: eager, or replayed as CUDA graphs under one graph policy.

use crate::{
    graph_policy::{EagerReason, GraphPolicy},
    BatchGraphs, CudaGraph, Error, Gemma, GemmaBackend, GraphSetup, KvCache, ModelError, StepInputs,
};
use burn::tensor::Tensor;

use std::sync::{Arc, Mutex};

/// How batched decode steps run.
pub(super) enum Steps<B: GemmaBackend> {
    /// Eager: by choice, on a backend without graphs, or since a step could not be recorded.
    Eager,
    /// Replayed as CUDA graphs; under [`CudaGraph::Auto`] a step that cannot be recorded runs
    /// eagerly, and so do all steps of as many rows or more from then on ([`GraphPolicy`]; a
    /// model's products record up to some count of rows), the reason published in
    /// `eager_reason` ([`Engine::eager_reason`]); a step of one row that cannot be recorded
    /// turns them eager for good. Drafts are cut to keep a step within the rows that replay.
    Graphs {
        graphs: BatchGraphs<B>,
        mode: CudaGraph,
        policy: GraphPolicy,
        eager_reason: Arc<Mutex<Option<EagerReason>>>,
    },
}

impl<B: GemmaBackend> Steps<B> {
    /// The most rows a step replays as a graph (unbounded for eager steps).
    pub(super) fn most_rows(&self) -> usize {
        match self {
            Self::Graphs { policy, .. } => policy.most_rows(),
            Self::Eager => usize::MAX,
        }
    }
}

/// The logits of one batched step (`ids[b]` at `positions[b]` for the first rows of `rows`),
/// and whether a graph replayed it: a replayed graph, or eager where there is none or the step
/// has more rows than graphs take ([`Steps::Graphs`]). Under [`CudaGraph::Auto`] a graph error
/// lowers that count, or turns the steps eager for good at one row (the step runs eagerly then;
/// nothing of it ran on the device).
pub(super) fn step_logits<B: GemmaBackend>(
    model: &Gemma<B>,
    rows: &mut KvCache<B>,
    steps: &mut Steps<B>,
    ids: &[u32],
    positions: &[usize],
) -> Result<(Tensor<B, 2>, bool), Error> {
    if let Steps::Graphs { graphs, mode, policy, eager_reason } = steps {
        if policy.replays(*mode, ids.len()) {
            match graphs.step(model, rows, ids, positions) {
                Ok(logits) => return Ok((logits, true)),
                Err(e @ ModelError::Graph(_)) => {
                    // Auto: this step and larger ones eager from here on; On: the error.
                    policy.fall_back(*mode, ids.len(), e)?;
                    if let Ok(mut reason) = eager_reason.lock() {
                        *reason = policy.eager_reason().cloned();
                    }
                    if policy.most_rows() == 0 {
                        *steps = Steps::Eager;
                    }
                }
                Err(e) => return Err(e.into()),
            }
        }
    }
    let inputs = StepInputs::sequences(ids, positions, &model.device())?;
    Ok((model.decode_logits(&inputs, rows)?, false))
}

/// What recording the batched steps' graphs cost so far (`None` when they run eagerly).
pub(super) fn graph_setup<B: GemmaBackend>(steps: &Steps<B>) -> Option<GraphSetup> {
    match steps {
        Steps::Graphs { graphs, .. } => Some(graphs.setup()),
        Steps::Eager => None,
    }
}

/// Rows a batched step over `n` generating sequences runs: `n` rounded up to a power of two,
/// at most the cache's `batch`. Dense weights' prefill GEMM takes some row counts very badly
/// (on an H200, 9 rows of Gemma 3 4B's output projection took 3.4 ms against 0.05 ms for 16:
/// `docs/runs/gpu/2026-11-26-mma.md` call 2; quantized weights take any count from 3 to 64 alike),
/// and a bounded set of shapes is what recorded steps (CUDA graphs) will need.
pub(super) fn step_rows(n: usize, batch: usize) -> usize {
    n.next_power_of_two().min(batch).max(n)
}
