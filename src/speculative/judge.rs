//! The verify step's verdict on one sequence's drafts: how many the model keeps and its own
//! token after them, from the logits of the rows that scored them (the generator's and the
//! batched engine's verify steps alike).

use super::{
    accept::{keeps, pick, residual},
    Drafts,
};
use crate::{
    sampling::Sampler,
    sampling::{checked_token, first_sampled, sampled_ids},
    Error, GemmaBackend,
};
use burn::tensor::Tensor;

/// How many of `drafts` the model keeps, and its own token after them, from `logits`
/// (`[1 + drafts, vocab]`: row `i` predicts what follows draft `i`, row 0 what follows the
/// token fed before the drafts). `context` is what the model has seen up to that token (a
/// repetition penalty reads it, and each draft row's history adds the drafts before it);
/// `step` numbers the first token this verdict gives (for errors).
///
/// Greedy: the drafts equal to the model's choices, then its choice. Sampled: the rejection
/// rule of [`super::accept`], which keeps the model's distribution.
pub(crate) fn judge<B: GemmaBackend>(
    sampler: &mut Sampler,
    logits: Tensor<B, 2>,
    context: &[u32],
    drafts: &Drafts,
    step: usize,
) -> Result<(usize, u32), Error> {
    let [rows, vocab] = logits.dims();
    let row = |i: usize| logits.clone().slice([i..i + 1, 0..vocab]);
    let history = |i: usize| -> Vec<u32> { context.iter().chain(&drafts.tokens[..i]).copied().collect() };
    if sampler.is_greedy() {
        // The model's choice after each draft, as a step without drafts would make it.
        let choices = if sampler.penalizes() {
            (0..rows)
                .map(|i| first_sampled(sampler.sample_with_draws(row(i), &history(i), &[0.0])?).map_err(Error::from))
                .collect::<Result<Vec<_>, Error>>()?
        } else {
            sampled_ids(sampler.sample_with_draws(logits.clone(), &[], &vec![0.0; rows])?)?
        };
        return greedy_verdict(&drafts.tokens, &choices, vocab, step);
    }
    for (i, (&token, proposal)) in drafts.tokens.iter().zip(&drafts.proposals).enumerate() {
        let target = sampler.host_distribution(row(i), &history(i))?;
        if target.is_empty() {
            return Err(Error::NonFiniteLogits { step: step + i });
        }
        if !keeps(&target, token, proposal, sampler.uniform()) {
            let rest = residual(&target, token, proposal);
            let next = pick(&rest, sampler.uniform()).ok_or(Error::NonFiniteLogits { step: step + i })?;
            return Ok((i, next));
        }
    }
    let kept = drafts.tokens.len();
    let target = sampler.host_distribution(row(kept), &history(kept))?;
    let next = pick(&target, sampler.uniform()).ok_or(Error::NonFiniteLogits { step: step + kept })?;
    Ok((kept, next))
}

/// The greedy verdict from the model's choice after each row (`choices[i]` after draft `i`,
/// one more than the drafts): the drafts equal to its choices are kept, then its choice.
pub(crate) fn greedy_verdict(
    drafts: &[u32],
    choices: &[i64],
    vocab: usize,
    step: usize,
) -> Result<(usize, u32), Error> {
    let kept = drafts.iter().zip(choices).take_while(|(&d, &c)| i64::from(d) == c).count();
    let next = choices.get(kept).copied().unwrap_or(-1);
    Ok((kept, checked_token(next, vocab, step + kept)?))
}
