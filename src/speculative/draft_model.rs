//! A smaller Gemma drafting for a larger one of the same vocabulary (Gemma 3 270M for Gemma 3
//! 1B-27B), with a KV cache of its own that follows the conversation: each step it runs the
//! tokens the target accepted since its last draft, then decodes the draft token by token,
//! eagerly or replaying a recorded CUDA graph per token ([`DraftSteps`]).

use super::accept::{pick, Proposal};
use crate::{
    generation::{prefill, token_tensor},
    graph_policy::{EagerReason, GraphPolicy},
    sampling::Sampler,
    sampling::{checked_token, first_sampled},
    CudaGraph, Error, Gemma, GemmaBackend, KvCache,
};
use burn::tensor::{DType, Tensor};
use burn_gemma_kernels::SamplingParams;
use burn_gemma_model::{DecodeGraphs, ModelError, RewindPoint, WindowStore};
use std::num::NonZeroUsize;

/// How a draft model runs its one-token steps.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DraftSteps {
    /// As the model's tensor operations.
    Eager,
    /// Replayed as a recorded CUDA graph, in a cache that keeps every position of its sliding
    /// windows (taking refused drafts back then only moves its length). Where recording fails
    /// the model drafts eagerly from then on.
    Graph,
}

/// Rows of the recorded catch-up step: the tokens the target accepted since the last draft
/// run through it as consecutive rows, at most this many a replay (fewer padded with the last,
/// their rows taken back).
const CATCH_UP_ROWS: usize = 8;

/// A catch-up longer than this (a new conversation's prompt) runs eagerly as a prompt, but for
/// its last token. On a GPU an eager step is bound by its launches (a 1B-shaped model on an
/// H200: 11.9 ms eager, 1.4 ms replayed, BENCHMARKS.md), so up to 16 replays still cost less;
/// a catch-up after the longest pause in drafting ([`super::MAX_PAUSE`] tokens) stays
/// replayed.
const EAGER_CATCH_UP: usize = 16 * CATCH_UP_ROWS;

