//! What the engine counts, and how its worker is.

use std::sync::{
    atomic::{AtomicU64, AtomicUsize},
    Mutex,
};

/// Counters of an engine, for monitoring (each read is a snapshot).
#[derive(Debug, Default)]
pub struct EngineMetrics {
    pub running: AtomicUsize,
    pub waiting: AtomicUsize,
    pub requests_finished: AtomicU64,
    pub requests_failed: AtomicU64,
    pub requests_refused: AtomicU64,
    pub prompt_tokens: AtomicU64,
    pub generated_tokens: AtomicU64,
    /// Bytes of KV cache allocated: the batched cache and the prompt caches.
    pub kv_cache_bytes: AtomicU64,
    /// Sequences of the batched KV cache in use (generating), of `max_running`.
    pub kv_sequences_in_use: AtomicUsize,
    /// KV blocks held by the generating sequences, and in all (summed over the cache's pools:
    /// the full-attention layers' and the sliding windows').
    pub kv_blocks_in_use: AtomicUsize,
    pub kv_blocks_total: AtomicUsize,
    /// Batched decode steps run, and the sequences they stepped, summed: their ratio is the
    /// mean batch.
    pub decode_steps: AtomicU64,
    pub decode_rows: AtomicU64,
    /// Microseconds spent in batched decode steps (the step, sampling, the tokens read back),
    /// and in prompt chunks (their first tokens included), summed.
    pub decode_micros: AtomicU64,
    pub prompt_micros: AtomicU64,
    /// Batched decode steps replayed as CUDA graphs (of `decode_steps`), the recordings made
    /// and the microseconds they took (included in `decode_micros`).
    pub decode_graph_steps: AtomicU64,
    pub graph_recordings: AtomicU64,
    pub graph_recording_micros: AtomicU64,
    /// Requests that got their first token, and the microseconds from submission to it, summed
    /// (waiting included): their ratio is the mean time to first token.
    pub first_tokens: AtomicU64,
    pub first_token_micros: AtomicU64,
    /// Requests whose prompt began with a cached prefix, and the prompt tokens it covered (not
    /// run through the model; also counted in `prompt_tokens`).
    pub prefix_hits: AtomicU64,
    pub prefix_cached_tokens: AtomicU64,
    /// KV blocks only the prefix cache holds (given up when requests need them), and the
    /// prompt blocks it gave up so far.
    pub kv_blocks_cached: AtomicUsize,
    pub prefix_blocks_given_up: AtomicU64,
    /// Tokens drafted ([`EngineConfig::drafts`]), and those the model kept: their ratio is the
    /// acceptance rate (each kept one a token without a step of its own).
    pub draft_tokens: AtomicU64,
    pub draft_tokens_accepted: AtomicU64,
    /// Panics the worker caught in its rounds (each ended the requests running then; the
    /// worker went on).
    pub worker_panics: AtomicU64,
}

/// Whether an engine's worker serves ([`Engine::health`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EngineHealth {
    /// Taking and running requests.
    Serving,
    /// Shutting down: no new requests; those in flight finish.
    Stopping,
    /// The worker stopped after a shutdown.
    Stopped,
    /// The worker stopped on a failure it could not recover from: every request is refused.
    Failed { reason: String },
}

/// The worker's side of [`EngineHealth`]: set by the thread that runs it when it ends.
#[derive(Debug, Default)]
pub(super) struct WorkerState(Mutex<Option<Result<(), String>>>);

impl WorkerState {
    pub(super) fn set(&self, outcome: Result<(), String>) {
        // A poisoned lock guards only this value: write through it.
        *self.0.lock().unwrap_or_else(|p| p.into_inner()) = Some(outcome);
    }

    pub(super) fn get(&self) -> Option<Result<(), String>> {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }
}
