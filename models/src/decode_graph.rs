//! Decode replayed as one CUDA graph per token (see [`burn_gemma_kernels::graph`]).
//!
//! [`DecodeGraphs`] records [`Gemma::decode_step`] once per bucket of positions (powers of two
//! from 256, so a 4,096-token generation records five times) and replays it: per token the
//! host writes the position, the token ids and the sampling draws into the step's buffers,
//! launches the graph, and reads the sampled ids back.
//!
//! [`DecodeGraphs::verify`] records the verify step of speculative decoding the same way: a
//! fixed number of consecutive positions of one sequence (the pending token and the drafts) in
//! one step ([`StepRows::Consecutive`]), each row's choice read back together.

use crate::{model::StepInputs, Gemma, KvCache, ModelError};
use burn::tensor::DType;
use burn_gemma_kernels::graph::{self, GraphError, Replay, StepBuffer, StepGraph};
use burn_gemma_kernels::{GemmaBackend, SamplingParams, StepRows};
use std::time::{Duration, Instant};

/// Whether decoding replays a recorded CUDA graph.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum CudaGraph {
    /// On CUDA when the step can be recorded; otherwise eager (saying why once).
    #[default]
    Auto,
    /// Always; an error where it cannot work.
    On,
    /// Never: every kernel launched eagerly.
    Off,
}

impl std::str::FromStr for CudaGraph {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "auto" => Ok(Self::Auto),
            "on" => Ok(Self::On),
            "off" => Ok(Self::Off),
            other => Err(format!("unknown CUDA-graph mode `{other}` (expected auto, on or off)")),
        }
    }
}

impl std::fmt::Display for CudaGraph {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Auto => "auto",
            Self::On => "on",
            Self::Off => "off",
        })
    }
}

/// Smallest position bound a recording serves.
const MIN_BOUND: usize = 256;

/// The bound of the bucket holding `position` in a cache of `capacity` positions: one less
/// than a power of two of at least `MIN_BOUND`, at most the last position.
pub fn bucket_bound(position: usize, capacity: usize) -> usize {
    (position + 1).next_power_of_two().max(MIN_BOUND).min(capacity.max(1)) - 1
}

/// `values` as the little-endian ints of a step buffer, `int_bytes` (4 or 8) each.
pub(crate) fn le_ints(values: impl IntoIterator<Item = u64>, int_bytes: usize) -> Vec<u8> {
    values.into_iter().flat_map(|v| v.to_le_bytes().into_iter().take(int_bytes)).collect()
}

/// One recorded step and its buffers.
struct Recorded<B: GemmaBackend> {
    bound: usize,
    graph: StepGraph,
    /// Kept alive with the graph (it reads and writes them).
    _inputs: StepInputs<B>,
    position: StepBuffer,
    ids: StepBuffer,
    draws: StepBuffer,
    out: StepBuffer,
    /// The step's logits buffer (rewritten by every replay).
    logits: burn::tensor::Tensor<B, 2>,
    int_bytes: usize,
}

/// What recording cost, for reports.
#[derive(Debug, Clone, Copy, Default)]
pub struct GraphSetup {
    /// Recordings made (one per bucket crossed).
    pub recordings: usize,
    /// Time spent recording, compiling and capturing.
    pub time: Duration,
    /// Kernel launches per replayed step (of the last recording).
    pub launches: usize,
    /// Distinct kernels compiled by NVRTC and loaded from the PTX cache, over all recordings.
    pub compiled: usize,
    pub cached: usize,
}

impl GraphSetup {
    /// Counts one recording begun at `start`, of `launches` launches and `(compiled, cached)`
    /// kernels.
    pub(crate) fn count(&mut self, start: Instant, launches: usize, (compiled, cached): (usize, usize)) {
        self.recordings += 1;
        self.time += start.elapsed();
        self.launches = launches;
        self.compiled += compiled;
        self.cached += cached;
    }
}

/// Decode steps of one model, cache and sampling configuration, recorded per bucket of
/// positions and replayed. Drop it when the cache is replaced (the graphs write the cache's
/// buffers); a [`KvCache::reset`] keeps it valid.
pub struct DecodeGraphs<B: GemmaBackend> {
    sampling: SamplingParams,
    /// Sequences per step, or consecutive rows of one sequence ([`DecodeGraphs::verify`]).
    batch: usize,
    rows: StepRows,
    capacity: usize,
    /// The [`KvCache::id`] of the cache the steps were recorded with (they write its buffers).
    cache: Option<u64>,
    current: Option<Recorded<B>>,
    setup: GraphSetup,
}

