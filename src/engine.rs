//! Many sequences on one model: an [`Engine`] owns a model on a worker thread and serves
//! requests submitted from any thread, each answered through its own [`RequestStream`].
//!
//! Scheduling is continuous: requests join and leave between steps. Up to
//! [`EngineConfig::max_running`] sequences run at once. Each round of the worker admits waiting
//! requests, advances every generating sequence by one token in **one batched decode step**,
//! then runs prompt chunks of the newcomers within the round's token budget
//! ([`EngineConfig::round_tokens`]), so a long prompt does not stall the others for longer than
//! a chunk.
//!
//! The generating sequences are the first sequences of one KV cache of `max_running`
//! sequences of [`EngineConfig::max_sequence_len`] positions each, each at its own position
//! ([`Gemma::decode_logits`]): a step reads the weights once for all of them. A prompt runs in
//! a cache of one sequence of its own (a few are kept for reuse), and when its first token is
//! out its keys and values join the batched cache; a sequence that leaves gives its place to
//! the last one. On CUDA the batched step replays a CUDA graph recorded once per count of rows
//! and bucket of positions ([`EngineConfig::cuda_graph`]). Sampling runs on the device, once
//! for all the sequences that sample alike.
//!
//! A request that finds [`EngineConfig::max_waiting`] requests already waiting is refused at
//! once ([`EngineError::QueueFull`]); one whose stream is dropped, or cancelled, stops at the
//! next round and frees its place; a failure in one prompt ends that request with its error
//! and leaves the others running (a failed batched step ends the sequences in it and starts a
//! fresh cache for the next).

use crate::{
    error::{BackendError, RequestError},
    generation::{
        check_input, check_vocabulary, checked_token, chunk_end, default_stop_tokens, first_sampled, prefill,
        prefill_with_images, sampled_ids, token_tensor,
    },
    graph_policy::{EagerReason, GraphPolicy},
    images::{ImageError, PanAndScan},
    output::{OutputRules, Room, SequenceOutput},
    sampling::Sampler,
    speculative::{
        judge::{greedy_verdict, judge},
        Drafts, PromptLookup, Proposal,
    },
    vision::{ImageProcessor, Picture, Vision},
    BatchGraphs, CudaGraph, Error, Gemma, GemmaBackend, GemmaConfig, GenerationConfig, GraphSetup, ImageEmbeds,
    KvCache, ModelError, PagedLayout, PrefixCache, Reservation, StepInputs, StopReason, Token, Tokenizer, WindowStore,
};
use burn::tensor::{Int, Tensor, TensorData};
use burn_gemma_kernels::{Draws, SamplingParams};

use std::{
    collections::VecDeque,
    num::NonZeroUsize,
    sync::{
        atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering},
        mpsc, Arc, Mutex,
    },
    thread::JoinHandle,
    time::{Duration, Instant},
};

/// How many requests an [`Engine`] serves at once and keeps waiting.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EngineConfig {
    /// Sequences generating at once: the batched KV cache holds this many.
    pub max_running: NonZeroUsize,
    /// Requests waiting for a place among the running; one more is refused.
    pub max_waiting: usize,
    /// Tokens a round runs through the model: one per generating sequence, then prompt chunks
    /// (each [`GenerationConfig::prefill_chunk`] long, the last shorter) while they fit. The
    /// first prompt chunk waiting runs whatever the budget, so prompts always advance; a long
    /// prompt delays the generating sequences by at most this many tokens' work per round.
    pub round_tokens: NonZeroUsize,
    /// Positions (prompt and generated) each sequence holds, at most the model's context. A
    /// longer prompt is refused; a sequence that fills its positions ends with
    /// [`StopReason::ContextFull`].
    pub max_sequence_len: NonZeroUsize,
    /// Positions the KV cache holds over all the generating sequences (per layer; the
    /// sliding-window layers hold at most a window per sequence). The cache is paged: each
    /// sequence holds blocks for its prompt and the tokens it may generate, taken when it is
    /// admitted and given back when it ends, and a request waits while the free blocks do not
    /// cover it. `None`: `max_running * max_sequence_len`, so that no request ever waits for
    /// blocks; less saves memory where requests are shorter than `max_sequence_len`.
    pub kv_positions: Option<NonZeroUsize>,
    /// Positions per KV block at most (a power of two; the cache takes the largest one up to
    /// this that divides `max_sequence_len` and the sliding windows).
    pub kv_block_size: NonZeroUsize,
    /// Whether batched decode steps replay CUDA graphs, recorded once per count of rows and
    /// bucket of positions ([`BatchGraphs`]). `Auto`: on CUDA, eager where a step cannot be
    /// recorded ([`Engine::eager_reason`] says why), and then for every step of as many rows or
    /// more (a model's products record up to some count of rows: 64 for this crate's Q4/Q8, 8
    /// for k-quant and dense weights; drafts are cut to stay below it); `On`: an error where it
    /// cannot work.
    pub cuda_graph: CudaGraph,
    /// Whether prompts' blocks stay cached for later prompts with the same beginning (a shared
    /// system prompt, the other choices of one request), which then run only the rest: their
    /// full-attention blocks are shared, the sliding windows' copied. `On` runs prompts in
    /// chunks of at most the shortest sliding window (so that every block can be cached), and
    /// a request whose prompt begins like one still running waits for it to be cached.
    pub prefix_cache: PrefixCache,
    /// Whether each generating sequence drafts tokens that its batched step verifies
    /// (speculative decoding, each sequence on its own: [`EngineDrafts`]).
    pub drafts: EngineDrafts,
}

/// Drafts in the batched engine: each generating sequence proposes the next few tokens, which
/// its rows of the next batched step score beside its own (the sequence's drafted positions as
/// rows reading and writing its KV blocks), and keeps the longest prefix the model agrees with
/// plus one token of its own ([`crate::speculative`]). Greedy sequences give the tokens they
/// give without drafts; sampled ones keep the model's distribution (the rejection rule); a
/// sequence with a repetition penalty does not draft.
///
/// Sequences draft while at most 8 generate (`DRAFTING_SEQUENCES`: more at once already share
/// each read of the weights), their drafts cut to the rows a recorded step takes
/// ([`EngineConfig::cuda_graph`]), shared out a token at a time.
///
/// The KV cache then keeps every position of the sliding-window layers (a slot per position,
/// masked by the window, [`WindowStore::EveryPosition`]): a full layer's memory for each of
/// them, where rings hold a window.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum EngineDrafts {
    /// No drafts: one token per sequence and step.
    #[default]
    Off,
    /// Prompt lookup ([`PromptLookup`], over the sequence's prompt and what it generated so
    /// far): up to `tokens` drafts a step, none where its last tokens did not occur before.
    PromptLookup { tokens: NonZeroUsize },
}

impl EngineDrafts {
    /// The most tokens a sequence drafts in a step.
    pub fn max_tokens(self) -> usize {
        match self {
            Self::Off => 0,
            Self::PromptLookup { tokens } => tokens.get(),
        }
    }

    /// How the KV cache keeps the sliding windows for these drafts.
    fn window_store(self) -> WindowStore {
        match self {
            Self::Off => WindowStore::Ring,
            Self::PromptLookup { .. } => WindowStore::EveryPosition,
        }
    }
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            max_running: NonZeroUsize::new(16).unwrap_or(NonZeroUsize::MIN),
            max_waiting: 256,
            round_tokens: NonZeroUsize::new(2048).unwrap_or(NonZeroUsize::MIN),
            max_sequence_len: NonZeroUsize::new(4096).unwrap_or(NonZeroUsize::MIN),
            kv_positions: None,
            kv_block_size: NonZeroUsize::new(32).unwrap_or(NonZeroUsize::MIN),
            cuda_graph: CudaGraph::Auto,
            prefix_cache: PrefixCache::On,
            drafts: EngineDrafts::Off,
        }
    }
}

/// One generation request: the prompt's token ids and how to continue them.
#[derive(Debug, Clone)]
pub struct Request {
    /// The prompt, already tokenized (BOS and chat template included where wanted).
    pub input: Vec<u32>,
    /// Most tokens to generate, how to choose them, extra stop tokens and stop strings (the
    /// text that could still begin one is held back from the token events until it cannot).
    /// Its `cuda_graph` stays at `Auto`: the engine's steps follow
    /// [`EngineConfig::cuda_graph`], and a request asking otherwise is refused.
    pub generation: GenerationConfig,
    /// Pictures for the runs of the image soft token in `input`, in order (an engine reading
    /// images: [`Engine::with_vision`]; [`ImageProcessor::expand`] places them in a prompt's
    /// text). A prompt with pictures is not cached for others, nor taken from the cache.
    pub images: Vec<Picture>,
}

impl Request {
    /// A request for `input` continued as `generation` says, without pictures.
    pub fn new(input: Vec<u32>, generation: GenerationConfig) -> Self {
        Self { input, generation, images: Vec::new() }
    }
}

/// What a request's stream yields.
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    /// The next generated token and the text it completes.
    Token(Token),
    /// The request is over.
    Done(Finish),
}

