//! Serving requests on a split model ([`crate::engine::Engine::sharded`]): one worker thread
//! takes the engine's requests in order and answers each through [`ShardedModel`], one at a
//! time, with the events, stops and metrics of the batched engine.

use crate::tensor_parallel::ShardedModel;
use crate::{
    engine::{
        inbox::{Command, Submitted},
        EngineMetrics, Event, Finish,
    },
    graph_policy::EagerReason,
    output::{OutputRules, Room, SequenceOutput},
    Error, GemmaBackend, StopReason, Token, Tokenizer,
};
use std::{
    collections::VecDeque,
    sync::{atomic::Ordering, mpsc, Arc, Mutex},
    time::Duration,
};

/// What the worker thread owns.
pub(crate) struct Serving<B: GemmaBackend> {
    pub(crate) model: ShardedModel<B>,
    pub(crate) tokenizer: Arc<Tokenizer>,
    /// The model's end-of-turn tokens, every request's stops.
    pub(crate) default_stops: Vec<u32>,
    /// Positions a request may hold (prompt and generated): the shards' caches' size, kept
    /// from request to request (emptied in place, their recorded decode steps kept).
    pub(crate) capacity: usize,
    pub(crate) metrics: Arc<EngineMetrics>,
    pub(crate) eager_reason: Arc<Mutex<Option<EagerReason>>>,
}

/// Requests taken from the engine and what it was told to do.
#[derive(Default)]
struct Inbox {
    waiting: VecDeque<Submitted>,
    draining: bool,
    aborted: bool,
}

impl Inbox {
    fn take(&mut self, command: Command) {
        match command {
            Command::Submit(submitted) => self.waiting.push_back(*submitted),
            Command::Drain => self.draining = true,
            Command::Abort => self.aborted = true,
            // The split model's worker answers one request at a time: the engine's unit tests
            // inject faults into the batched worker only.
            #[cfg(test)]
            Command::Fault(_) => {}
        }
    }

    /// Every command sent so far; whether the engine is still there.
    fn poll(&mut self, inbox: &mpsc::Receiver<Command>) -> bool {
        loop {
            match inbox.try_recv() {
                Ok(command) => self.take(command),
                Err(mpsc::TryRecvError::Empty) => return true,
                Err(mpsc::TryRecvError::Disconnected) => return false,
            }
        }
    }
}

/// How one request went.
struct Answer {
    reason: StopReason,
    text: String,
    generated: usize,
    first_token: Option<Duration>,
}

impl<B: GemmaBackend> Serving<B> {
    /// Answers requests in order until the engine drains (after the waiting ones) or aborts
    /// (every request still there interrupted).
    pub(crate) fn run(mut self, commands: mpsc::Receiver<Command>) {
        let mut inbox = Inbox::default();
        loop {
            if inbox.waiting.is_empty() && !inbox.draining && !inbox.aborted {
                match commands.recv() {
                    Ok(command) => inbox.take(command),
                    Err(_) => break,
                }
            }
            let connected = inbox.poll(&commands);
            if inbox.aborted || !connected {
                break;
            }
            let Some(submitted) = inbox.waiting.pop_front() else {
                if inbox.draining {
                    break;
                }
                continue;
            };
            self.metrics.waiting.fetch_sub(1, Ordering::SeqCst);
            self.metrics.running.fetch_add(1, Ordering::SeqCst);
            self.metrics.prompt_tokens.fetch_add(submitted.request.input.len() as u64, Ordering::Relaxed);
            self.serve(submitted, &commands, &mut inbox);
            self.metrics.running.fetch_sub(1, Ordering::SeqCst);
        }
        for submitted in inbox.waiting.drain(..) {
            self.metrics.waiting.fetch_sub(1, Ordering::SeqCst);
            self.finish(
                &submitted,
                Ok(Answer { reason: StopReason::Interrupted, text: String::new(), generated: 0, first_token: None }),
            );
        }
    }

    fn serve(&mut self, mut submitted: Submitted, commands: &mpsc::Receiver<Command>, inbox: &mut Inbox) {
        let answer = self.answer(&mut submitted, commands, inbox);
        if let Some(why) = self.model.eager_reason() {
            if let Ok(mut reason) = self.eager_reason.lock() {
                reason.get_or_insert_with(|| why.clone());
            }
        }
        self.finish(&submitted, answer);
    }

    /// Generates for `submitted` until one of its stops, sending each token's event.
    fn answer(
        &mut self,
        submitted: &mut Submitted,
        commands: &mpsc::Receiver<Command>,
        inbox: &mut Inbox,
    ) -> Result<Answer, Error> {
        let generation = &submitted.request.generation;
        let mut output = SequenceOutput::new(OutputRules {
            stop_tokens: self.default_stops.iter().chain(&generation.stop_tokens).copied().collect(),
            stop_strings: generation.stop_strings.clone(),
            max_new_tokens: generation.max_new_tokens,
        });
        let on_device = submitted.sampler.is_greedy() && !submitted.sampler.penalizes();
        let mut history = submitted.request.input.clone();
        let mut input = history.clone();
        let mut first_token = None;
        self.model.new_cache(self.capacity)?;
        let reason = loop {
            let interrupted = !inbox.poll(commands) || inbox.aborted;
            if interrupted || submitted.cancel.load(Ordering::SeqCst) {
                break StopReason::Interrupted;
            }
            let token = if on_device {
                self.model.greedy(&input)?
            } else {
                let mut logits = self.model.logits(&input)?;
                submitted.sampler.sample(&mut logits, &history)
            };
            if first_token.is_none() {
                let elapsed = submitted.submitted.elapsed();
                first_token = Some(elapsed);
                self.metrics.first_tokens.fetch_add(1, Ordering::Relaxed);
                self.metrics.first_token_micros.fetch_add(elapsed.as_micros() as u64, Ordering::Relaxed);
            }
            self.metrics.generated_tokens.fetch_add(1, Ordering::Relaxed);
            history.push(token);
            let room = Room { used: self.model.position(), capacity: self.capacity };
            let emitted = output.push(token, self.tokenizer.token_bytes(token), room);
            if let Some(text) = emitted.text {
                if submitted.events.send(Ok(Event::Token(Token { id: token, text }))).is_err() {
                    break StopReason::Interrupted;
                }
            }
            if let Some(reason) = emitted.stop {
                break reason;
            }
            input = vec![token];
        };
        Ok(Answer { reason, text: output.finish(), generated: output.generated(), first_token })
    }

    /// Sends the request's last event: how it ended, or its error.
    fn finish(&self, submitted: &Submitted, answer: Result<Answer, Error>) {
        let event = match answer {
            Ok(answer) => {
                self.metrics.requests_finished.fetch_add(1, Ordering::Relaxed);
                Ok(Event::Done(Finish {
                    reason: answer.reason,
                    text: answer.text,
                    prompt_tokens: submitted.request.input.len(),
                    generated_tokens: answer.generated,
                    time_to_first_token: answer.first_token,
                }))
            }
            Err(e) => {
                self.metrics.requests_failed.fetch_add(1, Ordering::Relaxed);
                Err(e)
            }
        };
        let _ = submitted.events.send(event);
    }
}
