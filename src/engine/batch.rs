//! One round's steps: prompt chunks, and one batched decode step for every generating sequence.

use super::config::EngineDrafts;
use super::kv_manager::KvManager;
use super::metrics::EngineMetrics;
use super::scheduler::{catch_panic, Worker, DRAFTING_SEQUENCES};
use super::sequence::{emit, emit_verified, Place, Sequence, Stepped};
use super::steps::{graph_setup, step_logits, step_rows, Steps};
use crate::{
    error::BackendError,
    generation::{prefill, prefill_with_images, token_tensor},
    sampling::Sampler,
    sampling::{checked_token, first_sampled, sampled_ids},
    speculative::{
        judge::{greedy_verdict, judge},
        Drafts, PromptLookup, Proposal,
    },
    Error, Gemma, GemmaBackend, GraphSetup, ImageEmbeds, KvCache, ModelError, Tokenizer,
};
use burn::tensor::{Int, Tensor, TensorData};
use burn_gemma_kernels::{Draws, SamplingParams};

use std::{num::NonZeroUsize, sync::atomic::Ordering};

impl<B: GemmaBackend> Worker<B> {
    /// Runs running sequence `i`'s next prompt chunk; after its last, samples its first token
    /// and moves it to the batched cache. A panic in the backend (the GPU runtimes panic on
    /// some device failures) ends this request with an error.
    pub(super) fn advance_prompt(&mut self, i: usize) -> Result<Stepped, Error> {
        let (model, tokenizer, metrics) = (&self.model, &self.tokenizer, &self.metrics);
        let sequence = &mut self.running[i];
        let stepped = catch_panic("a prompt step", || prompt_step(model, tokenizer, sequence, metrics))?;
        // Its blocks cached for later prompts that begin alike, as far as its cache holds them.
        let shared = !sequence.has_images();
        let cached = match &mut sequence.place {
            Place::Prompt(cache, reservation) if shared => {
                self.kv.cache_prefix(reservation, &sequence.context, cache)?
            }
            Place::Prompt(..) => 0,
            Place::Row(_) => 0,
        };
        let first_token_out = sequence.output.generated() > 0;
        if cached > 0 && !first_token_out {
            self.update_kv_metrics();
        }
        let sequence = &mut self.running[i];
        if !matches!(stepped, Stepped::Continue) || !first_token_out {
            return Ok(stepped);
        }
        // Its first token is out: its keys and values join the generating sequences', in the
        // blocks it reserved.
        let row = self.generating;
        let Place::Prompt(cache, reservation) = std::mem::replace(&mut sequence.place, Place::Row(row)) else {
            return Ok(stepped);
        };
        let joined = self.kv.attach(row, reservation).and_then(|()| self.kv.rows.copy_sequence(row, &cache, 0));
        self.keep_spare(cache);
        self.generating += 1;
        self.update_kv_metrics();
        joined?;
        Ok(stepped)
    }

    /// One batched decode step over the generating sequences, each at its own position (and
    /// its drafts at the positions after it, [`EngineConfig::drafts`]), then each one's tokens.
    /// A failed step ends every sequence in it and starts a fresh cache.
    pub(super) fn generate(&mut self) {
        let mut order: Vec<usize> = (0..self.running.len()).filter(|&i| self.running[i].row().is_some()).collect();
        order.sort_by_key(|&i| self.running[i].row());
        // The token each feeds is in its context from here on (its penalty's history).
        for &i in &order {
            let sequence = &mut self.running[i];
            sequence.context.push(sequence.input[0]);
        }
        // None past DRAFTING_SEQUENCES; within the rows a step replays as a graph and the cache's.
        let drafts: Vec<Vec<u32>> = match order.len() {
            n if n > DRAFTING_SEQUENCES => vec![Vec::new(); n],
            n => {
                let mut drafts: Vec<Vec<u32>> = order.iter().map(|&i| self.drafts_for(&self.running[i])).collect();
                share_drafts(&mut drafts, self.steps.most_rows().min(self.kv.rows.batch()).saturating_sub(n));
                drafts
            }
        };
        let drafted: usize = drafts.iter().map(Vec::len).sum();
        let model = &self.model;
        let (rows, running, steps) = (&mut self.kv.rows, &mut self.running, &mut self.steps);
        let started = std::time::Instant::now();
        let recorded = graph_setup(steps);
        let verdicts =
            catch_panic("a batched decode step", || decode_rows(model, rows, steps, running, (&order, &drafts)));
        self.note_graph_steps(recorded, verdicts.as_ref().is_ok_and(|v| v.1));
        self.metrics.decode_micros.fetch_add(started.elapsed().as_micros() as u64, Ordering::Relaxed);
        self.metrics.decode_steps.fetch_add(1, Ordering::Relaxed);
        self.metrics.decode_rows.fetch_add((order.len() + drafted) as u64, Ordering::Relaxed);
        self.metrics.draft_tokens.fetch_add(drafted as u64, Ordering::Relaxed);
        let verdicts = match verdicts {
            Ok((verdicts, _)) => verdicts,
            Err(e) => {
                self.fail_generating(e.to_string());
                return;
            }
        };
        // Each sequence's tokens; the finished leave afterwards, from the last row back, so that
        // the rows still to move are never the ones that left.
        let mut finished = Vec::new();
        for ((&i, verdict), proposed) in order.iter().zip(verdicts).zip(&drafts) {
            let sequence = &mut self.running[i];
            let outcome = verdict.map(|(kept, next)| {
                self.metrics.draft_tokens_accepted.fetch_add(kept as u64, Ordering::Relaxed);
                emit_verified(&self.tokenizer, sequence, (&proposed[..kept], next), &self.metrics)
            });
            if !matches!(outcome, Ok(Stepped::Continue)) {
                finished.push((i, outcome));
            }
        }
        finished.sort_by_key(|(i, _)| std::cmp::Reverse(*i));
        for (i, outcome) in finished {
            match outcome {
                Ok(Stepped::Finished(reason)) => self.conclude(i, Ok(reason)),
                Ok(Stepped::Continue) => {}
                Err(e) => self.conclude(i, Err(e)),
            }
        }
    }