/// How a request ended.
#[derive(Debug, Clone, PartialEq)]
pub struct Finish {
    pub reason: StopReason,
    /// Text held back at the end (it could have begun a stop string, or was an unfinished
    /// character), to append after the last token's.
    pub text: String,
    pub prompt_tokens: usize,
    pub generated_tokens: usize,
    /// From submission to the first token (waiting included).
    pub time_to_first_token: Option<Duration>,
}

/// Why the engine refused a request or ended one.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// Too many requests are waiting already.
    #[error("the engine's queue is full ({waiting} requests waiting); try again later")]
    QueueFull { waiting: usize },
    /// The engine is shutting down or its worker has stopped.
    #[error("the engine is shut down")]
    ShutDown,
    /// The engine's worker failed and cannot continue ([`EngineHealth::Failed`]).
    #[error("the engine's worker failed: {reason}")]
    WorkerFailed { reason: String },
    /// The request itself is invalid, or its generation failed.
    #[error(transparent)]
    Generation(#[from] Error),
}

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
struct WorkerState(Mutex<Option<Result<(), String>>>);

impl WorkerState {
    fn set(&self, outcome: Result<(), String>) {
        // A poisoned lock guards only this value: write through it.
        *self.0.lock().unwrap_or_else(|p| p.into_inner()) = Some(outcome);
    }

    fn get(&self) -> Option<Result<(), String>> {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }
}

/// The receiving end of one request: its events in order, then nothing. Dropping it cancels
/// the request.
#[derive(Debug)]
pub struct RequestStream {
    events: mpsc::Receiver<Result<Event, EngineError>>,
    cancel: Arc<AtomicBool>,
}

impl RequestStream {
    /// The next event, waiting for it; `None` once the request is over.
    pub fn next_event(&self) -> Option<Result<Event, EngineError>> {
        self.events.recv().ok()
    }

    /// The events, borrowing the stream (which stays usable to cancel the request).
    pub fn events(&self) -> impl Iterator<Item = Result<Event, EngineError>> + '_ {
        std::iter::from_fn(move || self.next_event())
    }

    /// Stops the request at the worker's next round (its stream then ends with
    /// [`StopReason::Interrupted`]).
    pub fn cancel(&self) {
        self.cancel.store(true, Ordering::SeqCst);
    }

    /// A flag that cancels the request when set, for another thread to hold.
    pub fn cancel_flag(&self) -> Arc<AtomicBool> {
        Arc::clone(&self.cancel)
    }
}

impl Iterator for RequestStream {
    type Item = Result<Event, EngineError>;

    fn next(&mut self) -> Option<Self::Item> {
        self.next_event()
    }
}

impl Drop for RequestStream {
    fn drop(&mut self) {
        self.cancel.store(true, Ordering::SeqCst);
    }
}

/// A request on its way to the worker.
pub(crate) struct Submitted {
    pub(crate) request: Request,
    pub(crate) sampler: Sampler,
    pub(crate) events: mpsc::Sender<Result<Event, EngineError>>,
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

/// A model serving many requests from a worker thread (see the module's docs).
pub struct Engine {
    commands: mpsc::Sender<Command>,
    worker: Option<JoinHandle<()>>,
    metrics: Arc<EngineMetrics>,
    config: EngineConfig,
    tokenizer: Arc<Tokenizer>,
    vocab: usize,
    max_context: usize,
    /// Positions per sequence.
    capacity: usize,
    /// Most positions one sequence can hold KV blocks for.
    reservable: usize,
    accepting: Arc<AtomicBool>,
    eager_reason: Arc<Mutex<Option<EagerReason>>>,
    /// How the model's pictures are prepared and placed, where it reads them.
    images: Option<ImageProcessor>,
    /// How the worker thread ended, once it has.
    worker_state: Arc<WorkerState>,
}

/// What every engine's front holds, whatever its worker: the model's limits against the
/// requests, the shared tokenizer, metrics and eager-step reason.
struct Front {
    tokenizer: Arc<Tokenizer>,
    vocab: usize,
    max_context: usize,
    /// Positions per sequence.
    capacity: usize,
    /// Most positions one sequence can hold KV blocks for (`capacity` unless a paged cache
    /// says fewer).
    reservable: usize,
    metrics: Arc<EngineMetrics>,
    eager_reason: Arc<Mutex<Option<EagerReason>>>,
    images: Option<ImageProcessor>,
}

impl Front {
    /// `tokenizer` checked against `model`'s vocabulary; sequences of `config`'s length, at most
    /// the model's context.
    fn new(model: &GemmaConfig, tokenizer: Tokenizer, config: &EngineConfig) -> Result<Self, Error> {
        check_vocabulary(model, &tokenizer)?;
        let max_context = model.max_position_embeddings;
        let capacity = config.max_sequence_len.get().min(max_context);
        Ok(Self {
            tokenizer: Arc::new(tokenizer),
            vocab: model.vocab_size,
            max_context,
            capacity,
            reservable: capacity,
            metrics: Arc::new(EngineMetrics::default()),
            eager_reason: Arc::new(Mutex::new(None)),
            images: None,
        })
    }
}

impl std::fmt::Debug for Engine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine").field("config", &self.config).field("metrics", &self.metrics).finish()
    }
}

impl Engine {
    /// Starts the worker thread, which owns `model` from here on.
    pub fn new<B: GemmaBackend>(model: Gemma<B>, tokenizer: Tokenizer, config: EngineConfig) -> Result<Self, Error>
    where
        Gemma<B>: Send + 'static,
    {
        Self::with_vision(model, None, tokenizer, config)
    }

    /// [`Engine::new`] for a model that reads pictures with `vision` (requests'
    /// [`Request::images`]). A prompt's pictures run through the tower on the worker thread
    /// when the prompt is admitted, between the rounds of the others.
    pub fn with_vision<B: GemmaBackend>(
        model: Gemma<B>,
        vision: Option<Vision<B>>,
        tokenizer: Tokenizer,
        config: EngineConfig,
    ) -> Result<Self, Error>
    where
        Gemma<B>: Send + 'static,
    {
        crate::tensor_parallel::refuse_shard(&model)?;
        check_vocabulary(model.config(), &tokenizer)?;
        if let Some(v) = &vision {
            v.check_fits(model.config().hidden_size, model.config().vocab_size)?;
        }
        let mut front = Front::new(model.config(), tokenizer, &config)?;
        front.images = vision.as_ref().map(Vision::processor);
        let default_stops = default_stop_tokens(model.config(), &front.tokenizer);
        let capacity = front.capacity;
        // The batched cache, allocated here so that one the device cannot hold fails at once.
        // Whole blocks: the cache holds the sequences' positions rounded up to a block.
        let cache_capacity = capacity.next_multiple_of(config.kv_block_size.get());
        let layout = PagedLayout {
            sequences: config.max_running.get(),
            capacity: cache_capacity,
            block_size: PagedLayout::block_size_for(model.config(), cache_capacity, config.kv_block_size.get()),
            positions: config.kv_positions.map(NonZeroUsize::get),
            prefix_cache: config.prefix_cache,
            window_store: config.drafts.window_store(),
            // Every sequence that may draft, at once.
            draft_rows: config.max_running.get().min(DRAFTING_SEQUENCES).saturating_mul(config.drafts.max_tokens()),
        };
        let steps = match (config.cuda_graph, burn_gemma_kernels::graph::available::<B>(&model.device())) {
            (CudaGraph::Off, _) | (CudaGraph::Auto, Err(_)) => Steps::Eager,
            // Said at once, not at the first step.
            (CudaGraph::On, Err(e)) => return Err(ModelError::from(e).into()),
            (mode, Ok(())) => {
                let eager_reason = Arc::clone(&front.eager_reason);
                Steps::Graphs { graphs: BatchGraphs::new(), mode, policy: GraphPolicy::default(), eager_reason }
            }
        };
        let rows = model.new_paged_cache(layout)?;
        front.reservable = rows.reservable_positions().unwrap_or(capacity);
        front.metrics.kv_cache_bytes.store(rows.device_bytes() as u64, Ordering::SeqCst);
        front.metrics.kv_blocks_total.store(rows.blocks_in_use().map_or(0, |(_, all)| all), Ordering::SeqCst);
        let worker = Worker {
            steps,
            model,
            vision,
            tokenizer: Arc::clone(&front.tokenizer),
            default_stops,
            config,
            metrics: Arc::clone(&front.metrics),
            waiting: VecDeque::new(),
            running: Vec::new(),
            rows,
            capacity,
            generating: 0,
            spare: Vec::new(),
            broken: None,
            draining: false,
            #[cfg(test)]
            fault: false,
        };
        Self::start(front, config, "burn-gemma-engine", move |inbox| worker.run(inbox))
    }

