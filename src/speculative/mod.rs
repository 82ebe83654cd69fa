//! Speculative decoding: a drafter proposes the next few tokens cheaply, the model scores them
//! all in one step and keeps the longest prefix it agrees with, plus one token of its own. At
//! batch 1 a step reads every weight once, so each kept draft token is a token for (almost)
//! nothing. The text is the model's: greedy decoding gives the same tokens as without drafts,
//! and sampled decoding keeps the model's distribution ([`accept`]'s rule).
//!
//! Drafters: [`PromptLookup`] (the continuation of an earlier occurrence of the last tokens;
//! no model), [`DraftModel`] (a smaller Gemma of the same vocabulary) and [`AssistantDrafter`]
//! (a Gemma 4 assistant, reading the model's own hidden states and KV cache). Set one on a
//! [`crate::Generator`] with [`crate::Generator::set_speculation`].

pub mod accept;
mod assistant;
mod draft_model;
pub(crate) mod judge;
mod ngram;

pub use accept::Proposal;
pub use assistant::AssistantDrafter;
pub use draft_model::{DraftModel, DraftSteps, Drafts};
pub use ngram::PromptLookup;

use crate::GemmaBackend;
use std::num::NonZeroUsize;

/// Where drafts come from.
#[derive(Debug)]
pub enum Drafter<B: GemmaBackend> {
    /// Prompt lookup: the tokens after an earlier occurrence of the context's last n-gram.
    PromptLookup(PromptLookup),
    /// A smaller Gemma with the target's vocabulary, running a KV cache of its own.
    Model(Box<DraftModel<B>>),
    /// A Gemma 4 assistant of the model (`gemma-4-*-it-assistant`).
    Assistant(Box<AssistantDrafter<B>>),
}

impl<B: GemmaBackend> Drafter<B> {
    /// Whether drafts start from the model's final hidden states (which steps then keep).
    pub(crate) fn reads_hidden_states(&self) -> bool {
        matches!(self, Self::Assistant(_))
    }
}

/// How many tokens each step drafts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DraftLength {
    /// Always up to this many.
    Fixed(NonZeroUsize),
    /// Starting at 4 (or `max` if smaller): two more after a step that kept every draft, one
    /// fewer after a step that refused some, within `1..=max`.
    Adaptive { max: NonZeroUsize },
}

impl DraftLength {
    /// The length the first step drafts.
    fn initial(self) -> usize {
        match self {
            Self::Fixed(k) => k.get(),
            Self::Adaptive { max } => max.get().min(4),
        }
    }
}

/// What drafting does after a verify step that kept no draft.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Misses {
    /// Pause drafting for 1, 2, 4, ... up to [`MAX_PAUSE`] steps (reset by a kept draft): a
    /// drafter that is always wrong then costs a verify step only now and then.
    #[default]
    Backoff,
    /// Draft at every step whatever was kept.
    KeepDrafting,
}

/// A drafter and how much it drafts, as a [`crate::Generator`] uses them.
#[derive(Debug)]
pub struct Speculation<B: GemmaBackend> {
    pub(crate) drafter: Drafter<B>,
    length: DraftLength,
    /// What the next step drafts (moves with [`DraftLength::Adaptive`]).
    current: usize,
    misses: Misses,
    /// Steps left without drafts, and the length of the last such pause ([`Misses::Backoff`]).
    pause: usize,
    backoff: usize,
}

/// The longest pause in drafting after verify steps that kept nothing.
pub const MAX_PAUSE: usize = 32;

impl<B: GemmaBackend> Speculation<B> {
    pub fn new(drafter: Drafter<B>, length: DraftLength) -> Self {
        Self { drafter, current: length.initial(), length, misses: Misses::default(), pause: 0, backoff: 0 }
    }

    /// What drafting does after a verify step that kept nothing (default [`Misses::Backoff`]).
    pub fn with_misses(mut self, misses: Misses) -> Self {
        self.misses = misses;
        self
    }