impl<B: GemmaBackend> DecodeGraphs<B> {
    /// Nothing recorded yet; steps sample with `sampling` for a cache of `batch` sequences and
    /// `capacity` positions.
    pub fn new(sampling: SamplingParams, batch: usize, capacity: usize) -> Self {
        let rows = StepRows::Sequences;
        Self { sampling, batch, rows, capacity, cache: None, current: None, setup: GraphSetup::default() }
    }

    /// Nothing recorded yet; each step runs `rows` consecutive positions of the only sequence
    /// of a cache of `capacity` positions (the pending token and `rows - 1` drafts: a verify
    /// step), every row sampled with `sampling`. The cache must keep every position of its
    /// sliding windows ([`crate::WindowStore::EveryPosition`]) where `rows > 1`.
    pub fn verify(sampling: SamplingParams, rows: usize, capacity: usize) -> Self {
        Self { rows: StepRows::Consecutive, ..Self::new(sampling, rows, capacity) }
    }

    /// Rows per step: sequences, or consecutive positions for [`DecodeGraphs::verify`].
    pub fn rows(&self) -> usize {
        self.batch
    }

    /// The sequences of the cache a step serves, and the positions it advances each by.
    fn cache_rows(&self) -> (usize, usize) {
        match self.rows {
            StepRows::Sequences => (self.batch, 1),
            StepRows::Consecutive => (1, self.batch),
        }
    }

    /// Whether these graphs serve `sampling` on a cache of this batch and capacity.
    pub fn serves(&self, sampling: &SamplingParams, cache: &KvCache<B>) -> bool {
        let (batch, _) = self.cache_rows();
        self.sampling == *sampling
            && batch == cache.batch()
            && self.capacity == cache.capacity()
            && self.cache.is_none_or(|id| id == cache.id())
    }

    /// What recording cost so far.
    pub fn setup(&self) -> GraphSetup {
        self.setup
    }

    /// The logits of the last replayed step, `[batch, vocab]` in the activation dtype (a view of
    /// the step's buffer: read it before the next step).
    pub fn last_logits(&self) -> Option<burn::tensor::Tensor<B, 2>> {
        self.current.as_ref().map(|r| r.logits.clone())
    }

    /// Host issue time and GPU time of the last replayed step.
    pub fn last_replay(&self) -> graph::ReplayTimes {
        self.current.as_ref().map(|r| r.graph.last_replay()).unwrap_or_default()
    }

    /// One decode step at the cache's length: `ids` (one per sequence) go in, the sampled ids
    /// come out, the cache advances by one. Records the step first when the position leaves the
    /// current bucket.
    ///
    /// For [`DecodeGraphs::verify`]: `ids` (one per row) at the cache's length onwards, the
    /// choice after each row comes out, and the cache advances by every row (take back those
    /// not kept with [`KvCache::rewind`]).
    pub fn step(
        &mut self,
        model: &Gemma<B>,
        cache: &mut KvCache<B>,
        ids: &[u32],
        draws: &[f32],
    ) -> Result<Vec<u32>, ModelError> {
        let (cache_batch, advance) = self.cache_rows();
        if ids.len() != self.batch
            || draws.len() != self.batch
            || cache.batch() != cache_batch
            || cache.capacity() != self.capacity
        {
            return Err(ModelError::InvalidInput(format!(
                "a decode graph for {} sequences of {} positions got {} ids and {} draws for a cache of {} x {}",
                self.batch,
                self.capacity,
                ids.len(),
                draws.len(),
                cache.batch(),
                cache.capacity()
            )));
        }
        self.prepare(model, cache)?;
        let position = cache.len();
        let Some(step) = self.current.as_mut() else {
            return Err(ModelError::Graph(GraphError::Unsupported("no recorded step".into())));
        };
        let position_bytes = le_ints([position as u64], step.int_bytes);
        let id_bytes = le_ints(ids.iter().map(|&t| u64::from(t)), step.int_bytes);
        let draw_bytes: Vec<u8> = draws.iter().flat_map(|d| d.to_le_bytes()).collect();
        let mut writes = vec![(&step.position, position_bytes.as_slice()), (&step.ids, id_bytes.as_slice())];
        if self.sampling.temperature != 0.0 {
            writes.push((&step.draws, draw_bytes.as_slice()));
        }
        let mut out = vec![0u8; self.batch * step.int_bytes];
        step.graph.replay(Replay { writes: &writes, read: Some((&step.out, &mut out)) })?;
        cache.advance(advance);
        Ok(out
            .chunks_exact(step.int_bytes)
            .map(|c| {
                let mut word = [0u8; 8];
                word[..c.len()].copy_from_slice(c);
                let v = i64::from_le_bytes(word);
                // A negative id (an i32 sign bit) or one past u32 is out of any vocabulary.
                u32::try_from(v).unwrap_or(u32::MAX)
            })
            .collect())
    }