    /// An engine over a model split across devices ([`ShardedModel`], tensor parallelism):
    /// requests are taken as [`Engine::new`]'s are, and answered **one at a time**, in order
    /// (the split model decodes one sequence; `config`'s limits on waiting requests and
    /// sequence length apply, its batching, paging, prefix and draft settings do not). Greedy
    /// requests without a repetition penalty pick their tokens on the devices (each decode step
    /// one CUDA graph per GPU, as the model's [`ShardedModel::set_cuda_graph`] says).
    ///
    /// [`ShardedModel`]: crate::tensor_parallel::ShardedModel
    /// [`ShardedModel::set_cuda_graph`]: crate::tensor_parallel::ShardedModel::set_cuda_graph
    pub fn sharded<B: GemmaBackend>(
        model: crate::tensor_parallel::ShardedModel<B>,
        tokenizer: Tokenizer,
        config: EngineConfig,
    ) -> Result<Self, Error> {
        let front = Front::new(model.config(), tokenizer, &config)?;
        let worker = crate::tensor_parallel::serve::Serving {
            default_stops: default_stop_tokens(model.config(), &front.tokenizer),
            model,
            tokenizer: Arc::clone(&front.tokenizer),
            capacity: front.capacity,
            metrics: Arc::clone(&front.metrics),
            eager_reason: Arc::clone(&front.eager_reason),
        };
        Self::start(front, config, "burn-gemma-sharded-engine", move |inbox| worker.run(inbox))
    }

    /// The engine over `front`, its worker `run` on a thread named `name` taking its commands.
    fn start(
        front: Front,
        config: EngineConfig,
        name: &str,
        run: impl FnOnce(mpsc::Receiver<Command>) + Send + 'static,
    ) -> Result<Self, Error> {
        let (commands, inbox) = mpsc::channel();
        let worker_state = Arc::new(WorkerState::default());
        let state = Arc::clone(&worker_state);
        let worker = std::thread::Builder::new()
            .name(name.into())
            .spawn(move || {
                // A panic that escapes the worker's own recovery ends it: said, not hidden.
                let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| run(inbox)));
                state.set(outcome.map_err(|panic| panic_message(&*panic)));
            })
            .map_err(|e| BackendError::Thread { what: "engine worker", reason: e.to_string() })?;
        let Front { tokenizer, vocab, max_context, capacity, reservable, metrics, eager_reason, images } = front;
        Ok(Self {
            commands,
            worker: Some(worker),
            metrics,
            config,
            tokenizer,
            vocab,
            max_context,
            capacity,
            reservable,
            accepting: Arc::new(AtomicBool::new(true)),
            eager_reason,
            images,
            worker_state,
        })
    }

    /// Whether the worker serves: what a health check reports.
    pub fn health(&self) -> EngineHealth {
        match self.worker_state.get() {
            Some(Err(reason)) => EngineHealth::Failed { reason },
            // A worker that ended while the engine still took requests ended on its own.
            Some(Ok(())) if self.accepting.load(Ordering::SeqCst) => {
                EngineHealth::Failed { reason: "the worker stopped".into() }
            }
            Some(Ok(())) => EngineHealth::Stopped,
            None if self.accepting.load(Ordering::SeqCst) => EngineHealth::Serving,
            None => EngineHealth::Stopping,
        }
    }

    /// Makes the worker panic where `fault` says.
    #[cfg(test)]
    pub(crate) fn inject(&self, fault: Fault) {
        let _ = self.commands.send(Command::Fault(fault));
    }

    /// Why batched steps run eagerly under [`CudaGraph::Auto`] on CUDA: the reason a step could
    /// not be recorded (`None` while they replay graphs, or were never to: other backends,
    /// [`CudaGraph::Off`]).
    pub fn eager_reason(&self) -> Option<EagerReason> {
        self.eager_reason.lock().ok().and_then(|r| r.clone())
    }

    /// How the model's pictures are prepared and placed in a prompt, where it reads them
    /// ([`Engine::with_vision`]).
    pub fn image_processor(&self) -> Option<&ImageProcessor> {
        self.images.as_ref()
    }

    /// Prepares Gemma 3 pictures with pan-and-scan from here on (`Some`), or without: what
    /// [`Engine::image_processor`] (and so the server) makes of pictures. Fails for an engine
    /// that reads no pictures or reads Gemma 4's.
    pub fn set_pan_and_scan(&mut self, rule: Option<PanAndScan>) -> Result<(), Error> {
        let processor = self.images.clone().ok_or(ImageError::NoVision)?;
        self.images = Some(processor.with_pan_and_scan(rule)?);
        Ok(())
    }

    /// The model's tokenizer.
    pub fn tokenizer(&self) -> &Tokenizer {
        &self.tokenizer
    }

    /// The engine's counters.
    pub fn metrics(&self) -> &EngineMetrics {
        &self.metrics
    }

    /// Positions (prompt and generated) one request's sequence holds: its
    /// [`EngineConfig::max_sequence_len`], at most the model's context.
    pub fn sequence_positions(&self) -> usize {
        self.capacity
    }

    /// The engine's limits.
    pub fn config(&self) -> EngineConfig {
        self.config
    }

    /// Queues `request`; its events come through the returned stream. Checks the request before
    /// queueing it (empty input, ids outside the vocabulary, no new tokens, sampling values,
    /// context length), so a bad one is refused here with the reason.
    pub fn submit(&self, request: Request) -> Result<RequestStream, EngineError> {
        match self.health() {
            EngineHealth::Serving => {}
            EngineHealth::Failed { reason } => return Err(EngineError::WorkerFailed { reason }),
            EngineHealth::Stopping | EngineHealth::Stopped => return Err(EngineError::ShutDown),
        }
        check(&request, self.vocab, self.max_context, self.capacity)?;
        match (&self.images, request.images.is_empty()) {
            (_, true) => {}
            (None, false) => return Err(Error::from(ImageError::NoVision).into()),
            (Some(processor), false) => {
                processor.places(&request.input, &request.images).map_err(Error::from)?;
            }
        }
        let needed = reserved_positions(&request, self.capacity);
        if needed > self.reservable {
            return Err(Error::from(RequestError::KvCacheTooSmall { needed, limit: self.reservable }).into());
        }
        // Its settings checked here, with the other checks.
        let sampler = Sampler::new(request.generation.sampling.clone())?;
        // Checked and counted in one step, so that racing submits cannot both take the last place.
        let max = self.config.max_waiting;
        let counted =
            self.metrics.waiting.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |w| (w < max).then_some(w + 1));
        if let Err(waiting) = counted {
            self.metrics.requests_refused.fetch_add(1, Ordering::Relaxed);
            return Err(EngineError::QueueFull { waiting });
        }
        let (events, receiver) = mpsc::channel();
        let cancel = Arc::new(AtomicBool::new(false));
        let submitted = Submitted { request, sampler, events, cancel: Arc::clone(&cancel), submitted: Instant::now() };
        if self.commands.send(Command::Submit(Box::new(submitted))).is_err() {
            self.metrics.waiting.fetch_sub(1, Ordering::SeqCst);
            return Err(match self.health() {
                EngineHealth::Failed { reason } => EngineError::WorkerFailed { reason },
                _ => EngineError::ShutDown,
            });
        }
        Ok(RequestStream { events: receiver, cancel })
    }

    /// Takes no more requests, lets the running and waiting ones finish, and waits for the
    /// worker to stop.
    pub fn shutdown(mut self) {
        self.stop(Command::Drain);
    }

    fn stop(&mut self, how: Command) {
        self.accepting.store(false, Ordering::SeqCst);
        // A worker that already stopped has nothing left to finish.
        let _ = self.commands.send(how);
        if let Some(worker) = self.worker.take() {
            let _ = worker.join();
        }
    }
}

impl Drop for Engine {
    /// Cancels every request and waits for the worker to stop.
    fn drop(&mut self) {
        if self.worker.is_some() {
            self.stop(Command::Abort);
        }
    }
}

/// The checks [`Engine::submit`] makes before queueing.
fn check(request: &Request, vocab: usize, max_context: usize, capacity: usize) -> Result<(), Error> {
    let generation = &request.generation;
    check_input(&request.input, generation, vocab)?;
    if generation.cuda_graph != CudaGraph::Auto {
        return Err(RequestError::CudaGraphPerRequest { asked: generation.cuda_graph }.into());
    }
    let prompt = request.input.len();
    if prompt >= max_context {
        let new = generation.max_new_tokens;
        return Err(RequestError::ContextOverflow {
            context: 0,
            prompt,
            new,
            needed: prompt.saturating_add(new),
            limit: max_context,
        }
        .into());
    }
    if prompt >= capacity {
        return Err(RequestError::SequenceTooLong { prompt, limit: capacity }.into());
    }
    Ok(())
}

/// KV positions a request's sequence holds blocks for: its prompt and the tokens it may
/// generate, within the sequence's positions.
fn reserved_positions(request: &Request, capacity: usize) -> usize {
    request.input.len().saturating_add(request.generation.max_new_tokens).min(capacity)
}

/// Where a running sequence's keys and values are.
// A few dozen sequences at most are running: the prompt's cache held inline costs nothing worth
// a box.
#[allow(clippy::large_enum_variant)]
enum Place<B: GemmaBackend> {
    /// Its prompt runs in a cache of its own; the blocks of the batched cache it will hold.
    Prompt(KvCache<B>, Reservation),
    /// Generating: sequence `row` of the batched cache.
    Row(usize),
}

