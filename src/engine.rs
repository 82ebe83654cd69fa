//! Many sequences on one model: an [`Engine`] owns a model on a worker thread and serves
//! requests submitted from any thread, each answered through its own [`RequestStream`].
//!
//! Scheduling is continuous: requests join and leave between steps. Up to
//! [`EngineConfig::max_running`] sequences run at once, each with its own KV cache sized for
//! its prompt and token budget; each round of the worker admits waiting requests, advances
//! every generating sequence by one token, then runs prompt chunks of the newcomers within the
//! round's token budget ([`EngineConfig::round_tokens`]), so a long prompt does not stall the
//! others for longer than a chunk. A step runs one sequence at a time (eager
//! decode, no CUDA graph): the steps over several sequences in one batch, with a paged cache,
//! are the next part of this module's work, and will not change its API.
//!
//! A request that finds [`EngineConfig::max_waiting`] requests already waiting is refused at
//! once ([`EngineError::QueueFull`]); one whose stream is dropped, or cancelled, stops at the
//! next round and frees its cache; a failure in one sequence ends that request with its error
//! and leaves the others running.

use crate::{
    error::{BackendError, RequestError},
    generation::{
        check_input, check_vocabulary, checked_token, default_stop_tokens, first_sampled, prefill, token_tensor,
        Utf8Stream,
    },
    sampling::Sampler,
    stop_text::StopText,
    Error, Gemma, GemmaBackend, GenerationConfig, KvCache, StopReason, Token, Tokenizer,
};
use std::{
    collections::VecDeque,
    num::NonZeroUsize,
    sync::{
        atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering},
        mpsc, Arc,
    },
    thread::JoinHandle,
    time::{Duration, Instant},
};

/// How many requests an [`Engine`] serves at once and keeps waiting.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EngineConfig {
    /// Sequences generating at once (each holds a KV cache).
    pub max_running: NonZeroUsize,
    /// Requests waiting for a place among the running; one more is refused.
    pub max_waiting: usize,
    /// Tokens a round runs through the model: one per generating sequence, then prompt chunks
    /// (each [`GenerationConfig::prefill_chunk`] long, the last shorter) while they fit. The
    /// first prompt chunk waiting runs whatever the budget, so prompts always advance; a long
    /// prompt delays the generating sequences by at most this many tokens' work per round.
    pub round_tokens: NonZeroUsize,
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            max_running: NonZeroUsize::new(16).unwrap_or(NonZeroUsize::MIN),
            max_waiting: 256,
            round_tokens: NonZeroUsize::new(2048).unwrap_or(NonZeroUsize::MIN),
        }
    }
}

/// One generation request: the prompt's token ids and how to continue them.
#[derive(Debug, Clone)]
pub struct Request {
    /// The prompt, already tokenized (BOS and chat template included where wanted).
    pub input: Vec<u32>,
    /// Most tokens to generate, how to choose them and extra stop tokens; its CUDA-graph
    /// setting is not used (see the module's docs).
    pub generation: GenerationConfig,
    /// Texts that end generation where they appear (cut before them): the text that could
    /// still begin one is held back from the token events until it cannot.
    pub stop_strings: Vec<String>,
}