    /// The tokens `sequence` drafts for its next step ([`EngineConfig::drafts`]): none where
    /// drafts are off or it penalizes repetition; never more than it may still generate after
    /// the step's own token, nor past its positions.
    pub(super) fn drafts_for(&self, sequence: &Sequence<B>) -> Vec<u32> {
        let EngineDrafts::PromptLookup { tokens } = self.config.drafts else { return Vec::new() };
        if sequence.submitted.sampler.penalizes() {
            return Vec::new();
        }
        let max_new = sequence.submitted.request.generation.max_new_tokens;
        // The fed token is at `context.len() - 1`; drafts take the positions after it.
        let room = max_new
            .saturating_sub(sequence.output.generated() + 1)
            .min(sequence.capacity.saturating_sub(sequence.context.len()));
        PromptLookup::default().draft(&sequence.context, tokens.get().min(room))
    }

    /// Counts a batched step replayed as a graph and what recording cost (`before`: the
    /// recordings' cost before the step).
    pub(super) fn note_graph_steps(&mut self, before: Option<GraphSetup>, replayed: bool) {
        if let (Steps::Graphs { graphs, .. }, Some(before)) = (&self.steps, before) {
            let after = graphs.setup();
            if replayed {
                self.metrics.decode_graph_steps.fetch_add(1, Ordering::Relaxed);
            }
            let recordings = (after.recordings - before.recordings) as u64;
            self.metrics.graph_recordings.fetch_add(recordings, Ordering::Relaxed);
            let micros = after.time.saturating_sub(before.time).as_micros() as u64;
            self.metrics.graph_recording_micros.fetch_add(micros, Ordering::Relaxed);
        }
    }

    /// Ends every generating sequence with `reason` (a batched step failed) and replaces the
    /// batched cache, whose stores the failure may have lost.
    pub(super) fn fail_generating(&mut self, reason: String) {
        // No sequence is moved in a cache about to be replaced.
        self.broken = Some(reason.clone());
        let mut i = self.running.len();
        while i > 0 {
            i -= 1;
            if self.running[i].row().is_some() {
                let e = BackendError::Failed { what: "a batched decode step", reason: reason.clone() };
                self.conclude(i, Err(e.into()));
            }
        }
        self.generating = 0;
        self.renew_rows();
    }

    /// A fresh batched cache in place of one that can no longer be trusted (`broken`); the
    /// old one stays where a new one cannot be made (the next round tries again).
    pub(super) fn renew_rows(&mut self) {
        let fresh =
            self.kv.rows.paged_layout().ok_or_else(|| ModelError::InvalidInput("an unpaged batched cache".into()));
        if let Ok(fresh) = fresh.and_then(|layout| self.model.new_paged_cache(layout)) {
            // The prompts running hold reservations of the old cache: made again in the new
            // (the old cache goes with its promises).
            // The old prefix index goes with it (its blocks are the old cache's).
            let mut fresh = KvManager::new(fresh, self.config.prefix_cache);
            for sequence in &mut self.running {
                if let Place::Prompt(_, reservation) = &mut sequence.place {
                    if let Ok(again) = fresh.reserve(reservation.positions(), &[]) {
                        *reservation = again;
                    }
                }
            }
            self.kv = fresh;
            self.broken = None;
        }
        self.update_kv_metrics();
    }