/// A running request.
struct Sequence<B: GemmaBackend> {
    submitted: Submitted,
    place: Place<B>,
    /// Prompt and generated tokens in the cache so far.
    context: Vec<u32>,
    /// What the next step feeds the model: the prompt first, then the last token.
    input: Vec<u32>,
    /// Stop tokens, stop strings, limits and the text held back.
    output: SequenceOutput,
    first_token: Option<Duration>,
    /// Positions its cache holds.
    capacity: usize,
    /// Tokens per prompt chunk: the request's, at most the shortest sliding window where
    /// prompts are cached ([`EngineConfig::prefix_cache`]).
    chunk: NonZeroUsize,
    /// The embeddings of the pictures still to run, by their row in `input`.
    images: Vec<ImageEmbeds<B>>,
}

impl<B: GemmaBackend> Sequence<B> {
    /// The batched cache's sequence it generates in, once its prompt is done.
    fn row(&self) -> Option<usize> {
        match self.place {
            Place::Row(row) => Some(row),
            Place::Prompt(..) => None,
        }
    }

    /// Tokens its next prompt step runs: the next chunk, run on to the end of a picture it
    /// would end inside (a picture's soft tokens attend to each other in one step).
    fn next_chunk(&self) -> usize {
        chunk_end(&self.images, self.input.len().min(self.chunk.get()))
    }

    /// Whether its prompt had pictures (such a prompt's blocks are not shared).
    fn has_images(&self) -> bool {
        !self.submitted.request.images.is_empty()
    }
}

/// The most sequences generating at once for which sequences draft: where more generate, a
/// batched step already shares each read of the weights among many rows, and drafts cost more
/// than they keep. On an H200 (random-weight Gemma 3 1B, Q4, copy-heavy prompts, 4 drafts a
/// step), 1 request decoded at 1.63x its speed without drafts and 8 at 1.31x, 16 drafting one
/// token each at 0.93x and 32 drafting 4 at 0.73x (`docs/gpu-runs/2026-11-29-engine-drafts`,
/// calls 1-3).
const DRAFTING_SEQUENCES: usize = 8;

/// Caches of one sequence kept for the next prompts: a few, as prompts run one chunk at a time.
const SPARE_PROMPT_CACHES: usize = 4;

/// How batched decode steps run.
enum Steps<B: GemmaBackend> {
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
    fn most_rows(&self) -> usize {
        match self {
            Self::Graphs { policy, .. } => policy.most_rows(),
            Self::Eager => usize::MAX,
        }
    }
}

struct Worker<B: GemmaBackend> {
    model: Gemma<B>,
    /// The model's image reader, where it reads pictures.
    vision: Option<Vision<B>>,
    steps: Steps<B>,
    tokenizer: Arc<Tokenizer>,
    /// The model's stop tokens, which every request's own extend.
    default_stops: Vec<u32>,
    config: EngineConfig,
    metrics: Arc<EngineMetrics>,
    waiting: VecDeque<Submitted>,
    running: Vec<Sequence<B>>,
    /// The generating sequences' keys and values: its first `generating` sequences.
    rows: KvCache<B>,
    /// Positions per sequence (the cache's capacity is this rounded up to a block).
    capacity: usize,
    generating: usize,
    /// Prompt caches of finished prompts, reset, for the next.
    spare: Vec<KvCache<B>>,
    /// Why the batched cache can no longer be trusted (a sequence could not be moved in it):
    /// the generating sequences end with this at the next round.
    broken: Option<String>,
    draining: bool,
    /// Test builds: a panic the next round makes.
    #[cfg(test)]
    fault: bool,
}

/// What one step of a sequence came to.
enum Stepped {
    Continue,
    Finished(StopReason),
}