    /// Prompt lookup with its default n-grams, drafting up to `k` tokens.
    pub fn prompt_lookup(k: NonZeroUsize) -> Self {
        Self::new(Drafter::PromptLookup(PromptLookup::default()), DraftLength::Fixed(k))
    }

    /// The drafter.
    pub fn drafter(&self) -> &Drafter<B> {
        &self.drafter
    }

    /// How many tokens the next step drafts at most.
    pub(crate) fn next_length(&self) -> usize {
        self.current
    }

    /// The most tokens any step drafts.
    pub(crate) fn max_length(&self) -> usize {
        match self.length {
            DraftLength::Fixed(k) => k.get(),
            DraftLength::Adaptive { max } => max.get(),
        }
    }

    /// Back to the first step's length, without a pause (a new request).
    pub(crate) fn restart(&mut self) {
        self.current = self.length.initial();
        self.pause = 0;
        self.backoff = 0;
    }

    /// Whether this step drafts (counts a paused step down).
    pub(crate) fn drafts_now(&mut self) -> bool {
        if self.pause > 0 {
            self.pause -= 1;
            return false;
        }
        true
    }

    /// Adjusts an adaptive length after a step that drafted `drafted` tokens and kept `kept`,
    /// and pauses drafting after one that kept none.
    pub(crate) fn adapt(&mut self, drafted: usize, kept: usize) {
        if kept == 0 && self.misses == Misses::Backoff {
            self.backoff = (self.backoff * 2).clamp(1, MAX_PAUSE);
            self.pause = self.backoff;
        } else {
            self.backoff = 0;
        }
        if let DraftLength::Adaptive { max } = self.length {
            self.current = if kept == drafted { self.current + 2 } else { self.current.saturating_sub(1) };
            self.current = self.current.clamp(1, max.get());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backends::NdArray;

    fn lookup(length: DraftLength) -> Speculation<NdArray> {
        Speculation::new(Drafter::PromptLookup(PromptLookup::default()), length)
    }

    #[test]
    fn drafting_pauses_longer_after_each_step_that_kept_nothing() {
        let mut s = lookup(DraftLength::Fixed(NonZeroUsize::MIN));
        let mut pauses = Vec::new();
        for _ in 0..8 {
            assert!(s.drafts_now());
            s.adapt(1, 0);
            let mut paused = 0;
            while !s.drafts_now() {
                paused += 1;
            }
            pauses.push(paused);
        }
        assert_eq!(pauses, vec![1, 2, 4, 8, 16, 32, 32, 32]);
        // A kept draft ends the backoff.
        s.adapt(3, 1);
        assert!(s.drafts_now());
        s.adapt(3, 0);
        assert!(!s.drafts_now());
        assert!(s.drafts_now());
        let mut always = lookup(DraftLength::Fixed(NonZeroUsize::MIN)).with_misses(Misses::KeepDrafting);
        always.adapt(1, 0);
        assert!(always.drafts_now());
    }

    #[test]
    fn adaptive_length_follows_what_is_kept() {
        let max = NonZeroUsize::new(7).unwrap();
        let mut s = lookup(DraftLength::Adaptive { max });
        assert_eq!(s.next_length(), 4);
        s.adapt(4, 4);
        assert_eq!(s.next_length(), 6);
        s.adapt(6, 6);
        assert_eq!(s.next_length(), 7);
        s.adapt(7, 3);
        assert_eq!(s.next_length(), 6);
        for _ in 0..10 {
            s.adapt(1, 0);
        }
        assert_eq!(s.next_length(), 1);
    }
}

/// What speculation did in one generation.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SpeculationStats {
    /// Decode steps of the model (with drafts to verify or without).
    pub target_steps: usize,
    /// Steps that verified drafts.
    pub verify_steps: usize,
    /// Draft tokens proposed, and those the model kept.
    pub drafted: usize,
    pub accepted: usize,
}

impl SpeculationStats {
    /// Share of the drafted tokens the model kept.
    pub fn acceptance_rate(&self) -> f64 {
        self.accepted as f64 / self.drafted.max(1) as f64
    }
}