impl Request {
    /// A request for `input` continued as `generation` says, without stop strings.
    pub fn new(input: Vec<u32>, generation: GenerationConfig) -> Self {
        Self { input, generation, stop_strings: Vec::new() }
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
    /// Bytes of KV cache allocated by the running sequences.
    pub kv_cache_bytes: AtomicU64,
    /// Requests that got their first token, and the microseconds from submission to it, summed
    /// (waiting included): their ratio is the mean time to first token.
    pub first_tokens: AtomicU64,
    pub first_token_micros: AtomicU64,
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
struct Submitted {
    request: Request,
    sampler: Sampler,
    events: mpsc::Sender<Result<Event, EngineError>>,
    cancel: Arc<AtomicBool>,
    submitted: Instant,
}

enum Command {
    Submit(Box<Submitted>),
    /// Finish the running and waiting requests, take no more, then stop.
    Drain,
    /// Cancel everything and stop.
    Abort,
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
    accepting: Arc<AtomicBool>,
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
        check_vocabulary(model.config(), &tokenizer)?;
        let vocab = model.config().vocab_size;
        let default_stops = default_stop_tokens(model.config(), &tokenizer);
        let max_context = model.config().max_position_embeddings;
        let tokenizer = Arc::new(tokenizer);
        let metrics = Arc::new(EngineMetrics::default());
        let (commands, inbox) = mpsc::channel();
        let worker = Worker {
            model,
            tokenizer: Arc::clone(&tokenizer),
            default_stops,
            config,
            metrics: Arc::clone(&metrics),
            waiting: VecDeque::new(),
            running: Vec::new(),
            draining: false,
        };
        let worker = std::thread::Builder::new()
            .name("burn-gemma-engine".into())
            .spawn(move || worker.run(inbox))
            .map_err(|e| BackendError::Thread { what: "engine worker", reason: e.to_string() })?;
        Ok(Self {
            commands,
            worker: Some(worker),
            metrics,
            config,
            tokenizer,
            vocab,
            max_context,
            accepting: Arc::new(AtomicBool::new(true)),
        })
    }

    /// The model's tokenizer.
    pub fn tokenizer(&self) -> &Tokenizer {
        &self.tokenizer
    }

    /// The engine's counters.
    pub fn metrics(&self) -> &EngineMetrics {
        &self.metrics
    }

    /// The engine's limits.
    pub fn config(&self) -> EngineConfig {
        self.config
    }

    /// Queues `request`; its events come through the returned stream. Checks the request before
    /// queueing it (empty input, ids outside the vocabulary, no new tokens, sampling values,
    /// context length), so a bad one is refused here with the reason.
    pub fn submit(&self, request: Request) -> Result<RequestStream, EngineError> {
        if !self.accepting.load(Ordering::SeqCst) {
            return Err(EngineError::ShutDown);
        }
        check(&request, self.vocab, self.max_context)?;
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
            return Err(EngineError::ShutDown);
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
fn check(request: &Request, vocab: usize, max_context: usize) -> Result<(), Error> {
    let generation = &request.generation;
    check_input(&request.input, generation, vocab)?;
    if let Some(index) = request.stop_strings.iter().position(String::is_empty) {
        return Err(RequestError::EmptyStopString { index }.into());
    }
    let needed = request.input.len() + generation.max_new_tokens;
    if request.input.len() + 1 > max_context {
        return Err(RequestError::ContextOverflow {
            context: 0,
            prompt: request.input.len(),
            new: generation.max_new_tokens,
            needed,
            limit: max_context,
        }
        .into());
    }
    Ok(())
}

/// A running request.
struct Sequence<B: GemmaBackend> {
    submitted: Submitted,
    cache: KvCache<B>,
    /// Prompt and generated tokens so far.
    context: Vec<u32>,
    /// What the next step feeds the model: the prompt first, then the last token.
    input: Vec<u32>,
    stops: Vec<u32>,
    generated: usize,
    utf8: Utf8Stream,
    stop_text: StopText,
    first_token: Option<Duration>,
}

impl<B: GemmaBackend> Sequence<B> {
    /// Whether its prompt is still being run (no token sampled yet).
    fn in_prompt(&self) -> bool {
        self.generated == 0
    }

    /// Tokens its next step runs: the next prompt chunk, or the last token.
    fn next_chunk(&self) -> usize {
        self.input.len().min(self.submitted.request.generation.prefill_chunk.get())
    }
}

struct Worker<B: GemmaBackend> {
    model: Gemma<B>,
    tokenizer: Arc<Tokenizer>,
    /// The model's stop tokens, which every request's own extend.
    default_stops: Vec<u32>,
    config: EngineConfig,
    metrics: Arc<EngineMetrics>,
    waiting: VecDeque<Submitted>,
    running: Vec<Sequence<B>>,
    draining: bool,
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
                }
            }
            self.admit();
            self.round();
        }
    }

    /// Moves waiting requests to the running while there is room: each gets its cache and its
    /// first token.
    fn admit(&mut self) {
        while self.running.len() < self.config.max_running.get() {
            let Some(submitted) = self.waiting.pop_front() else { break };
            self.metrics.waiting.fetch_sub(1, Ordering::SeqCst);
            if submitted.cancel.load(Ordering::SeqCst) {
                self.finish_cancelled(submitted);
                continue;
            }
            match self.start(submitted) {
                Ok(sequence) => {
                    self.metrics.running.fetch_add(1, Ordering::SeqCst);
                    self.metrics.kv_cache_bytes.fetch_add(sequence.cache.device_bytes() as u64, Ordering::SeqCst);
                    self.metrics.prompt_tokens.fetch_add(sequence.input.len() as u64, Ordering::Relaxed);
                    self.running.push(sequence);
                }
                Err(failed) => {
                    let (submitted, e) = *failed;
                    self.metrics.requests_failed.fetch_add(1, Ordering::Relaxed);
                    let _ = submitted.events.send(Err(EngineError::Generation(e)));
                }
            }
        }
    }

    /// A sequence for `submitted`: its cache sized for the prompt and budget, its stop tokens.
    fn start(&self, submitted: Submitted) -> Result<Sequence<B>, Box<(Submitted, Error)>> {
        let generation = &submitted.request.generation;
        let capacity = (submitted.request.input.len() + generation.max_new_tokens)
            .min(self.model.config().max_position_embeddings);
        let cache = match self.model.new_cache(1, capacity) {
            Ok(cache) => cache,
            Err(e) => return Err(Box::new((submitted, e.into()))),
        };
        let stops = self.default_stops.iter().chain(&generation.stop_tokens).copied().collect();
        Ok(Sequence {
            cache,
            context: Vec::with_capacity(capacity),
            input: submitted.request.input.clone(),
            stops,
            generated: 0,
            utf8: Utf8Stream::default(),
            stop_text: StopText::new(submitted.request.stop_strings.clone()),
            first_token: None,
            submitted,
        })
    }

    /// One token for every generating sequence, then prompt chunks within the round's budget
    /// ([`EngineConfig::round_tokens`]); the finished leave.
    fn round(&mut self) {
        let mut budget = self.config.round_tokens.get();
        for prompts in [false, true] {
            let mut chunk_ran = false;
            let mut i = 0;
            while i < self.running.len() {
                let sequence = &self.running[i];
                let tokens = sequence.next_chunk();
                if sequence.in_prompt() != prompts || (prompts && chunk_ran && tokens > budget) {
                    i += 1;
                    continue;
                }
                budget = budget.saturating_sub(tokens);
                chunk_ran |= prompts;
                match self.advance(i) {
                    Ok(Stepped::Continue) => i += 1,
                    Ok(Stepped::Finished(reason)) => self.conclude(i, Ok(reason)),
                    Err(e) => self.conclude(i, Err(e)),
                }
            }
        }
    }

    /// Runs running sequence `i`'s next step, or ends it where it was cancelled. A panic in the
    /// backend (the GPU runtimes panic on some device failures) ends this request with an
    /// error; the others keep their own caches.
    fn advance(&mut self, i: usize) -> Result<Stepped, Error> {
        let sequence = &mut self.running[i];
        if sequence.submitted.cancel.load(Ordering::SeqCst) {
            return Ok(Stepped::Finished(StopReason::Interrupted));
        }
        let (model, tokenizer, metrics) = (&self.model, &self.tokenizer, &self.metrics);
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| step(model, tokenizer, sequence, metrics)))
            .unwrap_or_else(|panic| {
                Err(BackendError::Panicked { what: "a generation step", message: panic_message(&*panic) }.into())
            })
    }

    /// Takes running sequence `i` out, finished with `reason` or failed, and tells its stream.
    fn conclude(&mut self, i: usize, outcome: Result<StopReason, Error>) {
        let mut sequence = self.running.remove(i);
        self.retire(&sequence);
        let event = match outcome {
            Ok(reason) => {
                self.metrics.requests_finished.fetch_add(1, Ordering::Relaxed);
                let text = match reason {
                    StopReason::StopString(_) => String::new(),
                    _ => sequence.utf8.finish() + &sequence.stop_text.finish(),
                };
                Ok(Event::Done(Finish {
                    reason,
                    text,
                    prompt_tokens: sequence.submitted.request.input.len(),
                    generated_tokens: sequence.generated,
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

    fn retire(&self, sequence: &Sequence<B>) {
        self.metrics.running.fetch_sub(1, Ordering::SeqCst);
        self.metrics.kv_cache_bytes.fetch_sub(sequence.cache.device_bytes() as u64, Ordering::SeqCst);
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
            self.retire(&sequence);
            self.finish_cancelled(sequence.submitted);
        }
        for submitted in std::mem::take(&mut self.waiting) {
            self.metrics.waiting.fetch_sub(1, Ordering::SeqCst);
            self.finish_cancelled(submitted);
        }
    }
}

/// The message a panic carried, where it carried text.
fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic without a message".into())
}

/// Runs a sequence's pending input and samples its next token, which goes to its stream.
fn step<B: GemmaBackend>(
    model: &Gemma<B>,
    tokenizer: &Tokenizer,
    sequence: &mut Sequence<B>,
    metrics: &EngineMetrics,
) -> Result<Stepped, Error> {
    let generation = &sequence.submitted.request.generation;
    let device = model.device();
    let chunk = sequence.next_chunk();
    if chunk < sequence.input.len() {
        // A prompt chunk before its last: fills the cache, samples nothing (the chunks fall
        // where the plain generator's do, so the cache holds the same values).
        let filling: Vec<u32> = sequence.input.drain(..chunk).collect();
        model.forward_last(token_tensor(&filling, &device), &mut sequence.cache)?;
        sequence.context.extend_from_slice(&filling);
        return Ok(Stepped::Continue);
    }
    let logits = prefill(model, &mut sequence.cache, &sequence.input, generation.prefill_chunk, &device)?;
    sequence.context.extend_from_slice(&sequence.input);
    let sampler = &mut sequence.submitted.sampler;
    let draws = sampler.draws(1);
    let token = first_sampled(sampler.sample_with_draws(logits, &sequence.context, &draws)?)?;
    let token = checked_token(token, model.config().vocab_size, sequence.generated)?;
    if sequence.first_token.is_none() {
        let elapsed = sequence.submitted.submitted.elapsed();
        sequence.first_token = Some(elapsed);
        metrics.first_tokens.fetch_add(1, Ordering::Relaxed);
        metrics.first_token_micros.fetch_add(elapsed.as_micros() as u64, Ordering::Relaxed);
    }
    sequence.generated += 1;
    metrics.generated_tokens.fetch_add(1, Ordering::Relaxed);
    if sequence.stops.contains(&token) {
        return Ok(Stepped::Finished(StopReason::StopToken(token)));
    }
    let text = sequence.utf8.push(tokenizer.token_bytes(token));
    let pushed = sequence.stop_text.push(&text);
    if sequence.submitted.events.send(Ok(Event::Token(Token { id: token, text: pushed.text }))).is_err() {
        // Nobody listens any more.
        return Ok(Stepped::Finished(StopReason::Interrupted));
    }
    if let Some(index) = pushed.stopped {
        return Ok(Stepped::Finished(StopReason::StopString(index)));
    }
    if sequence.generated >= generation.max_new_tokens {
        return Ok(Stepped::Finished(StopReason::MaxTokens));
    }
    if sequence.context.len() + 1 > sequence.cache.capacity() {
        return Ok(Stepped::Finished(StopReason::ContextFull));
    }
    sequence.input = vec![token];
    Ok(Stepped::Continue)
}