impl<B: GemmaBackend> Worker<B> {
    fn run(mut self, inbox: mpsc::Receiver<Command>) {
        loop {
            let idle = self.waiting.is_empty() && self.running.is_empty();
            if idle && self.draining {
                return;
            }
            // Idle: wait for work; busy: take what came in since the last round.
            let first = if idle { inbox.recv().ok() } else { inbox.try_recv().ok() };
            if idle && first.is_none() {
                return; // every sender is gone
            }
            for command in first.into_iter().chain(std::iter::from_fn(|| inbox.try_recv().ok())) {
                match command {
                    Command::Submit(s) => self.waiting.push_back(*s),
                    Command::Drain => self.draining = true,
                    Command::Abort => {
                        self.abort();
                        return;
                    }
                    #[cfg(test)]
                    Command::Fault(Fault::Round) => self.fault = true,
                    #[cfg(test)]
                    Command::Fault(Fault::Worker) => panic!("a fault injected outside the rounds"),
                }
            }
            // A panic anywhere in a round (the steps catch the backend's own) ends the requests
            // running then; those waiting, and the engine, go on.
            let round = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                self.admit();
                self.round();
            }));
            if let Err(panic) = round {
                self.recover(panic_message(&*panic));
            }
        }
    }

    /// After a panic in a round: every running request ends with it, and the batched cache
    /// (whose state the round may have left half changed) is made anew.
    fn recover(&mut self, message: String) {
        self.metrics.worker_panics.fetch_add(1, Ordering::Relaxed);
        while let Some(mut sequence) = self.running.pop() {
            self.metrics.running.fetch_sub(1, Ordering::SeqCst);
            // Its blocks go with the cache replaced below.
            if let Place::Prompt(cache, _) = std::mem::replace(&mut sequence.place, Place::Row(usize::MAX)) {
                self.keep_spare(cache);
            }
            self.fail_with_panic(&sequence.submitted.events, "an engine round", message.clone());
        }
        self.generating = 0;
        self.broken = Some(message);
        self.renew_rows();
    }

    /// Ends a request through `events` with the panic (its `message`) caught while `what`.
    fn fail_with_panic(&self, events: &mpsc::Sender<Result<Event, EngineError>>, what: &'static str, message: String) {
        self.metrics.requests_failed.fetch_add(1, Ordering::Relaxed);
        let e = BackendError::Panicked { what, message };
        let _ = events.send(Err(EngineError::Generation(e.into())));
    }

    /// Moves waiting requests to the running while there is room: each gets a prompt cache.
    ///
    /// Each takes the KV blocks it will hold in the batched cache; the first waiting request
    /// whose blocks are not free waits, and the ones behind it with it (in order of arrival),
    /// until sequences leave.
    fn admit(&mut self) {
        // Requests waiting for a running prompt's blocks to be cached, in order.
        let mut following = Vec::new();
        while self.running.len() < self.config.max_running.get() {
            let Some(submitted) = self.waiting.pop_front() else { break };
            if submitted.cancelled() {
                self.metrics.waiting.fetch_sub(1, Ordering::SeqCst);
                self.finish_cancelled(submitted);
                continue;
            }
            let pictures = !submitted.request.images.is_empty();
            if !pictures && self.follows_a_prompt(&submitted.request.input) {
                following.push(submitted);
                continue;
            }
            let positions = reserved_positions(&submitted.request, self.capacity);
            // A prompt with pictures shares no blocks: its soft tokens' ids do not say which
            // picture they hold.
            let prompt: &[u32] = match (self.config.prefix_cache, pictures) {
                (PrefixCache::On, false) => &submitted.request.input,
                _ => &[],
            };
            let reservation = match self.rows.reserve_prompt(positions, prompt) {
                Ok(reservation) => reservation,
                Err(ModelError::KvBlocks { .. }) if !self.running.is_empty() => {
                    // Blocks come back as the running leave.
                    self.waiting.push_front(submitted);
                    break;
                }
                Err(e) => {
                    self.metrics.waiting.fetch_sub(1, Ordering::SeqCst);
                    self.metrics.requests_failed.fetch_add(1, Ordering::Relaxed);
                    let _ = submitted.events.send(Err(EngineError::Generation(e.into())));
                    continue;
                }
            };
            self.metrics.waiting.fetch_sub(1, Ordering::SeqCst);
            // A panic in starting one request ends that request alone.
            let events = submitted.events.clone();
            let started = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.start(submitted, reservation)));
            let started = match started {
                Ok(started) => started,
                Err(panic) => {
                    self.metrics.worker_panics.fetch_add(1, Ordering::Relaxed);
                    self.fail_with_panic(&events, "starting a request", panic_message(&*panic));
                    continue;
                }
            };
            match started {
                Ok(sequence) => {
                    self.metrics.running.fetch_add(1, Ordering::SeqCst);
                    let prompt = sequence.submitted.request.input.len();
                    self.metrics.prompt_tokens.fetch_add(prompt as u64, Ordering::Relaxed);
                    self.running.push(sequence);
                }
                Err(failed) => {
                    let (submitted, reservation, e) = *failed;
                    self.rows.release_reservation(reservation);
                    self.metrics.requests_failed.fetch_add(1, Ordering::Relaxed);
                    let _ = submitted.events.send(Err(EngineError::Generation(e)));
                }
            }
        }
        for submitted in following.into_iter().rev() {
            self.waiting.push_front(submitted);
        }
    }

    /// Whether a prompt beginning with `input` would find more of itself cached after a prompt
    /// still running is (one starting with the same blocks): then it waits for that one.
    fn follows_a_prompt(&mut self, input: &[u32]) -> bool {
        let (PrefixCache::On, Some(bs)) = (self.config.prefix_cache, self.rows.block_size()) else { return false };
        // How far each running prompt could still cache this one's beginning.
        let reach = self.running.iter().filter(|leader| !leader.has_images()).filter_map(|leader| {
            let Place::Prompt(_, reservation) = &leader.place else { return None };
            let theirs = &leader.submitted.request.input;
            let common = input.iter().zip(theirs).take_while(|(a, b)| a == b).count();
            let reach = common.min(input.len().saturating_sub(1)).min(theirs.len()) / bs * bs;
            (reservation.prefix_blocks() * bs < reach).then_some(reach)
        });
        // The index is looked up only where some running prompt could add to it.
        match reach.max() {
            Some(reach) => reach > self.rows.cached_prefix(input),
            None => false,
        }
    }

    /// A sequence for `submitted`: a prompt cache (a spare one where there is one), its stop
    /// tokens.
    fn start(
        &mut self,
        submitted: Submitted,
        mut reservation: Reservation,
    ) -> Result<Sequence<B>, Box<(Submitted, Reservation, Error)>> {
        let mut cache = match self.spare.pop() {
            Some(cache) => cache,
            None => match self.model.new_cache_with(1, self.rows.capacity(), self.config.drafts.window_store()) {
                Ok(cache) => {
                    self.metrics.kv_cache_bytes.fetch_add(cache.device_bytes() as u64, Ordering::SeqCst);
                    cache
                }
                Err(e) => return Err(Box::new((submitted, reservation, e.into()))),
            },
        };
        // A cached prefix goes into the prompt's cache, and the prompt runs from its end.
        if let Err(e) = self.rows.fill_prefix(&mut reservation, &mut cache) {
            self.keep_spare(cache);
            return Err(Box::new((submitted, reservation, e.into())));
        }
        let cached = reservation.cached_positions();
        if cached > 0 {
            self.metrics.prefix_hits.fetch_add(1, Ordering::Relaxed);
            self.metrics.prefix_cached_tokens.fetch_add(cached as u64, Ordering::Relaxed);
        }
        let generation = &submitted.request.generation;
        let output = SequenceOutput::new(OutputRules {
            stop_tokens: self.default_stops.iter().chain(&generation.stop_tokens).copied().collect(),
            stop_strings: generation.stop_strings.clone(),
            max_new_tokens: generation.max_new_tokens,
        });
        let mut input = submitted.request.input.clone();
        // What the request asks for is not what it can hold: at most its sequence's positions.
        let mut context = Vec::with_capacity(reserved_positions(&submitted.request, self.capacity));
        context.extend(input.drain(..cached));
        let chunk = match (self.config.prefix_cache, self.rows.ring_slots().and_then(NonZeroUsize::new)) {
            (PrefixCache::On, Some(ring)) => generation.prefill_chunk.min(ring),
            _ => generation.prefill_chunk,
        };
        // The pictures' embeddings, by their row in what the prompt still runs (none of it was
        // cached: a prompt with pictures takes no prefix).
        let pictures = &submitted.request.images;
        let images = match (&self.vision, pictures.is_empty()) {
            (_, true) => Ok(Vec::new()),
            (Some(vision), false) => {
                let device = self.model.device();
                catch_panic("the vision tower", || vision.embeds(&input, pictures, &device))
            }
            (None, false) => Err(ImageError::NoVision.into()),
        };
        let images = match images {
            Ok(images) => images,
            Err(e) => {
                self.keep_spare(cache);
                return Err(Box::new((submitted, reservation, e)));
            }
        };
        Ok(Sequence {
            place: Place::Prompt(cache, reservation),
            context,
            input,
            chunk,
            output,
            first_token: None,
            capacity: self.capacity,
            images,
            submitted,
        })
    }

    /// One token for every generating sequence in one batched step, then prompt chunks within
    /// the round's budget ([`EngineConfig::round_tokens`]); the finished leave.
    fn round(&mut self) {
        #[cfg(test)]
        if self.fault && !self.running.is_empty() {
            self.fault = false;
            panic!("a fault injected in a round");
        }
        let mut budget = self.config.round_tokens.get();
        self.leave_cancelled();
        if let Some(reason) = self.broken.clone() {
            self.fail_generating(reason);
        }
        if self.generating > 0 {
            budget = budget.saturating_sub(self.generating);
            self.generate();
        }
        let mut chunk_ran = false;
        let mut i = 0;
        while i < self.running.len() {
            let sequence = &self.running[i];
            let tokens = sequence.next_chunk();
            if sequence.row().is_some() || (chunk_ran && tokens > budget) {
                i += 1;
                continue;
            }
            budget = budget.saturating_sub(tokens);
            chunk_ran = true;
            let started = std::time::Instant::now();
            let stepped = self.advance_prompt(i);
            self.metrics.prompt_micros.fetch_add(started.elapsed().as_micros() as u64, Ordering::Relaxed);
            match stepped {
                Ok(Stepped::Continue) => i += 1,
                Ok(Stepped::Finished(reason)) => self.conclude(i, Ok(reason)),
                Err(e) => self.conclude(i, Err(e)),
            }
        }
    }

    /// Ends the cancelled sequences.
    fn leave_cancelled(&mut self) {
        let mut i = 0;
        while i < self.running.len() {
            if self.running[i].submitted.cancelled() {
                self.conclude(i, Ok(StopReason::Interrupted));
            } else {
                i += 1;
            }
        }
    }

    /// Runs running sequence `i`'s next prompt chunk; after its last, samples its first token
    /// and moves it to the batched cache. A panic in the backend (the GPU runtimes panic on
    /// some device failures) ends this request with an error.
    fn advance_prompt(&mut self, i: usize) -> Result<Stepped, Error> {
        let (model, tokenizer, metrics) = (&self.model, &self.tokenizer, &self.metrics);
        let sequence = &mut self.running[i];
        let stepped = catch_panic("a prompt step", || prompt_step(model, tokenizer, sequence, metrics))?;
        // Its blocks cached for later prompts that begin alike, as far as its cache holds them.
        let shared = !sequence.has_images();
        let cached = match &mut sequence.place {
            Place::Prompt(cache, reservation) if shared => {
                self.rows.cache_prefix(reservation, &sequence.context, cache)?
            }
            Place::Prompt(..) => 0,
            Place::Row(_) => 0,
        };
        let first_token_out = sequence.output.generated() > 0;
        if cached > 0 && !first_token_out {
            self.update_kv_metrics();
        }
        let sequence = &mut self.running[i];
        if !matches!(stepped, Stepped::Continue) || !first_token_out {
            return Ok(stepped);
        }
        // Its first token is out: its keys and values join the generating sequences', in the
        // blocks it reserved.
        let row = self.generating;
        let Place::Prompt(cache, reservation) = std::mem::replace(&mut sequence.place, Place::Row(row)) else {
            return Ok(stepped);
        };
        let joined = self.rows.attach(row, reservation).and_then(|()| self.rows.copy_sequence(row, &cache, 0));
        self.keep_spare(cache);
        self.generating += 1;
        self.update_kv_metrics();
        joined?;
        Ok(stepped)
    }

    /// One batched decode step over the generating sequences, each at its own position (and
    /// its drafts at the positions after it, [`EngineConfig::drafts`]), then each one's tokens.
    /// A failed step ends every sequence in it and starts a fresh cache.
    fn generate(&mut self) {
        let mut order: Vec<usize> = (0..self.running.len()).filter(|&i| self.running[i].row().is_some()).collect();
        order.sort_by_key(|&i| self.running[i].row());
        // The token each feeds is in its context from here on (its penalty's history).
        for &i in &order {
            let sequence = &mut self.running[i];
            sequence.context.push(sequence.input[0]);
        }
        // None past DRAFTING_SEQUENCES; within the rows a step replays as a graph and the cache's.
        let drafts: Vec<Vec<u32>> = match order.len() {
            n if n > DRAFTING_SEQUENCES => vec![Vec::new(); n],
            n => {
                let mut drafts: Vec<Vec<u32>> = order.iter().map(|&i| self.drafts_for(&self.running[i])).collect();
                share_drafts(&mut drafts, self.steps.most_rows().min(self.rows.batch()).saturating_sub(n));
                drafts
            }
        };
        let drafted: usize = drafts.iter().map(Vec::len).sum();
        let model = &self.model;
        let (rows, running, steps) = (&mut self.rows, &mut self.running, &mut self.steps);
        let started = std::time::Instant::now();
        let recorded = graph_setup(steps);
        let verdicts =
            catch_panic("a batched decode step", || decode_rows(model, rows, steps, running, (&order, &drafts)));
        self.note_graph_steps(recorded, verdicts.as_ref().is_ok_and(|v| v.1));
        self.metrics.decode_micros.fetch_add(started.elapsed().as_micros() as u64, Ordering::Relaxed);
        self.metrics.decode_steps.fetch_add(1, Ordering::Relaxed);
        self.metrics.decode_rows.fetch_add((order.len() + drafted) as u64, Ordering::Relaxed);
        self.metrics.draft_tokens.fetch_add(drafted as u64, Ordering::Relaxed);
        let verdicts = match verdicts {
            Ok((verdicts, _)) => verdicts,
            Err(e) => {
                self.fail_generating(e.to_string());
                return;
            }
        };
        // Each sequence's tokens; the finished leave afterwards, from the last row back, so that
        // the rows still to move are never the ones that left.
        let mut finished = Vec::new();
        for ((&i, verdict), proposed) in order.iter().zip(verdicts).zip(&drafts) {
            let sequence = &mut self.running[i];
            let outcome = verdict.map(|(kept, next)| {
                self.metrics.draft_tokens_accepted.fetch_add(kept as u64, Ordering::Relaxed);
                emit_verified(&self.tokenizer, sequence, (&proposed[..kept], next), &self.metrics)
            });
            if !matches!(outcome, Ok(Stepped::Continue)) {
                finished.push((i, outcome));
            }
        }
        finished.sort_by_key(|(i, _)| std::cmp::Reverse(*i));
        for (i, outcome) in finished {
            match outcome {
                Ok(Stepped::Finished(reason)) => self.conclude(i, Ok(reason)),
                Ok(Stepped::Continue) => {}
                Err(e) => self.conclude(i, Err(e)),
            }
        }
    }

    /// The tokens `sequence` drafts for its next step ([`EngineConfig::drafts`]): none where
    /// drafts are off or it penalizes repetition; never more than it may still generate after
    /// the step's own token, nor past its positions.
    fn drafts_for(&self, sequence: &Sequence<B>) -> Vec<u32> {
        let EngineDrafts::PromptLookup { tokens } = self.config.drafts else { return Vec::new() };
        if sequence.submitted.sampler.penalizes() {
            return Vec::new();
        }
        let max_new = sequence.submitted.request.generation.max_new_tokens;
        // The fed token is at `context.len() - 1`; drafts take the positions after it.
        let room = max_new
            .saturating_sub(sequence.output.generated() + 1)
            .min(sequence.capacity.saturating_sub(sequence.context.len()));
        PromptLookup::default().draft(&sequence.context, tokens.get().min(room))
    }

    /// Counts a batched step replayed as a graph and what recording cost (`before`: the
    /// recordings' cost before the step).
    fn note_graph_steps(&mut self, before: Option<GraphSetup>, replayed: bool) {
        if let (Steps::Graphs { graphs, .. }, Some(before)) = (&self.steps, before) {
            let after = graphs.setup();
            if replayed {
                self.metrics.decode_graph_steps.fetch_add(1, Ordering::Relaxed);
            }
            let recordings = (after.recordings - before.recordings) as u64;
            self.metrics.graph_recordings.fetch_add(recordings, Ordering::Relaxed);
            let micros = after.time.saturating_sub(before.time).as_micros() as u64;
            self.metrics.graph_recording_micros.fetch_add(micros, Ordering::Relaxed);
        }
    }

    /// Ends every generating sequence with `reason` (a batched step failed) and replaces the
    /// batched cache, whose stores the failure may have lost.
    fn fail_generating(&mut self, reason: String) {
        // No sequence is moved in a cache about to be replaced.
        self.broken = Some(reason.clone());
        let mut i = self.running.len();
        while i > 0 {
            i -= 1;
            if self.running[i].row().is_some() {
                let e = BackendError::Failed { what: "a batched decode step", reason: reason.clone() };
                self.conclude(i, Err(e.into()));
            }
        }
        self.generating = 0;
        self.renew_rows();
    }

    /// A fresh batched cache in place of one that can no longer be trusted (`broken`); the
    /// old one stays where a new one cannot be made (the next round tries again).
    fn renew_rows(&mut self) {
        let fresh = self.rows.paged_layout().ok_or_else(|| ModelError::InvalidInput("an unpaged batched cache".into()));
        if let Ok(fresh) = fresh.and_then(|layout| self.model.new_paged_cache(layout)) {
            // The prompts running hold reservations of the old cache: made again in the new
            // (the old cache goes with its promises).
            let mut fresh = fresh;
            for sequence in &mut self.running {
                if let Place::Prompt(_, reservation) = &mut sequence.place {
                    if let Ok(again) = fresh.reserve(reservation.positions()) {
                        *reservation = again;
                    }
                }
            }
            self.rows = fresh;
            self.broken = None;
        }
        self.update_kv_metrics();
    }

    /// The KV gauges: sequences generating and blocks held.
    fn update_kv_metrics(&self) {
        self.metrics.kv_sequences_in_use.store(self.generating, Ordering::SeqCst);
        let (used, all) = self.rows.blocks_in_use().unwrap_or((0, 0));
        self.metrics.kv_blocks_in_use.store(used, Ordering::SeqCst);
        self.metrics.kv_blocks_total.store(all, Ordering::SeqCst);
        if let Some(prefix) = self.rows.prefix_stats() {
            self.metrics.kv_blocks_cached.store(prefix.held_only, Ordering::SeqCst);
            self.metrics.prefix_blocks_given_up.store(prefix.given_up, Ordering::SeqCst);
        }
    }

    /// Takes running sequence `i` out, finished with `reason` or failed, and tells its stream.
    /// A generating sequence's row goes to the last generating sequence.
    fn conclude(&mut self, i: usize, outcome: Result<StopReason, Error>) {
        let mut sequence = self.running.remove(i);
        self.retire(&mut sequence);
        let event = match outcome {
            Ok(reason) => {
                self.metrics.requests_finished.fetch_add(1, Ordering::Relaxed);
                let text = sequence.output.finish();
                Ok(Event::Done(Finish {
                    reason,
                    text,
                    prompt_tokens: sequence.submitted.request.input.len(),
                    generated_tokens: sequence.output.generated(),
                    time_to_first_token: sequence.first_token,
                }))
            }
            Err(e) => {
                self.metrics.requests_failed.fetch_add(1, Ordering::Relaxed);
                Err(EngineError::Generation(e))
            }
        };
        let _ = sequence.submitted.events.send(event);
    }

    /// Frees what `sequence` held: its prompt cache goes to the spares, its row to the last
    /// generating sequence.
    fn retire(&mut self, sequence: &mut Sequence<B>) {
        self.metrics.running.fetch_sub(1, Ordering::SeqCst);
        match std::mem::replace(&mut sequence.place, Place::Row(usize::MAX)) {
            Place::Prompt(cache, reservation) => {
                self.rows.release_reservation(reservation);
                self.keep_spare(cache);
            }
            Place::Row(row) => {
                self.generating -= 1;
                self.rows.release(row);
                let last = self.generating;
                if row != last && self.broken.is_none() {
                    if let Err(e) = self.rows.move_sequence(last, row) {
                        self.broken = Some(e.to_string());
                    }
                    if let Some(other) = self.running.iter_mut().find(|s| s.row() == Some(last)) {
                        other.place = Place::Row(row);
                    }
                }
                self.update_kv_metrics();
            }
        }
    }

    /// Keeps a prompt cache for the next prompt, or frees it where enough are kept.
    fn keep_spare(&mut self, mut cache: KvCache<B>) {
        if self.spare.len() < SPARE_PROMPT_CACHES {
            cache.reset();
            self.spare.push(cache);
        } else {
            self.metrics.kv_cache_bytes.fetch_sub(cache.device_bytes() as u64, Ordering::SeqCst);
        }
    }

    fn finish_cancelled(&self, submitted: Submitted) {
        self.metrics.requests_finished.fetch_add(1, Ordering::Relaxed);
        let finish = Finish {
            reason: StopReason::Interrupted,
            text: String::new(),
            prompt_tokens: submitted.request.input.len(),
            generated_tokens: 0,
            time_to_first_token: None,
        };
        let _ = submitted.events.send(Ok(Event::Done(finish)));
    }

    /// Ends every request with [`StopReason::Interrupted`].
    fn abort(&mut self) {
        for sequence in std::mem::take(&mut self.running) {
            self.metrics.running.fetch_sub(1, Ordering::SeqCst);
            self.finish_cancelled(sequence.submitted);
        }
        for submitted in std::mem::take(&mut self.waiting) {
            self.metrics.waiting.fetch_sub(1, Ordering::SeqCst);
            self.finish_cancelled(submitted);
        }
    }
}

