//! A Gemma 4 assistant drafting for its target ([`Gemma4Assistant`]): each round starts from
//! the target's pending token, its final hidden state at the position before and its KV cache,
//! and runs the assistant once per draft token, all at the pending token's position.

use super::draft_model::{choose, Drafts};
use crate::{generation::token_tensor, sampling::Sampler, Error, Gemma, GemmaBackend, KvCache};
use burn::tensor::Tensor;
use burn_gemma_model::{DraftInput, Gemma4Assistant};

/// A Gemma 4 assistant as a drafter.
#[derive(Debug)]
pub struct AssistantDrafter<B: GemmaBackend> {
    assistant: Gemma4Assistant<B>,
}

impl<B: GemmaBackend> AssistantDrafter<B> {
    /// Wraps a loaded assistant (checked against the model when it is set on a
    /// [`crate::Generator`]).
    pub fn new(assistant: Gemma4Assistant<B>) -> Self {
        Self { assistant }
    }

    /// The assistant.
    pub fn assistant(&self) -> &Gemma4Assistant<B> {
        &self.assistant
    }

    /// Up to `k` tokens after `pending` (the token at the position after the last that `cache`,
    /// the target's, holds), chosen by `sampler`; `hidden`: the target's final hidden state
    /// (`[1, hidden]`) at the position before `pending`; `context`: every token of the
    /// conversation, `pending` last (for the sampler's repetition penalty).
    pub(crate) fn draft(
        &self,
        target: &Gemma<B>,
        cache: &KvCache<B>,
        (pending, hidden): (u32, Tensor<B, 2>),
        context: &[u32],
        k: usize,
        sampler: &mut Sampler,
    ) -> Result<Drafts, Error> {
        let device = target.device();
        let mut drafts = Drafts::default();
        let (mut token, mut hidden) = (pending, hidden);
        for _ in 0..k {
            let input = DraftInput { ids: token_tensor(&[token], &device), hidden };
            let out = self.assistant.step(target, cache, input)?;
            let history: Vec<u32> = context.iter().chain(&drafts.tokens).copied().collect();
            let (next, proposal) = choose(out.logits, &history, sampler)?;
            drafts.tokens.push(next);
            drafts.proposals.push(proposal);
            (token, hidden) = (next, out.hidden);
        }
        Ok(drafts)
    }
}