/// A draft model and the state of its cache.
pub struct DraftModel<B: GemmaBackend> {
    model: Gemma<B>,
    cache: Option<KvCache<B>>,
    /// The tokens the cache holds, in order.
    fed: Vec<u32>,
    /// Taken before the last draft's tokens were written: lets the cache drop those the
    /// target refused.
    checkpoint: Option<RewindPoint<B>>,
    /// Recorded one-token steps for the current cache ([`DraftSteps::Graph`]).
    graphs: Option<DecodeGraphs<B>>,
    /// Recorded catch-up steps of [`CATCH_UP_ROWS`] consecutive rows for the current cache.
    catch_up: Option<DecodeGraphs<B>>,
    /// What replaying its steps taught: once a recording failed, every step is eager.
    graph_policy: GraphPolicy,
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
        Self {
            model,
            cache: None,
            fed: Vec::new(),
            checkpoint: None,
            graphs: None,
            catch_up: None,
            graph_policy: GraphPolicy::default(),
        }
    }

    /// Why this drafter's steps run eagerly although graphs were asked for (`None` while they
    /// replay, or were never asked for).
    pub fn eager_reason(&self) -> Option<&EagerReason> {
        self.graph_policy.eager_reason()
    }

    /// The draft model.
    pub fn model(&self) -> &Gemma<B> {
        &self.model
    }

    /// Up to `k` tokens continuing `context` (every token of the conversation, the one not yet
    /// run by the target included), chosen by `sampler`: greedy, or drawn with its filters,
    /// repetition penalty and random draws; each one-token step run as `steps` says.
    pub fn draft(
        &mut self,
        context: &[u32],
        k: usize,
        sampler: &mut Sampler,
        (chunk, steps): (NonZeroUsize, DraftSteps),
    ) -> Result<Drafts, Error> {
        let limit = self.model.config().max_position_embeddings;
        // Room for the context and the draft's tokens but the last, which is never run.
        let k = k.min(limit.saturating_sub(context.len()) + 1);
        if k == 0 || context.is_empty() {
            return Ok(Drafts::default());
        }
        let windows = match steps {
            DraftSteps::Graph => WindowStore::EveryPosition,
            DraftSteps::Eager => WindowStore::Ring,
        };
        let graph = steps == DraftSteps::Graph && self.graph_policy.replays(CudaGraph::Auto, 1);
        let mut cache = self.synced_cache(context, context.len() + k - 1, windows)?;
        // The cache takes back at most a sliding window's positions.
        let k = k.min(cache.checkpoint_limit() + 1);
        let mut result = self.draft_into(&mut cache, context, k, sampler, (chunk, graph));
        let recording_failed = matches!(&result, Err(Error::Model(e)) if matches!(**e, ModelError::Graph(_)));
        if graph && recording_failed {
            if let Err(failure) = std::mem::replace(&mut result, Ok(Drafts::default())) {
                // Recording failed: eager from here on (Auto never refuses), starting afresh.
                let _ = self.graph_policy.fall_back(CudaGraph::Auto, 1, failure);
            }
            self.graphs = None;
            self.catch_up = None;
            cache.reset();
            self.fed.clear();
            self.checkpoint = None;
            result = self.draft_into(&mut cache, context, k, sampler, (chunk, false));
        }
        if result.is_err() {
            // What the cache holds is no longer known: the next draft starts afresh.
            cache.reset();
            self.fed.clear();
            self.checkpoint = None;
        }
        self.cache = Some(cache);
        result
    }

    /// [`DraftModel::draft`] into `cache` (synced), `k` tokens at most its checkpoint limit;
    /// `graph`: one-token steps replay a recorded CUDA graph.
    fn draft_into(
        &mut self,
        cache: &mut KvCache<B>,
        context: &[u32],
        k: usize,
        sampler: &mut Sampler,
        (chunk, graph): (NonZeroUsize, bool),
    ) -> Result<Drafts, Error> {
        let device = self.model.device();
        let pending = &context[self.fed.len()..];
        let mut last = if graph {
            // A long catch-up (a new prompt) runs as a prompt first, but for its last token.
            let rest = match pending.len() > EAGER_CATCH_UP {
                true => {
                    prefill(&self.model, cache, &pending[..pending.len() - 1], chunk, &device)?;
                    &pending[pending.len() - 1..]
                }
                false => pending,
            };
            let mut last = None;
            for rows in rest.chunks(CATCH_UP_ROWS) {
                last = Some(self.graph_rows(cache, rows)?);
            }
            last.ok_or_else(|| ModelError::InvalidInput("a draft with nothing to run".into()))?
        } else {
            Step::Logits(prefill(&self.model, cache, pending, chunk, &device)?)
        };
        self.fed = context.to_vec();
        let checkpoint = cache.checkpoint(k - 1)?;
        let mut drafts = Drafts::default();
        for i in 0..k {
            let (token, proposal) = match &last {
                // The graph's choice is greedy without penalties; anything else draws from the
                // logits.
                Step::Chosen(token, _) if sampler.is_greedy() && !sampler.penalizes() => (*token, Proposal::Certain),
                Step::Chosen(_, logits) | Step::Logits(logits) => {
                    let history: Vec<u32> = context.iter().chain(&drafts.tokens).copied().collect();
                    choose(logits.clone().cast(DType::F32), &history, sampler)?
                }
            };
            drafts.tokens.push(token);
            drafts.proposals.push(proposal);
            if i + 1 < k {
                last = if graph {
                    self.graph_step(cache, token)?
                } else {
                    Step::Logits(self.model.forward_last(token_tensor(&[token], &device), cache)?)
                };
                self.fed.push(token);
            }
        }
        self.checkpoint = Some(checkpoint);
        Ok(drafts)
    }

    /// `tokens` (at most [`CATCH_UP_ROWS`]) through the recorded catch-up step as consecutive
    /// rows, padded with the last token to the step's rows (the padding's positions taken
    /// back); one token, or too little room left in the cache for the padding, through the
    /// one-token step. The model's greedy choice after the last token, and its logits.
    fn graph_rows(&mut self, cache: &mut KvCache<B>, tokens: &[u32]) -> Result<Step<B>, Error> {
        let [.., last] = tokens else {
            return Err(ModelError::InvalidInput("a catch-up step over no tokens".into()).into());
        };
        if tokens.len() == 1 || cache.len() + CATCH_UP_ROWS > cache.capacity() {
            let mut step = None;
            for &token in tokens {
                step = Some(self.graph_step(cache, token)?);
            }
            return step.ok_or_else(|| ModelError::InvalidInput("a catch-up step over no tokens".into()).into());
        }
        let padded: Vec<u32> = tokens.iter().copied().chain(std::iter::repeat(*last)).take(CATCH_UP_ROWS).collect();
        let start = cache.len();
        let checkpoint = cache.checkpoint(CATCH_UP_ROWS)?;
        let capacity = cache.capacity();
        let fresh = || DecodeGraphs::verify(SamplingParams::GREEDY, CATCH_UP_ROWS, capacity);
        let step = replay(&self.model, (&mut self.catch_up, fresh), cache, &padded, tokens.len() - 1)?;
        cache.rewind(&checkpoint, start + tokens.len())?;
        Ok(step)
    }

    /// One token through the recorded step (recorded first where needed): the model's greedy
    /// choice after it, and its logits.
    fn graph_step(&mut self, cache: &mut KvCache<B>, token: u32) -> Result<Step<B>, Error> {
        let capacity = cache.capacity();
        let fresh = || DecodeGraphs::new(SamplingParams::GREEDY, 1, capacity);
        replay(&self.model, (&mut self.graphs, fresh), cache, &[token], 0)
    }

    /// The cache, holding a prefix of `context` short of its last token (`self.fed` says
    /// which), with room for `positions`, its sliding windows stored as `windows` says: the
    /// tokens since the last draft that `context` no longer has are taken back, or everything
    /// where they cannot be. `context` is not empty.
    fn synced_cache(&mut self, context: &[u32], positions: usize, windows: WindowStore) -> Result<KvCache<B>, Error> {
        // The last token is always run again: its logits give the first draft.
        let common = self.fed.iter().zip(context).take_while(|(a, b)| a == b).count().min(context.len() - 1);
        let mut cache = match self.cache.take().filter(|c| c.capacity() >= positions && c.window_store() == windows) {
            Some(cache) => cache,
            None => {
                let limit = self.model.config().max_position_embeddings;
                self.fed.clear();
                self.checkpoint = None;
                // The recorded steps write the old cache's buffers.
                self.graphs = None;
                self.catch_up = None;
                self.model.new_cache_with(1, positions.next_multiple_of(256).min(limit), windows)?
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

/// `ids` through the recorded step kept in `slot` (made by `fresh` where there is none for
/// `cache`, recorded where needed, put back after): the greedy choice after row `row` and that
/// row's logits.
fn replay<B: GemmaBackend>(
    model: &Gemma<B>,
    (slot, fresh): (&mut Option<DecodeGraphs<B>>, impl FnOnce() -> DecodeGraphs<B>),
    cache: &mut KvCache<B>,
    ids: &[u32],
    row: usize,
) -> Result<Step<B>, Error> {
    let mut graphs = match slot.take() {
        Some(g) if g.serves(&SamplingParams::GREEDY, cache) => g,
        _ => fresh(),
    };
    let chosen = graphs.step(model, cache, ids, &vec![0.0; ids.len()]);
    let logits = graphs.last_logits();
    *slot = Some(graphs);
    let chosen = chosen?;
    let id = chosen.get(row).map_or(-1, |&t| i64::from(t));
    let token = checked_token(id, model.config().vocab_size, 0)?;
    let logits = logits.ok_or_else(|| ModelError::InvalidInput("a recorded draft step kept no logits".into()))?;
    let vocab = logits.dims()[1];
    Ok(Step::Chosen(token, logits.slice([row..row + 1, 0..vocab])))
}

/// What a one-token step of the draft model left: its logits (`[1, vocab]`, f32), or, from a
/// replayed graph, its greedy choice and its logits (`[1, vocab]`, the activation dtype).
enum Step<B: GemmaBackend> {
    Logits(Tensor<B, 2>),
    Chosen(u32, Tensor<B, 2>),
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