impl Submitted {
    fn cancelled(&self) -> bool {
        self.cancel.load(Ordering::SeqCst)
    }
}

/// Runs `f`, turning a panic in the backend (the GPU runtimes panic on some device failures)
/// into an error naming `what`.
fn catch_panic<T>(what: &'static str, f: impl FnOnce() -> Result<T, Error>) -> Result<T, Error> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(f))
        .unwrap_or_else(|panic| Err(BackendError::Panicked { what, message: panic_message(&*panic) }.into()))
}

/// The message a panic carried, where it carried text.
fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic without a message".into())
}

/// Runs a sequence's next prompt chunk; after the last, samples its first token, which goes to
/// its stream.
fn prompt_step<B: GemmaBackend>(
    model: &Gemma<B>,
    tokenizer: &Tokenizer,
    sequence: &mut Sequence<B>,
    metrics: &EngineMetrics,
) -> Result<Stepped, Error> {
    let chunk = sequence.next_chunk();
    let prefill_chunk = sequence.chunk;
    let Place::Prompt(cache, _) = &mut sequence.place else {
        return Ok(Stepped::Continue);
    };
    let device = model.device();
    if chunk < sequence.input.len() {
        // A prompt chunk before its last: fills the cache, samples nothing (the chunks fall
        // where the plain generator's do, so the cache holds the same values).
        let filling: Vec<u32> = sequence.input.drain(..chunk).collect();
        let (here, later): (Vec<_>, Vec<_>) =
            std::mem::take(&mut sequence.images).into_iter().partition(|i| i.start < chunk);
        sequence.images = later.into_iter().map(|i| ImageEmbeds { start: i.start - chunk, ..i }).collect();
        match here.is_empty() {
            true => model.forward_last(token_tensor(&filling, &device), cache)?,
            false => {
                let whole = NonZeroUsize::new(filling.len()).unwrap_or(NonZeroUsize::MIN);
                prefill_with_images(model, cache, &filling, &here, whole, &device)?.0
            }
        };
        sequence.context.extend_from_slice(&filling);
        return Ok(Stepped::Continue);
    }
    let logits = match sequence.images.is_empty() {
        true => prefill(model, cache, &sequence.input, prefill_chunk, &device)?,
        false => {
            let images = std::mem::take(&mut sequence.images);
            prefill_with_images(model, cache, &sequence.input, &images, prefill_chunk, &device)?.0
        }
    };
    sequence.context.extend_from_slice(&sequence.input);
    let token = sample_alone(&mut sequence.submitted.sampler, logits, &sequence.context)?;
    let token = checked_token(token, model.config().vocab_size, sequence.output.generated())?;
    Ok(emit(tokenizer, sequence, token, metrics))
}

