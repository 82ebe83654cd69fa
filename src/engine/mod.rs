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

mod batch;
mod config;
mod inbox;
mod kv_manager;
mod metrics;
mod request;
mod scheduler;
mod sequence;
mod sharded;
mod steps;
mod stream;
#[cfg(test)]
pub(crate) mod tests;

pub use crate::error::EngineError;
pub use config::{EngineConfig, EngineDrafts, PrefixCache};
pub use metrics::{EngineHealth, EngineMetrics};
use request::Tokenized;
pub use request::{Event, Finish, Prompt, Request};
pub use stream::{EventStream, RequestStream};

#[cfg(test)]
pub(crate) use inbox::Fault;
use inbox::{Command, Submitted};
use kv_manager::KvManager;
use metrics::WorkerState;
use scheduler::{panic_message, Worker, DRAFTING_SEQUENCES};
use steps::Steps;

use crate::{
    chat::ChatTemplate,
    error::{BackendError, RequestError},
    generation::{check_input, check_vocabulary, default_stop_tokens},
    graph_policy::{EagerReason, GraphPolicy},
    images::{ImageError, PanAndScan},
    sampling::Sampler,
    tokenizer::Bos,
    vision::{ImageProcessor, Picture, Vision},
    BatchGraphs, CudaGraph, Error, Gemma, GemmaBackend, GemmaConfig, ModelError, PagedLayout, Tokenizer,
};
use std::{
    collections::VecDeque,
    num::NonZeroUsize,
    sync::{
        atomic::{AtomicBool, Ordering},
        mpsc, Arc, Mutex,
    },
    thread::JoinHandle,
    time::Instant,
};

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
    /// How the model's conversations are laid out.
    template: ChatTemplate,
    /// How the worker thread ended, once it has.
    worker_state: Arc<WorkerState>,
}

/// What every engine's front holds, whatever its worker: the model's limits against the
/// requests, the shared tokenizer, metrics and eager-step reason.
struct Front {
    pub(super) tokenizer: Arc<Tokenizer>,
    pub(super) vocab: usize,
    pub(super) max_context: usize,
    /// Positions per sequence.
    pub(super) capacity: usize,
    /// Most positions one sequence can hold KV blocks for (`capacity` unless a paged cache
    /// says fewer).
    pub(super) reservable: usize,
    pub(super) metrics: Arc<EngineMetrics>,
    pub(super) eager_reason: Arc<Mutex<Option<EagerReason>>>,
    pub(super) images: Option<ImageProcessor>,
    pub(super) template: ChatTemplate,
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
            template: ChatTemplate::for_architecture(model.model_type),
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
        crate::generation::refuse_shard(&model)?;
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
            // Rings keep a sequence's length more for the prefix index's copies.
            ring_copies: match config.prefix_cache {
                PrefixCache::On => cache_capacity,
                PrefixCache::Off => 0,
            },
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
            kv: KvManager::new(rows, config.prefix_cache),
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
        let worker = sharded::Serving {
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
        let Front { tokenizer, vocab, max_context, capacity, reservable, metrics, eager_reason, images, template } =
            front;
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
            template,
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

    /// The token ids of `prompt`: text and chats laid out in the model's chat template where
    /// asked ([`crate::chat::ChatTemplate::render`]), each picture's placeholder expanded to its
    /// soft tokens, then tokenized with `<bos>` first; ids as they are. What
    /// [`Engine::submit`] runs, for a caller that wants the count first.
    pub fn prompt_ids(&self, prompt: Prompt, images: &[Picture]) -> Result<Vec<u32>, Error> {
        let text = match prompt {
            Prompt::Ids(ids) => return Ok(ids),
            Prompt::Text(text) if text.is_empty() => return Err(RequestError::EmptyPrompt.into()),
            Prompt::Text(text) => text,
            Prompt::Chat(messages) => self.template.render(&messages)?,
        };
        let text = match (&self.images, images.is_empty()) {
            (Some(processor), false) => processor.expand(&text, images, &self.tokenizer)?,
            (None, false) => return Err(ImageError::NoVision.into()),
            (_, true) => text,
        };
        self.tokenizer.encode(&text, Bos::Prepend)
    }

    /// Queues `request`; its events come through the returned stream. Checks the request before
    /// queueing it (empty input, ids outside the vocabulary, no new tokens, sampling values,
    /// context length), so a bad one is refused here with the reason.
    pub fn submit(&self, request: Request) -> Result<RequestStream, Error> {
        match self.health() {
            EngineHealth::Serving => {}
            EngineHealth::Failed { reason } => return Err(EngineError::WorkerFailed { reason }.into()),
            EngineHealth::Stopping | EngineHealth::Stopped => return Err(EngineError::ShutDown.into()),
        }
        let Request { prompt, generation, images } = request;
        let input = self.prompt_ids(prompt, &images)?;
        let request = Tokenized { input, generation, images };
        check(&request, self.vocab, self.max_context, self.capacity)?;
        match (&self.images, request.images.is_empty()) {
            (_, true) => {}
            (None, false) => return Err(ImageError::NoVision.into()),
            (Some(processor), false) => {
                processor.places(&request.input, &request.images).map_err(Error::from)?;
            }
        }
        let needed = reserved_positions(&request, self.capacity);
        if needed > self.reservable {
            return Err(RequestError::KvCacheTooSmall { needed, limit: self.reservable }.into());
        }
        // Its settings checked here, with the other checks.
        let sampler = Sampler::new(request.generation.sampling.clone())?;
        // Checked and counted in one step, so that racing submits cannot both take the last place.
        let max = self.config.max_waiting;
        let counted =
            self.metrics.waiting.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |w| (w < max).then_some(w + 1));
        if let Err(waiting) = counted {
            self.metrics.requests_refused.fetch_add(1, Ordering::Relaxed);
            return Err(EngineError::QueueFull { waiting }.into());
        }
        let cancel = Arc::new(AtomicBool::new(false));
        let (events, stream) = stream::channel(Arc::clone(&cancel));
        let submitted = Submitted { request, sampler, events, cancel, submitted: Instant::now() };
        if self.commands.send(Command::Submit(Box::new(submitted))).is_err() {
            self.metrics.waiting.fetch_sub(1, Ordering::SeqCst);
            return Err(match self.health() {
                EngineHealth::Failed { reason } => EngineError::WorkerFailed { reason },
                _ => EngineError::ShutDown,
            }
            .into());
        }
        Ok(stream)
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
fn check(request: &Tokenized, vocab: usize, max_context: usize, capacity: usize) -> Result<(), Error> {
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
fn reserved_positions(request: &Tokenized, capacity: usize) -> usize {
    request.input.len().saturating_add(request.generation.max_new_tokens).min(capacity)
}
