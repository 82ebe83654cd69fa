//! Speculative decoding: a drafter proposes the next few tokens cheaply, the model scores them
//! all in one step and keeps the longest prefix it agrees with, plus one token of its own. At
//! batch 1 a step reads every weight once, so each kept draft token is a token for (almost)
//! nothing. The text is the model's: greedy decoding gives the same tokens as without drafts,
//! and sampled decoding keeps the model's distribution ([`accept`]'s rule).
//!
//! Drafters: [`PromptLookup`] (the continuation of an earlier occurrence of the last tokens;
//! no model) and [`DraftModel`] (a smaller Gemma of the same vocabulary). Set one on a
//! [`crate::Generator`] with [`crate::Generator::set_speculation`].

pub mod accept;
mod draft_model;
mod ngram;

pub use accept::Proposal;
pub use draft_model::{DraftModel, Drafts};
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

/// A drafter and how much it drafts, as a [`crate::Generator`] uses them.
#[derive(Debug)]
pub struct Speculation<B: GemmaBackend> {
    pub(crate) drafter: Drafter<B>,
    length: DraftLength,
    /// What the next step drafts (moves with [`DraftLength::Adaptive`]).
    current: usize,
}

impl<B: GemmaBackend> Speculation<B> {
    pub fn new(drafter: Drafter<B>, length: DraftLength) -> Self {
        Self { drafter, current: length.initial(), length }
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

    /// Adjusts an adaptive length after a step that drafted `drafted` tokens and kept `kept`.
    pub(crate) fn adapt(&mut self, drafted: usize, kept: usize) {
        if let DraftLength::Adaptive { max } = self.length {
            self.current = if kept == drafted { self.current + 2 } else { self.current.saturating_sub(1) };
            self.current = self.current.clamp(1, max.get());
        }
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
