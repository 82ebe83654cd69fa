//! The worker's rounds: admitting requests, starting their prompts, finishing and freeing them.

use super::config::EngineConfig;
#[cfg(test)]
use super::inbox::Fault;
use super::inbox::{Command, Submitted};
use super::kv_manager::{KvManager, PromptBlocks};
use super::metrics::EngineMetrics;
use super::request::{Event, Finish};
use super::reserved_positions;
use super::sequence::{Place, Sequence, Stepped};
use super::steps::Steps;
use super::stream::EventSender;
use crate::{
    error::BackendError,
    images::ImageError,
    output::{OutputRules, SequenceOutput},
    vision::Vision,
    Error, Gemma, GemmaBackend, KvCache, ModelError, PrefixCache, StopReason, Tokenizer,
};

use std::{
    collections::VecDeque,
    num::NonZeroUsize,
    sync::{atomic::Ordering, mpsc, Arc},
};

/// The most sequences generating at once for which sequences draft: where more generate, a
/// batched step already shares each read of the weights among many rows, and drafts cost more
/// than they keep. On an H200 (random-weight Gemma 3 1B, Q4, copy-heavy prompts, 4 drafts a
/// step), 1 request decoded at 1.63x its speed without drafts and 8 at 1.31x, 16 drafting one
/// token each at 0.93x and 32 drafting 4 at 0.73x (`docs/runs/gpu/2026-11-29-engine-drafts.md`,
/// calls 1-3).
pub(super) const DRAFTING_SEQUENCES: usize = 8;

/// Caches of one sequence kept for the next prompts: a few, as prompts run one chunk at a time.
pub(super) const SPARE_PROMPT_CACHES: usize = 4;

pub(super) struct Worker<B: GemmaBackend> {
    pub(super) model: Gemma<B>,
    /// The model's image reader, where it reads pictures.
    pub(super) vision: Option<Vision<B>>,
    pub(super) steps: Steps<B>,
    pub(super) tokenizer: Arc<Tokenizer>,
    /// The model's stop tokens, which every request's own extend.
    pub(super) default_stops: Vec<u32>,
    pub(super) config: EngineConfig,
    pub(super) metrics: Arc<EngineMetrics>,
    pub(super) waiting: VecDeque<Submitted>,
    pub(super) running: Vec<Sequence<B>>,
    /// The generating sequences' keys and values (the batched cache's first `generating`
    /// sequences) and the prefix cache.
    pub(super) kv: KvManager<B>,
    /// Positions per sequence (the cache's capacity is this rounded up to a block).
    pub(super) capacity: usize,
    pub(super) generating: usize,
    /// Prompt caches of finished prompts, reset, for the next.
    pub(super) spare: Vec<KvCache<B>>,
    /// Why the batched cache can no longer be trusted (a sequence could not be moved in it):
    /// the generating sequences end with this at the next round.
    pub(super) broken: Option<String>,
    pub(super) draining: bool,
    /// Test builds: a panic the next round makes.
    #[cfg(test)]
    pub(super) fault: bool,
}

impl<B: GemmaBackend> Worker<B> {
    pub(super) fn run(mut self, inbox: mpsc::Receiver<Command>) {
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
    pub(super) fn recover(&mut self, message: String) {
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
    pub(super) fn fail_with_panic(&self, events: &EventSender, what: &'static str, message: String) {
        self.metrics.requests_failed.fetch_add(1, Ordering::Relaxed);
        let e = BackendError::Panicked { what, message };
        let _ = events.send(Err(e.into()));
    }

    /// Moves waiting requests to the running while there is room: each gets a prompt cache.
    ///
    /// Each takes the KV blocks it will hold in the batched cache; the first waiting request
    /// whose blocks are not free waits, and the ones behind it with it (in order of arrival),
    /// until sequences leave.
    pub(super) fn admit(&mut self) {
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
            let reservation = match self.kv.reserve(positions, prompt) {
                Ok(reservation) => reservation,
                Err(ModelError::KvBlocks { .. }) if !self.running.is_empty() => {
                    // Blocks come back as the running leave.
                    self.waiting.push_front(submitted);
                    break;
                }
                Err(e) => {
                    self.metrics.waiting.fetch_sub(1, Ordering::SeqCst);
                    self.metrics.requests_failed.fetch_add(1, Ordering::Relaxed);
                    let _ = submitted.events.send(Err(e.into()));
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
                    self.kv.release(reservation);
                    self.metrics.requests_failed.fetch_add(1, Ordering::Relaxed);
                    let _ = submitted.events.send(Err(e));
                }
            }
        }
        for submitted in following.into_iter().rev() {
            self.waiting.push_front(submitted);
        }
    }

    /// Whether a prompt beginning with `input` would find more of itself cached after a prompt
    /// still running is (one starting with the same blocks): then it waits for that one.
    pub(super) fn follows_a_prompt(&mut self, input: &[u32]) -> bool {
        let (PrefixCache::On, Some(bs)) = (self.config.prefix_cache, self.kv.rows.block_size()) else { return false };
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
            Some(reach) => reach > self.kv.cached_prefix(input),
            None => false,
        }
    }