    /// The KV gauges: sequences generating and blocks held.
    pub(super) fn update_kv_metrics(&self) {
        self.metrics.kv_sequences_in_use.store(self.generating, Ordering::SeqCst);
        let (used, all) = self.kv.blocks_in_use().unwrap_or((0, 0));
        self.metrics.kv_blocks_in_use.store(used, Ordering::SeqCst);
        self.metrics.kv_blocks_total.store(all, Ordering::SeqCst);
        if let Some(prefix) = self.kv.prefix_stats() {
            self.metrics.kv_blocks_cached.store(prefix.held_only, Ordering::SeqCst);
            self.metrics.prefix_blocks_given_up.store(prefix.given_up, Ordering::SeqCst);
        }
    }
}

/// Runs a sequence's next prompt chunk; after the last, samples its first token, which goes to
/// its stream.
pub(super) fn prompt_step<B: GemmaBackend>(
    model: &Gemma<B>,
    tokenizer: &Tokenizer,
    sequence: &mut Sequence<B>,
    metrics: &EngineMetrics,
) -> Result<Stepped, Error> {
    let chunk = sequence.next_chunk();
    let prefill_chunk = sequence.chunk;
    let Place::Prompt(cache, _) = &mut sequence.place else {
        return Ok(Stepped::Continue);
    };
    let device = model.device();
    if chunk < sequence.input.len() {
        // A prompt chunk before its last: fills the cache, samples nothing (the chunks fall
        // where the plain generator's do, so the cache holds the same values).
        let filling: Vec<u32> = sequence.input.drain(..chunk).collect();
        let (here, later): (Vec<_>, Vec<_>) =
            std::mem::take(&mut sequence.images).into_iter().partition(|i| i.start < chunk);
        sequence.images = later.into_iter().map(|i| ImageEmbeds { start: i.start - chunk, ..i }).collect();
        match here.is_empty() {
            true => model.forward_last(token_tensor(&filling, &device), cache)?,
            false => {
                let whole = NonZeroUsize::new(filling.len()).unwrap_or(NonZeroUsize::MIN);
                prefill_with_images(model, cache, &filling, &here, whole, &device)?.0
            }
        };
        sequence.context.extend_from_slice(&filling);
        return Ok(Stepped::Continue);
    }
    let logits = match sequence.images.is_empty() {
        true => prefill(model, cache, &sequence.input, prefill_chunk, &device)?,
        false => {
            let images = std::mem::take(&mut sequence.images);
            prefill_with_images(model, cache, &sequence.input, &images, prefill_chunk, &device)?.0
        }
    };
    sequence.context.extend_from_slice(&sequence.input);
    let token = sample_alone(&mut sequence.submitted.sampler, logits, &sequence.context)?;
    let token = checked_token(token, model.config().vocab_size, sequence.output.generated())?;
    Ok(emit(tokenizer, sequence, token, metrics))
}

/// What one sequence's rows of a batched step gave: how many of its drafts the model kept and
/// its own token after them, or that sequence's error.
pub(super) type Verdict = Result<(usize, u32), Error>;