/// What one sequence's rows of a batched step gave: how many of its drafts the model kept and
/// its own token after them, or that sequence's error.
type Verdict = Result<(usize, u32), Error>;

/// One decode step of the generating sequences `order` (indices into `running`, in the order
/// of their rows, which are the first rows of `rows`), each feeding its last token at its own
/// position and its `drafts` at the positions after it: per sequence, in the same order, the
/// drafts the model keeps and its own token after them (a sequence without drafts: none kept,
/// its sampled token), or that sequence's error; and whether a graph replayed the step.
fn decode_rows<B: GemmaBackend>(
    model: &Gemma<B>,
    rows: &mut KvCache<B>,
    steps: &mut Steps<B>,
    running: &mut [Sequence<B>],
    (order, drafts): (&[usize], &[Vec<u32>]),
) -> Result<(Vec<Verdict>, bool), Error> {
    let n = order.len();
    let mut ids: Vec<u32> = order.iter().map(|&i| running[i].input[0]).collect();
    // The fed token is the last of the context.
    let mut positions: Vec<usize> = order.iter().map(|&i| running[i].context.len() - 1).collect();
    // A sequence's drafts are rows after all the sequences' own, pointed at its blocks; each
    // sequence's step rows: its own, then its drafts'.
    let mut pointed = Vec::new();
    let mut rows_of: Vec<Vec<usize>> = (0..n).map(|r| vec![r]).collect();
    for (r, drafted) in drafts.iter().enumerate().take(n) {
        for (j, &token) in drafted.iter().enumerate() {
            rows_of[r].push(ids.len());
            pointed.push((ids.len(), r));
            ids.push(token);
            positions.push(positions[r] + 1 + j);
        }
    }
    rows.set_draft_rows(&pointed)?;
    // The step runs a bucket of rows (see [`step_rows`]); the rows past the stepped ones are
    // free sequences of the cache, stepped at position 0 and their logits ignored (a sequence
    // that later takes one gets all of its slots copied in; a draft row holds no slots).
    let stepped = ids.len();
    let bucket = step_rows(stepped, rows.batch());
    ids.resize(bucket, ids.first().copied().unwrap_or(0));
    positions.resize(bucket, 0);
    let device = model.device();
    let vocab = model.config().vocab_size;
    let (logits, replayed) = step_logits(model, rows, steps, &ids, &positions)?;
    let logits = if bucket > stepped { logits.slice([0..stepped, 0..vocab]) } else { logits };
    // Each step row's choice. Rows that sample alike share one sampling launch (and one read
    // back): every sequence's own row where it has no drafts, every row of a greedy sequence
    // with drafts (its choice after each draft). A sequence with a repetition penalty, which
    // depends on its own history, samples alone; a sampled sequence with drafts is judged by
    // the rejection rule below.
    let mut choices = vec![-1i64; stepped];
    let mut groups: Vec<(SamplingParams, Vec<usize>, Vec<f32>)> = Vec::new();
    for (r, &i) in order.iter().enumerate() {
        let sampler = &mut running[i].submitted.sampler;
        let drafted = !drafts[r].is_empty();
        if sampler.penalizes() {
            let row = logits.clone().slice([r..r + 1, 0..vocab]);
            choices[r] = sample_alone(sampler, row, &running[i].context)?;
            continue;
        }
        let (members, draws) = match (drafted, sampler.is_greedy()) {
            (false, _) => (vec![r], sampler.draws(1)),
            (true, true) => (rows_of[r].clone(), vec![0.0; rows_of[r].len()]),
            (true, false) => continue,
        };
        let params = sampler.params();
        match groups.iter_mut().find(|(p, ..)| *p == params) {
            Some((_, rows, all)) => {
                rows.extend(members);
                all.extend(draws);
            }
            None => groups.push((params, members, draws)),
        }
    }
    for (params, members, draws) in groups {
        let group = if members.iter().copied().eq(0..stepped) {
            logits.clone()
        } else {
            let index: Vec<i64> = members.iter().map(|&r| r as i64).collect();
            let index = Tensor::<B, 1, Int>::from_data(TensorData::new(index, [members.len()]), &device);
            logits.clone().select(0, index)
        };
        let ids = B::sample(group, &params, Draws::Host(&draws)).map_err(burn_gemma_model::ModelError::from)?;
        for (&r, id) in members.iter().zip(sampled_ids(ids)?) {
            choices[r] = id;
        }
    }
    let verdicts = order.iter().enumerate().map(|(r, &i)| {
        let sequence = &mut running[i];
        let step = sequence.output.generated();
        let drafted = &drafts[r];
        if drafted.is_empty() {
            return checked_token(choices[r], vocab, step).map(|token| (0, token));
        }
        let sampler = &mut sequence.submitted.sampler;
        if sampler.is_greedy() {
            let mine: Vec<i64> = rows_of[r].iter().map(|&row| choices[row]).collect();
            return greedy_verdict(drafted, &mine, vocab, step);
        }
        let index: Vec<i64> = rows_of[r].iter().map(|&row| row as i64).collect();
        let index = Tensor::<B, 1, Int>::from_data(TensorData::new(index, [drafted.len() + 1]), &device);
        let proposed = Drafts { tokens: drafted.clone(), proposals: vec![Proposal::Certain; drafted.len()] };
        judge(sampler, logits.clone().select(0, index), &sequence.context, &proposed, step)
    });
    Ok((verdicts.collect(), replayed))
}

