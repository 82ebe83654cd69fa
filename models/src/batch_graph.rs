//! Batched decode steps replayed as CUDA graphs (see [`burn_gemma_kernels::graph`]).
//!
//! [`BatchGraphs`] records [`Gemma::decode_logits`] over the first `rows` sequences of a cache,
//! each at a position of its own (the engine's step, [`StepInputs::sequences`]), once per count
//! of rows and bucket of positions (powers of two from 256, as [`crate::DecodeGraphs`]), and
//! replays it: per step the host writes each row's position and token id (and, after the
//! sequences' blocks changed, the rows of a paged cache's block tables) into the step's
//! buffers, launches the graph and waits for it.
//! The logits stay on the device for the caller to sample.

use crate::decode_graph::{bucket_bound, le_ints, GraphSetup};
use crate::{model::StepInputs, Gemma, KvCache, ModelError};
use burn::tensor::Tensor;
use burn_gemma_kernels::graph::{self, GraphError, Replay, StepBuffer, StepGraph};
use burn_gemma_kernels::GemmaBackend;
use std::time::Instant;

/// One recorded step over `rows` sequences and its buffers.
struct Recorded<B: GemmaBackend> {
    rows: usize,
    bound: usize,
    graph: StepGraph,
    /// Kept alive with the graph (it reads them).
    _inputs: StepInputs<B>,
    positions: StepBuffer,
    ids: StepBuffer,
    /// The block tables the recording read, one per pool of a paged cache, and the
    /// [`KvCache::blocks_version`] of the rows they hold.
    tables: Vec<StepBuffer>,
    tables_version: u64,
    /// The step's logits buffer (rewritten by every replay).
    logits: Tensor<B, 2>,
    /// Bytes of one int of the step's buffers (and of the tables').
    int_bytes: usize,
}

/// Batched decode steps over one KV cache, recorded per count of rows and bucket of positions
/// and replayed (see the module's docs). The recordings write the cache's buffers: they are
/// dropped when a step comes with another cache.
pub struct BatchGraphs<B: GemmaBackend> {
    /// The [`KvCache::id`] of the cache the steps were recorded with.
    cache: Option<u64>,
    recorded: Vec<Recorded<B>>,
    setup: GraphSetup,
}

impl<B: GemmaBackend> Default for BatchGraphs<B> {
    fn default() -> Self {
        Self::new()
    }
}

impl<B: GemmaBackend> BatchGraphs<B> {
    /// Nothing recorded yet.
    pub fn new() -> Self {
        Self { cache: None, recorded: Vec::new(), setup: GraphSetup::default() }
    }

    /// What recording cost so far.
    pub fn setup(&self) -> GraphSetup {
        self.setup
    }

    /// [`Gemma::decode_logits`] over the first `ids.len()` sequences of `cache`, sequence `b`
    /// feeding `ids[b]` at `positions[b]`: the logits `[rows, vocab]`, a view of the step's
    /// buffer (use them before the next step over as many rows). Records the step first where
    /// no recording serves this many rows at these positions.
    ///
    /// Eager work queued before (prompts, [`KvCache::copy_sequence`]) is waited for first: the
    /// graph runs on a stream of its own.
    pub fn step(
        &mut self,
        model: &Gemma<B>,
        cache: &mut KvCache<B>,
        ids: &[u32],
        positions: &[usize],
    ) -> Result<Tensor<B, 2>, ModelError> {
        let rows = ids.len();
        if rows == 0 || positions.len() != rows || rows > cache.batch() {
            return Err(ModelError::InvalidInput(format!(
                "a batched decode step over {rows} tokens at {} positions, for a cache of {} sequences",
                positions.len(),
                cache.batch()
            )));
        }
        let highest = positions.iter().copied().max().unwrap_or(0);
        if highest >= cache.capacity() {
            return Err(ModelError::ContextOverflow { needed: highest + 1, capacity: cache.capacity() });
        }
        if self.cache.is_some_and(|id| id != cache.id()) {
            // Recorded over another cache's buffers: of no use for this one.
            self.recorded.clear();
        }
        let found = self.recorded.iter().position(|r| r.rows == rows && highest <= r.bound);
        let index = match found {
            Some(index) => index,
            None => {
                // Free the outgrown recording's buffers before allocating the next.
                self.recorded.retain(|r| r.rows != rows);
                let recorded = self.record(model, cache, rows, bucket_bound(highest, cache.capacity()))?;
                self.cache = Some(cache.id());
                self.recorded.push(recorded);
                self.recorded.len() - 1
            }
        };
        let step = &mut self.recorded[index];
        let position_bytes = le_ints(positions.iter().map(|&p| p as u64), step.int_bytes);
        let id_bytes = le_ints(ids.iter().map(|&t| u64::from(t)), step.int_bytes);
        let mut writes = vec![(&step.positions, position_bytes), (&step.ids, id_bytes)];
        // The tables again only where a sequence took, gave back or moved blocks since.
        let version = cache.blocks_version();
        if version != step.tables_version {
            let tables = cache.table_rows();
            if tables.len() != step.tables.len() {
                return Err(GraphError::Unsupported(format!(
                    "the step was recorded with {} block tables, the cache has {}",
                    step.tables.len(),
                    tables.len()
                ))
                .into());
            }
            for (buffer, table) in step.tables.iter().zip(tables) {
                writes.push((buffer, le_ints(table.into_iter().flatten().map(u64::from), step.int_bytes)));
            }
        }
        let writes: Vec<(&StepBuffer, &[u8])> =
            writes.iter().map(|(buffer, bytes)| (*buffer, bytes.as_slice())).collect();
        B::sync(&model.device()).map_err(|e| GraphError::Driver { call: "synchronize", reason: format!("{e:?}") })?;
        step.graph.replay(Replay { writes: &writes, read: None })?;
        step.tables_version = version;
        Ok(step.logits.clone())
    }

    fn record(
        &mut self,
        model: &Gemma<B>,
        cache: &mut KvCache<B>,
        rows: usize,
        bound: usize,
    ) -> Result<Recorded<B>, ModelError> {
        let start = Instant::now();
        let device = model.device();
        let inputs = StepInputs::<B>::zeros_per_sequence(rows, bound, &device);
        // Uploaded before recording, so that the step reads these tables (kept below).
        let tables = cache.block_tables();
        let int_bytes = inputs.position.dtype().size();
        let odd_table = tables.iter().find(|t| t.blocks.dtype().size() != int_bytes);
        if !matches!(int_bytes, 4 | 8) || inputs.ids.dtype().size() != int_bytes || odd_table.is_some() {
            return Err(GraphError::Unsupported(format!(
                "step buffers of {:?} / {:?} and block tables of {:?}",
                inputs.position.dtype(),
                inputs.ids.dtype(),
                odd_table.map(|t| t.blocks.dtype())
            ))
            .into());
        }
        let (result, recording) = graph::record::<B, _>(&device, || model.decode_logits(&inputs, cache))?;
        let logits = result?;
        let launches = recording.launches();
        let graph = StepGraph::new(recording, model.tuning().dependent_launch)?;
        let kernels = graph.kernels();
        let recorded = Recorded {
            rows,
            bound,
            positions: StepBuffer::int(&inputs.position)?,
            ids: StepBuffer::int(&inputs.ids)?,
            tables: tables.iter().map(|t| StepBuffer::int(&t.blocks)).collect::<Result<_, _>>()?,
            tables_version: cache.blocks_version(),
            graph,
            _inputs: inputs,
            logits,
            int_bytes,
        };
        self.setup.count(start, launches, kernels);
        Ok(recorded)
    }
}