    /// A sequence for `submitted`: a prompt cache (a spare one where there is one), its stop
    /// tokens.
    pub(super) fn start(
        &mut self,
        submitted: Submitted,
        mut reservation: PromptBlocks,
    ) -> Result<Sequence<B>, Box<(Submitted, PromptBlocks, Error)>> {
        let mut cache = match self.spare.pop() {
            Some(cache) => cache,
            None => match self.model.new_cache_with(1, self.kv.rows.capacity(), self.config.drafts.window_store()) {
                Ok(cache) => {
                    self.metrics.kv_cache_bytes.fetch_add(cache.device_bytes() as u64, Ordering::SeqCst);
                    cache
                }
                Err(e) => return Err(Box::new((submitted, reservation, e.into()))),
            },
        };
        // A cached prefix goes into the prompt's cache, and the prompt runs from its end.
        if let Err(e) = self.kv.fill_prefix(&mut reservation, &mut cache) {
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
        let chunk = match (self.config.prefix_cache, self.kv.rows.ring_slots().and_then(NonZeroUsize::new)) {
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
    pub(super) fn round(&mut self) {
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
    pub(super) fn leave_cancelled(&mut self) {
        let mut i = 0;
        while i < self.running.len() {
            if self.running[i].submitted.cancelled() {
                self.conclude(i, Ok(StopReason::Interrupted));
            } else {
                i += 1;
            }
        }
    }

    /// Takes running sequence `i` out, finished with `reason` or failed, and tells its stream.
    /// A generating sequence's row goes to the last generating sequence.
    pub(super) fn conclude(&mut self, i: usize, outcome: Result<StopReason, Error>) {
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
                Err(e)
            }
        };
        let _ = sequence.submitted.events.send(event);
    }

    /// Frees what `sequence` held: its prompt cache goes to the spares, its row to the last
    /// generating sequence.
    pub(super) fn retire(&mut self, sequence: &mut Sequence<B>) {
        self.metrics.running.fetch_sub(1, Ordering::SeqCst);
        match std::mem::replace(&mut sequence.place, Place::Row(usize::MAX)) {
            Place::Prompt(cache, reservation) => {
                self.kv.release(reservation);
                self.keep_spare(cache);
            }
            Place::Row(row) => {
                self.generating -= 1;
                self.kv.rows.release(row);
                let last = self.generating;
                if row != last && self.broken.is_none() {
                    if let Err(e) = self.kv.rows.move_sequence(last, row) {
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
    pub(super) fn keep_spare(&mut self, mut cache: KvCache<B>) {
        if self.spare.len() < SPARE_PROMPT_CACHES {
            cache.reset();
            self.spare.push(cache);
        } else {
            self.metrics.kv_cache_bytes.fetch_sub(cache.device_bytes() as u64, Ordering::SeqCst);
        }
    }

    pub(super) fn finish_cancelled(&self, submitted: Submitted) {
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
    pub(super) fn abort(&mut self) {
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

/// Runs `f`, turning a panic in the backend (the GPU runtimes panic on some device failures)
/// into an error naming `what`.
pub(super) fn catch_panic<T>(what: &'static str, f: impl FnOnce() -> Result<T, Error>) -> Result<T, Error> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(f))
        .unwrap_or_else(|panic| Err(BackendError::Panicked { what, message: panic_message(&*panic) }.into()))
}

/// The message a panic carried, where it carried text.
pub(super) fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic without a message".into())
}