/// The logits of one batched step (`ids[b]` at `positions[b]` for the first rows of `rows`),
/// and whether a graph replayed it: a replayed graph, or eager where there is none or the step
/// has more rows than graphs take ([`Steps::Graphs`]). Under [`CudaGraph::Auto`] a graph error
/// lowers that count, or turns the steps eager for good at one row (the step runs eagerly then;
/// nothing of it ran on the device).
fn step_logits<B: GemmaBackend>(
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
fn graph_setup<B: GemmaBackend>(steps: &Steps<B>) -> Option<GraphSetup> {
    match steps {
        Steps::Graphs { graphs, .. } => Some(graphs.setup()),
        Steps::Eager => None,
    }
}

/// Rows a batched step over `n` generating sequences runs: `n` rounded up to a power of two,
/// at most the cache's `batch`. Dense weights' prefill GEMM takes some row counts very badly
/// (on an H200, 9 rows of Gemma 3 4B's output projection took 3.4 ms against 0.05 ms for 16:
/// `docs/gpu-runs/2026-11-26-mma` call 2; quantized weights take any count from 3 to 64 alike),
/// and a bounded set of shapes is what recorded steps (CUDA graphs) will need.
fn step_rows(n: usize, batch: usize) -> usize {
    n.next_power_of_two().min(batch).max(n)
}

/// One sequence's next token from its logits (`[1, vocab]`) and `history` (a repetition
/// penalty reads it), with the sampler's next draw.
fn sample_alone<B: GemmaBackend>(sampler: &mut Sampler, logits: Tensor<B, 2>, history: &[u32]) -> Result<i64, Error> {
    let draws = sampler.draws(1);
    Ok(first_sampled(sampler.sample_with_draws(logits, history, &draws)?)?)
}

/// A sampled `token` of `sequence`: counted, checked against its stops, its text sent to its
/// stream; whether the sequence goes on (its next input is then the token).
fn emit<B: GemmaBackend>(
    tokenizer: &Tokenizer,
    sequence: &mut Sequence<B>,
    token: u32,
    metrics: &EngineMetrics,
) -> Stepped {
    if sequence.first_token.is_none() {
        let elapsed = sequence.submitted.submitted.elapsed();
        sequence.first_token = Some(elapsed);
        metrics.first_tokens.fetch_add(1, Ordering::Relaxed);
        metrics.first_token_micros.fetch_add(elapsed.as_micros() as u64, Ordering::Relaxed);
    }
    metrics.generated_tokens.fetch_add(1, Ordering::Relaxed);
    let room = Room { used: sequence.context.len(), capacity: sequence.capacity };
    let emitted = sequence.output.push(token, tokenizer.token_bytes(token), room);
    if let Some(text) = emitted.text {
        if sequence.submitted.events.send(Ok(Event::Token(Token { id: token, text }))).is_err() {
            // Nobody listens any more.
            return Stepped::Finished(StopReason::Interrupted);
        }
    }
    if let Some(reason) = emitted.stop {
        return Stepped::Finished(reason);
    }
    sequence.input = vec![token];
    Stepped::Continue
}

/// Cuts `drafts` (one list per sequence) to `budget` tokens in all where they hold more, shared
/// out a token at a time: every sequence's first draft, then every second, and so on.
fn share_drafts(drafts: &mut [Vec<u32>], budget: usize) {
    if drafts.iter().map(Vec::len).sum::<usize>() <= budget {
        return;
    }
    let mut keep = vec![0; drafts.len()];
    let mut left = budget;
    let longest = drafts.iter().map(Vec::len).max().unwrap_or(0);
    for round in 0..longest {
        for (k, d) in keep.iter_mut().zip(drafts.iter()) {
            if left > 0 && d.len() > round {
                *k += 1;
                left -= 1;
            }
        }
    }
    for (d, k) in drafts.iter_mut().zip(keep) {
        d.truncate(k);
    }
}

/// Emits what a verify step gave `sequence`: the `kept` drafts (fed in the step, so now in its
/// context), then the model's `next` token, stopping at the first that ends it.
fn emit_verified<B: GemmaBackend>(
    tokenizer: &Tokenizer,
    sequence: &mut Sequence<B>,
    (kept, next): (&[u32], u32),
    metrics: &EngineMetrics,
) -> Stepped {
    for &token in kept {
        match emit(tokenizer, sequence, token, metrics) {
            Stepped::Continue => sequence.context.push(token),
            finished => return finished,
        }
    }
    emit(tokenizer, sequence, next, metrics)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::{share_drafts, step_rows};
    use super::{Engine, EngineConfig, EngineError, EngineHealth, Event, Fault, Request};
    use crate::{backends::NdArray, Checkpoint, GenerationConfig, LoadOptions, SamplingConfig, StopReason, Tokenizer};
    use std::sync::atomic::Ordering;

    /// The tiny Gemma 3 fixture's engine, and its tokenizer's vocabulary (512 tokens).
    pub(crate) fn tiny_engine() -> Result<Engine, crate::Error> {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tiny-gemma/gemma3");
        let options = LoadOptions::<NdArray>::new().dtype(burn::tensor::DType::F32);
        let model = Checkpoint::open(&dir)?.load(options)?.model;
        // The integration tests' vocabulary: control tokens, the 256 byte tokens, then words.
        let mut tokens = vec!["<pad>".to_string(), "<eos>".into(), "<bos>".into(), "<unk>".into()];
        tokens.extend(["<start_of_turn>".to_string(), "<end_of_turn>".into()]);
        let mut types = vec![3; tokens.len()];
        tokens.extend((0..=255u8).map(|b| format!("<0x{b:02X}>")));
        types.resize(tokens.len(), 6);
        tokens.extend((tokens.len()..512).map(|i| format!("w{i}")));
        types.resize(512, 1);
        let scores = (0..512).map(|i| -(i as f32)).collect();
        Engine::new(model, Tokenizer::from_vocab(tokens, scores, types, 2)?, EngineConfig::default())
    }

    fn request(tokens: usize) -> Request {
        let generation = GenerationConfig {
            max_new_tokens: tokens,
            sampling: SamplingConfig { temperature: 0.0, ..SamplingConfig::default() },
            ..GenerationConfig::default()
        };
        Request::new(vec![2, 40, 41, 42], generation)
    }

    /// The ids a request generates, or its error.
    fn tokens(stream: super::RequestStream) -> Result<Vec<u32>, EngineError> {
        let mut ids = Vec::new();
        for event in stream {
            match event? {
                Event::Token(t) => ids.push(t.id),
                Event::Done(finish) => {
                    assert!(matches!(finish.reason, StopReason::MaxTokens | StopReason::StopToken(_)), "{finish:?}");
                    return Ok(ids);
                }
            }
        }
        Err(EngineError::ShutDown)
    }

    type TestResult = Result<(), Box<dyn std::error::Error>>;

    #[test]
    fn a_panic_in_a_round_fails_the_running_requests_and_the_engine_goes_on() -> TestResult {
        let engine = tiny_engine()?;
        let alone = tokens(engine.submit(request(6))?)?;
        // The next round with a request running panics: that request ends with the panic's error.
        engine.inject(Fault::Round);
        let failed = tokens(engine.submit(request(200))?);
        let message = failed.err().map(|e| e.to_string()).unwrap_or_default();
        assert!(message.contains("a fault injected in a round"), "{message}");
        assert_eq!(engine.metrics().worker_panics.load(Ordering::SeqCst), 1);
        assert_eq!(engine.health(), EngineHealth::Serving);
        // Later requests answer as before the panic.
        let after = tokens(engine.submit(request(6))?)?;
        assert_eq!(after, alone);
        assert_eq!(engine.metrics().running.load(Ordering::SeqCst), 0);
        Ok(())
    }

    #[test]
    fn a_worker_that_cannot_go_on_is_reported_failed() -> TestResult {
        let engine = tiny_engine()?;
        engine.inject(Fault::Worker);
        let started = std::time::Instant::now();
        while engine.health() == EngineHealth::Serving {
            assert!(started.elapsed() < std::time::Duration::from_secs(30), "the worker did not stop");
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        let health = engine.health();
        assert!(
            matches!(&health, EngineHealth::Failed { reason } if reason.contains("a fault injected outside the rounds")),
            "{health:?}"
        );
        let refused = engine.submit(request(4)).err();
        assert!(matches!(refused, Some(EngineError::WorkerFailed { .. })), "{refused:?}");
        Ok(())
    }

    #[test]
    fn huge_token_budgets_are_held_to_the_sequence() -> TestResult {
        let engine = tiny_engine()?;
        // 2^62 and usize::MAX new tokens: no overflow, no allocation of what they ask; the
        // sequence ends when its positions are full.
        for max in [1usize << 62, usize::MAX] {
            let stream = engine.submit(request(max))?;
            let mut last = None;
            for event in stream {
                last = Some(event?);
            }
            match last {
                Some(Event::Done(finish)) => {
                    assert!(matches!(finish.reason, StopReason::ContextFull | StopReason::StopToken(_)), "{finish:?}");
                    assert!(finish.prompt_tokens + finish.generated_tokens <= engine.sequence_positions() + 1);
                }
                other => return Err(format!("the stream ended with {other:?}").into()),
            }
        }
        assert_eq!(engine.health(), EngineHealth::Serving);
        Ok(())
    }

    #[test]
    fn drafts_are_shared_a_token_at_a_time_within_the_budget() {
        // (drafts per sequence, budget) -> kept per sequence
        for (lengths, budget, kept) in [
            (vec![4, 4, 4], 20, vec![4, 4, 4]),
            (vec![4, 0, 2, 4], 5, vec![2, 0, 2, 1]),
            (vec![4, 1, 4], 7, vec![3, 1, 3]),
            (vec![3, 3], 0, vec![0, 0]),
        ] {
            let mut drafts: Vec<Vec<u32>> = lengths.iter().map(|&n| (0..n as u32).collect()).collect();
            share_drafts(&mut drafts, budget);
            let got: Vec<usize> = drafts.iter().map(Vec::len).collect();
            assert_eq!(got, kept, "{lengths:?} within {budget}");
            // Each keeps its first drafts.
            assert!(drafts.iter().all(|d| d.iter().enumerate().all(|(i, &t)| t == i as u32)));
        }
    }

    #[test]
    fn steps_run_power_of_two_rows_within_the_cache() {
        // (generating, cache's sequences) -> rows stepped
        for (n, batch, rows) in
            [(1, 16, 1), (3, 16, 4), (8, 16, 8), (9, 16, 16), (9, 12, 12), (12, 12, 12), (33, 64, 64)]
        {
            assert_eq!(step_rows(n, batch), rows, "{n} of {batch}");
        }
    }
}
