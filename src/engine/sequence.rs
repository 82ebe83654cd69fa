//! A running request: where its keys and values are, what it runs next, what it hands out.

use super::inbox::Submitted;
use super::kv_manager::PromptBlocks;
use super::metrics::EngineMetrics;
use super::request::Event;
use crate::{
    generation::chunk_end,
    output::{Room, SequenceOutput},
    GemmaBackend, ImageEmbeds, KvCache, StopReason, Token, Tokenizer,
};

use std::{num::NonZeroUsize, sync::atomic::Ordering, time::Duration};

/// Where a running sequence's keys and values are.
// A few dozen sequences at most are running: the prompt's cache held inline costs nothing worth
// a box.
#[allow(clippy::large_enum_variant)]
pub(super) enum Place<B: GemmaBackend> {
    /// Its prompt runs in a cache of its own; the blocks of the batched cache it will hold.
    Prompt(KvCache<B>, PromptBlocks),
    /// Generating: sequence `row` of the batched cache.
    Row(usize),
}

/// A running request.
pub(super) struct Sequence<B: GemmaBackend> {
    pub(super) submitted: Submitted,
    pub(super) place: Place<B>,
    /// Prompt and generated tokens in the cache so far.
    pub(super) context: Vec<u32>,
    /// What the next step feeds the model: the prompt first, then the last token.
    pub(super) input: Vec<u32>,
    /// Stop tokens, stop strings, limits and the text held back.
    pub(super) output: SequenceOutput,
    pub(super) first_token: Option<Duration>,
    /// Positions its cache holds.
    pub(super) capacity: usize,
    /// Tokens per prompt chunk: the request's, at most the shortest sliding window where
    /// prompts are cached ([`EngineConfig::prefix_cache`]).
    pub(super) chunk: NonZeroUsize,
    /// The embeddings of the pictures still to run, by their row in `input`.
    pub(super) images: Vec<ImageEmbeds<B>>,
}

impl<B: GemmaBackend> Sequence<B> {
    /// The batched cache's sequence it generates in, once its prompt is done.
    pub(super) fn row(&self) -> Option<usize> {
        match self.place {
            Place::Row(row) => Some(row),
            Place::Prompt(..) => None,
        }
    }

    /// Tokens its next prompt step runs: the next chunk, run on to the end of a picture it
    /// would end inside (a picture's soft tokens attend to each other in one step).
    pub(super) fn next_chunk(&self) -> usize {
        chunk_end(&self.images, self.input.len().min(self.chunk.get()))
    }

    /// Whether its prompt had pictures (such a prompt's blocks are not shared).
    pub(super) fn has_images(&self) -> bool {
        !self.submitted.request.images.is_empty()
    }
}

/// A sampled `token` of `sequence`: counted, checked against its stops, its text sent to its
/// stream; whether the sequence goes on (its next input is then the token).
pub(super) fn emit<B: GemmaBackend>(
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

/// Emits what a verify step gave `sequence`: the `kept` drafts (fed in the step, so now in its
/// context), then the model's `next` token, stopping at the first that ends it.
pub(super) fn emit_verified<B: GemmaBackend>(
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

/// What one step of a sequence came to.
pub(super) enum Stepped {
    Continue,
    Finished(StopReason),
}