    /// Records the step the cache's next position needs, unless the current recording serves
    /// it. [`DecodeGraphs::step`] does this itself; the shards of
    /// a split model do it first, all together, so that none replays a graph whose collectives
    /// the others would not join (a shard whose recording failed steps eagerly).
    pub fn prepare(&mut self, model: &Gemma<B>, cache: &mut KvCache<B>) -> Result<(), ModelError> {
        let (_, advance) = self.cache_rows();
        if let Some(recorded) = self.cache.filter(|&id| id != cache.id()) {
            return Err(ModelError::InvalidInput(format!(
                "these decode graphs were recorded with KV cache #{recorded} and write its buffers; \
                 cache #{} is another (make new DecodeGraphs for it)",
                cache.id()
            )));
        }
        cache.check_room(advance)?;
        // The last row's position picks the bucket.
        let last = cache.len() + advance - 1;
        if self.current.as_ref().is_some_and(|r| last <= r.bound) {
            return Ok(());
        }
        // Free the previous bucket's buffers before allocating the next.
        self.current = None;
        self.current = Some(self.record(model, cache, bucket_bound(last, self.capacity))?);
        self.cache = Some(cache.id());
        Ok(())
    }

    fn record(&mut self, model: &Gemma<B>, cache: &mut KvCache<B>, bound: usize) -> Result<Recorded<B>, ModelError> {
        let start = Instant::now();
        let device = model.device();
        let inputs = match self.rows {
            StepRows::Sequences => StepInputs::<B>::zeros(self.batch, bound, &device),
            StepRows::Consecutive => StepInputs::<B>::zeros_consecutive(self.batch, bound, &device),
        };
        let sampling = self.sampling;
        let (result, recording) = graph::record::<B, _>(&device, || model.decode_step(&inputs, cache, &sampling))?;
        let (out, logits) = result?;
        let launches = recording.launches();
        let graph = StepGraph::new(recording, model.tuning().dependent_launch)?;
        let kernels = graph.kernels();
        let int_bytes = inputs.position.dtype().size();
        if !matches!(int_bytes, 4 | 8) || out.dtype().size() != int_bytes || inputs.draws.dtype() != DType::F32 {
            return Err(GraphError::Unsupported(format!(
                "step buffers of {:?} / {:?} / {:?}",
                inputs.position.dtype(),
                out.dtype(),
                inputs.draws.dtype()
            ))
            .into());
        }
        let recorded = Recorded {
            bound,
            position: StepBuffer::int(&inputs.position)?,
            ids: StepBuffer::int(&inputs.ids)?,
            draws: StepBuffer::float(&inputs.draws)?,
            out: StepBuffer::int(&out)?,
            graph,
            _inputs: inputs,
            logits,
            int_bytes,
        };
        self.setup.count(start, launches, kernels);
        Ok(recorded)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_are_powers_of_two_within_the_cache() {
        // (position, capacity) -> bound
        let table = [
            (0, 4096, 255),
            (255, 4096, 255),
            (256, 4096, 511),
            (511, 4096, 511),
            (512, 4096, 1023),
            (4000, 4096, 4095),
            (10, 100, 99),
            (0, 1, 0),
        ];
        for (position, capacity, bound) in table {
            assert_eq!(bucket_bound(position, capacity), bound, "position {position} of {capacity}");
            assert!(bucket_bound(position, capacity) >= position.min(capacity - 1));
        }
    }

    #[test]
    fn modes_parse_and_print() {
        for mode in [CudaGraph::Auto, CudaGraph::On, CudaGraph::Off] {
            assert_eq!(mode.to_string().parse::<CudaGraph>(), Ok(mode));
        }
        assert!("yes".parse::<CudaGraph>().is_err());
    }
}