/// One decode step of the generating sequences `order` (indices into `running`, in the order
/// of their rows, which are the first rows of `rows`), each feeding its last token at its own
/// position and its `drafts` at the positions after it: per sequence, in the same order, the
/// drafts the model keeps and its own token after them (a sequence without drafts: none kept,
/// its sampled token), or that sequence's error; and whether a graph replayed the step.
pub(super) fn decode_rows<B: GemmaBackend>(
    model: &Gemma<B>,
    rows: &mut KvCache<B>,
    steps: &mut Steps<B>,
    running: &mut [Sequence<B>],
    (order, drafts): (&[usize], &[Vec<u32>]),
) -> Result<(Vec<Verdict>, bool), Error> {
    let n = order.len();
    let mut ids: Vec<u32> = order.iter().map(|&i| running[i].input[0]).collect();
    // The fed token is the last of the context.
    let mut positions: Vec<usize> = order.iter().map(|&i| running[i].context.len() - 1).collect();
    // A sequence's drafts are rows after all the sequences' own, pointed at its blocks; each
    // sequence's step rows: its own, then its drafts'.
    let mut pointed = Vec::new();
    let mut rows_of: Vec<Vec<usize>> = (0..n).map(|r| vec![r]).collect();
    for (r, drafted) in drafts.iter().enumerate().take(n) {
        for (j, &token) in drafted.iter().enumerate() {
            rows_of[r].push(ids.len());
            pointed.push((ids.len(), r));
            ids.push(token);
            positions.push(positions[r] + 1 + j);
        }
    }
    rows.set_draft_rows(&pointed)?;
    // The step runs a bucket of rows (see [`step_rows`]); the rows past the stepped ones are
    // free sequences of the cache, stepped at position 0 and their logits ignored (a sequence
    // that later takes one gets all of its slots copied in; a draft row holds no slots).
    let stepped = ids.len();
    let bucket = step_rows(stepped, rows.batch());
    ids.resize(bucket, ids.first().copied().unwrap_or(0));
    positions.resize(bucket, 0);
    let device = model.device();
    let vocab = model.config().vocab_size;
    let (logits, replayed) = step_logits(model, rows, steps, &ids, &positions)?;
    let logits = if bucket > stepped { logits.slice([0..stepped, 0..vocab]) } else { logits };
    // Each step row's choice. Rows that sample alike share one sampling launch (and one read
    // back): every sequence's own row where it has no drafts, every row of a greedy sequence
    // with drafts (its choice after each draft). A sequence with a repetition penalty, which
    // depends on its own history, samples alone; a sampled sequence with drafts is judged by
    // the rejection rule below.
    let mut choices = vec![-1i64; stepped];
    let mut groups: Vec<(SamplingParams, Vec<usize>, Vec<f32>)> = Vec::new();
    for (r, &i) in order.iter().enumerate() {
        let sampler = &mut running[i].submitted.sampler;
        let drafted = !drafts[r].is_empty();
        if sampler.penalizes() {
            let row = logits.clone().slice([r..r + 1, 0..vocab]);
            choices[r] = sample_alone(sampler, row, &running[i].context)?;
            continue;
        }
        let (members, draws) = match (drafted, sampler.is_greedy()) {
            (false, _) => (vec![r], sampler.draws(1)),
            (true, true) => (rows_of[r].clone(), vec![0.0; rows_of[r].len()]),
            (true, false) => continue,
        };
        let params = sampler.params();
        match groups.iter_mut().find(|(p, ..)| *p == params) {
            Some((_, rows, all)) => {
                rows.extend(members);
                all.extend(draws);
            }
            None => groups.push((params, members, draws)),
        }
    }
    for (params, members, draws) in groups {
        let group = if members.iter().copied().eq(0..stepped) {
            logits.clone()
        } else {
            let index: Vec<i64> = members.iter().map(|&r| r as i64).collect();
            let index = Tensor::<B, 1, Int>::from_data(TensorData::new(index, [members.len()]), &device);
            logits.clone().select(0, index)
        };
        let ids = B::sample(group, &params, Draws::Host(&draws)).map_err(burn_gemma_model::ModelError::from)?;
        for (&r, id) in members.iter().zip(sampled_ids(ids)?) {
            choices[r] = id;
        }
    }
    let verdicts = order.iter().enumerate().map(|(r, &i)| {
        let sequence = &mut running[i];
        let step = sequence.output.generated();
        let drafted = &drafts[r];
        if drafted.is_empty() {
            return checked_token(choices[r], vocab, step).map(|token| (0, token));
        }
        let sampler = &mut sequence.submitted.sampler;
        if sampler.is_greedy() {
            let mine: Vec<i64> = rows_of[r].iter().map(|&row| choices[row]).collect();
            return greedy_verdict(drafted, &mine, vocab, step);
        }
        let index: Vec<i64> = rows_of[r].iter().map(|&row| row as i64).collect();
        let index = Tensor::<B, 1, Int>::from_data(TensorData::new(index, [drafted.len() + 1]), &device);
        let proposed = Drafts { tokens: drafted.clone(), proposals: vec![Proposal::Certain; drafted.len()] };
        judge(sampler, logits.clone().select(0, index), &sequence.context, &proposed, step)
    });
    Ok((verdicts.collect(), replayed))
}

/// One sequence's next token from its logits (`[1, vocab]`) and `history` (a repetition
/// penalty reads it), with the sampler's next draw.
pub(super) fn sample_alone<B: GemmaBackend>(
    sampler: &mut Sampler,
    logits: Tensor<B, 2>,
    history: &[u32],
) -> Result<i64, Error> {
    let draws = sampler.draws(1);
    Ok(first_sampled(sampler.sample_with_draws(logits, history, &draws)?)?)
}

/// Cuts `drafts` (one list per sequence) to `budget` tokens in all where they hold more, shared
/// out a token at a time: every sequence's first draft, then every second, and so on.
pub(super) fn share_drafts(drafts: &mut [Vec<u32>], budget: usize) {
    if drafts.iter().map(Vec::len).sum::<usize>() <= budget {
        return;
    }
    let mut keep = vec![0; drafts.len()];
    let mut left = budget;
    let longest = drafts.iter().map(Vec::len).max().unwrap_or(0);
    for round in 0..longest {
        for (k, d) in keep.iter_mut().zip(drafts.iter()) {
            if left > 0 && d.len() > round {
                *k += 1;
                left -= 1;
            }
        }
    }
    for (d, k) in drafts.iter_mut().zip(keep) {
        d.truncate(k);
    }
}
