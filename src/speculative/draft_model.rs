//! A smaller Gemma drafting for a larger one of the same vocabulary (Gemma 3 270M for Gemma 3
//! 1B-27B), with a KV cache of its own that follows the conversation: each step it runs the
//! tokens the target accepted since its last draft, then decodes the draft token by token.

use super::accept::{pick, Proposal};
use crate::{
    generation::{checked_token, first_sampled, prefill, token_tensor},
    sampling::Sampler,
    Error, Gemma, GemmaBackend, KvCache,
};
use burn::tensor::Tensor;
use burn_gemma_model::Checkpoint;
use std::num::NonZeroUsize;

/// A draft model and the state of its cache.
pub struct DraftModel<B: GemmaBackend> {
    model: Gemma<B>,
    cache: Option<KvCache<B>>,
    /// The tokens the cache holds, in order.
    fed: Vec<u32>,
    /// Taken before the last draft's tokens were written: lets the cache drop those the
    /// target refused.
    checkpoint: Option<Checkpoint<B>>,
}

impl<B: GemmaBackend> std::fmt::Debug for DraftModel<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DraftModel").field("layers", &self.model.num_layers()).field("fed", &self.fed.len()).finish()
    }
}

/// Drafted tokens and what each was drawn from.
#[derive(Debug, Clone, Default)]
pub struct Drafts {
    pub tokens: Vec<u32>,
    /// One per token.
    pub proposals: Vec<Proposal>,
}

impl<B: GemmaBackend> DraftModel<B> {
    /// Wraps a loaded model (its vocabulary is checked against the target's when it is set on
    /// a [`crate::Generator`]).
    pub fn new(model: Gemma<B>) -> Self {
        Self { model, cache: None, fed: Vec::new(), checkpoint: None }
    }

    /// The draft model.
    pub fn model(&self) -> &Gemma<B> {
        &self.model
    }

    /// Up to `k` tokens continuing `context` (every token of the conversation, the one not yet
    /// run by the target included), chosen by `sampler`: greedy, or drawn with its filters,
    /// repetition penalty and random draws.
    pub fn draft(
        &mut self,
        context: &[u32],
        k: usize,
        sampler: &mut Sampler,
        chunk: NonZeroUsize,
    ) -> Result<Drafts, Error> {
        let limit = self.model.config().max_position_embeddings;
        // Room for the context and the draft's tokens but the last, which is never run.
        let k = k.min(limit.saturating_sub(context.len()) + 1);
        if k == 0 || context.is_empty() {
            return Ok(Drafts::default());
        }
        let mut cache = self.synced_cache(context, context.len() + k - 1)?;
        // The cache takes back at most a sliding window's positions.
        let k = k.min(cache.checkpoint_limit() + 1);
        let device = self.model.device();
        let result = (|| {
            let logits = prefill(&self.model, &mut cache, &context[self.fed.len()..], chunk, &device)?;
            self.fed = context.to_vec();
            let checkpoint = cache.checkpoint(k - 1)?;
            let mut drafts = Drafts::default();
            let mut logits = logits;
            for i in 0..k {
                let history: Vec<u32> = context.iter().chain(&drafts.tokens).copied().collect();
                let (token, proposal) = choose(logits.clone(), &history, sampler)?;
                drafts.tokens.push(token);
                drafts.proposals.push(proposal);
                if i + 1 < k {
                    logits = self.model.forward_last(token_tensor(&[token], &device), &mut cache)?;
                    self.fed.push(token);
                }
            }
            self.checkpoint = Some(checkpoint);
            Ok(drafts)
        })();
        if result.is_err() {
            // What the cache holds is no longer known: the next draft starts afresh.
            cache.reset();
            self.fed.clear();
            self.checkpoint = None;
        }
        self.cache = Some(cache);
        result
    }

    /// The cache, holding a prefix of `context` short of its last token (`self.fed` says
    /// which), with room for `positions`: the tokens since the last draft that `context` no
    /// longer has are taken back, or everything where they cannot be. `context` is not empty.
    fn synced_cache(&mut self, context: &[u32], positions: usize) -> Result<KvCache<B>, Error> {
        // The last token is always run again: its logits give the first draft.
        let common = self.fed.iter().zip(context).take_while(|(a, b)| a == b).count().min(context.len() - 1);
        let mut cache = match self.cache.take().filter(|c| c.capacity() >= positions) {
            Some(cache) => cache,
            None => {
                let limit = self.model.config().max_position_embeddings;
                self.fed.clear();
                self.checkpoint = None;
                self.model.new_cache(1, positions.next_multiple_of(256).min(limit))?
            }
        };
        if cache.len() > common {
            let rewound = self.checkpoint.as_ref().is_some_and(|c| cache.rewind(c, common).is_ok());
            if !rewound {
                cache.reset();
            }
        }
        self.fed.truncate(cache.len());
        Ok(cache)
    }
}

/// The draft token of `logits` (`[1, vocab]`, f32) and what it was drawn from: the sampler's
/// greedy choice on the device, or a draw from its distribution on the host.
pub(super) fn choose<B: GemmaBackend>(
    logits: Tensor<B, 2>,
    history: &[u32],
    sampler: &mut Sampler,
) -> Result<(u32, Proposal), Error> {
    if sampler.is_greedy() {
        let id = first_sampled(sampler.sample_with_draws(logits, history, &[0.0])?)?;
        let token = checked_token(id, usize::MAX, 0)?;
        return Ok((token, Proposal::Certain));
    }
    let distribution = sampler.host_distribution(logits, history)?;
    let token = pick(&distribution, sampler.uniform()).ok_or(Error::NonFiniteLogits { step: 0 })?;
    Ok((token, Proposal::Sampled(distribution)))
}
