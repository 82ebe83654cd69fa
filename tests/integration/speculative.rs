//! Speculative decoding on tiny random models: greedy output with any drafter is the output
//! without, token for token; sampled output keeps the model's distribution; the KV cache takes
//! back rejected drafts across a sliding window's wrap.

use crate::common;

use burn::tensor::{backend::Backend, DType, ElementConversion, Int, Tensor, TensorData};
use burn_gemma::{
    backends::NdArray,
    sampling::Sampler,
    speculative::{DraftLength, DraftModel, Drafter, Misses, PromptLookup, Speculation, SpeculationStats},
    Checkpoint, Error, Gemma, GenerationConfig, GenerationOutput, Generator, ModelOptions, RequestError,
    SamplingConfig, WindowStore,
};
use burn_gemma_model::{weights::WeightKind, ModelError, RandomWeights, WeightSource};
use std::num::NonZeroUsize;

type B = NdArray;

fn model(name: &str) -> Gemma<B> {
    model_on::<B>(name, &Default::default())
}

/// The fixture `name` on backend `Bk`, dense f32.
fn model_on<Bk: burn_gemma::GemmaBackend>(name: &str, device: &Bk::Device) -> Gemma<Bk> {
    Checkpoint::open(common::fixtures().join(name))
        .unwrap()
        .load(common::dense_f32::<Bk>(device))
        .map(burn_gemma::Loaded::into_parts)
        .unwrap()
        .0
}

fn generator(name: &str) -> Generator<B> {
    Generator::new(model(name), common::tiny_tokenizer()).unwrap()
}

fn ids(tokens: &[u32]) -> Tensor<B, 2, Int> {
    let data: Vec<i64> = tokens.iter().map(|&t| i64::from(t)).collect();
    Tensor::from_data(TensorData::new(data, [1, tokens.len()]), &Default::default())
}

/// A prompt that repeats itself, so that prompt lookup finds matches from the start.
fn prompt() -> Vec<u32> {
    let phrase: Vec<u32> = (300..312).collect();
    [vec![2], phrase.clone(), vec![400, 401], phrase].concat()
}

fn greedy(max_new_tokens: usize) -> GenerationConfig {
    GenerationConfig { max_new_tokens, ..Default::default() }
}

fn k(n: usize) -> NonZeroUsize {
    NonZeroUsize::new(n).unwrap()
}

fn run(name: &str, speculation: Option<Speculation<B>>, config: &GenerationConfig) -> GenerationOutput {
    let mut g = generator(name);
    g.set_speculation(speculation).unwrap();
    g.continue_ids(&prompt(), config, |_| {}).unwrap()
}

fn stats(out: &GenerationOutput) -> SpeculationStats {
    out.stats.speculation.expect("speculation stats")
}

/// Prompt lookup on every tiny architecture with a sliding window (8 positions: 100 tokens
/// wrap it a dozen times, and a refused draft is rewound in the ring): the same tokens as
/// without drafts, with drafts both kept and refused along the way.
#[test]
fn prompt_lookup_keeps_greedy_output() {
    let config = greedy(100);
    for name in ["tiny-gemma/gemma3", "tiny-gemma/gemma2", "tiny-gemma/gemma4-e", "tiny-gemma/gemma4-dense"] {
        let plain = run(name, None, &config);
        assert!(plain.tokens.len() > 24, "{name}: only {} tokens, the window never wraps", plain.tokens.len());
        for length in [DraftLength::Fixed(k(4)), DraftLength::Adaptive { max: k(7) }] {
            // Suffixes down to one token: drafts on the less repetitive models too.
            let lookup = Speculation::new(Drafter::PromptLookup(PromptLookup { max_ngram: 3, min_ngram: 1 }), length)
                .with_misses(Misses::KeepDrafting);
            let out = run(name, Some(lookup), &config);
            assert_eq!(out.tokens, plain.tokens, "{name}, {length:?}");
            assert_eq!(out.text, plain.text, "{name}");
            let s = stats(&out);
            assert!(s.accepted > 0 && s.accepted < s.drafted, "{name}, {length:?}: {s:?}");
            // Every kept draft saved a model step.
            assert_eq!(s.target_steps + s.accepted, out.tokens.len() - 1, "{name}: {s:?}");
        }
    }
}

/// A drafter taken back from a generator stops drafting there and drafts as before in another
/// (what a caller lending one draft model to several generators does); generations start afresh
/// after a reset.
#[test]
fn a_drafter_taken_back_drafts_elsewhere() {
    let config = greedy(40);
    let name = "tiny-gemma/gemma3";
    let plain = run(name, None, &config);
    let mut first = generator(name);
    assert!(first.take_speculation().is_none());
    first.set_speculation(Some(Speculation::prompt_lookup(k(4)).with_misses(Misses::KeepDrafting))).unwrap();
    let drafted = first.continue_ids(&prompt(), &config, |_| {}).unwrap();
    assert_eq!(drafted.tokens, plain.tokens);
    assert!(stats(&drafted).drafted > 0);
    let lent = first.take_speculation().expect("the drafter");
    first.reset();
    let undrafted = first.continue_ids(&prompt(), &config, |_| {}).unwrap();
    assert!(undrafted.stats.speculation.is_none(), "drafting went on after the drafter was taken");
    assert_eq!(undrafted.tokens, plain.tokens);
    let mut second = generator(name);
    second.set_speculation(Some(lent)).unwrap();
    let again = second.continue_ids(&prompt(), &config, |_| {}).unwrap();
    assert_eq!(again.tokens, plain.tokens);
    assert_eq!(stats(&again).drafted, stats(&drafted).drafted, "the lent drafter drafts as it did");
}

/// A draft model: the target itself (every draft kept: the upper bound) and another random
/// model of the same vocabulary (most refused): greedy output as without drafts.
#[test]
fn draft_models_keep_greedy_output() {
    let config = greedy(60);
    for name in ["tiny-gemma/gemma3", "tiny-gemma/gemma4-e"] {
        let plain = run(name, None, &config);
        let other = name.replace("tiny-gemma/", "tiny-gemma-seed8/");
        for (draft, all_kept) in [(name.to_string(), true), (other, false)] {
            let drafter = Drafter::Model(Box::new(DraftModel::new(model(&draft))));
            let speculation = Speculation::new(drafter, DraftLength::Fixed(k(5))).with_misses(Misses::KeepDrafting);
            let out = run(name, Some(speculation), &config);
            assert_eq!(out.tokens, plain.tokens, "{name} drafted by {draft}");
            let s = stats(&out);
            assert!(s.verify_steps > 0, "{name} drafted by {draft}: {s:?}");
            if all_kept {
                assert_eq!(s.accepted, s.drafted, "{name} drafting for itself: {s:?}");
            } else {
                assert!(s.accepted < s.drafted, "{name} drafted by {draft}: {s:?}");
            }
        }
    }
}

/// With a repetition penalty each draft is judged with the history before it.
#[test]
fn penalized_greedy_output_is_kept() {
    let config = GenerationConfig {
        max_new_tokens: 50,
        sampling: SamplingConfig { repeat_penalty: 1.3, repeat_last_n: 16, ..Default::default() },
        ..Default::default()
    };
    let name = "tiny-gemma/gemma3";
    let plain = run(name, None, &config);
    let lookup =
        Speculation::new(Drafter::PromptLookup(PromptLookup { max_ngram: 3, min_ngram: 1 }), DraftLength::Fixed(k(3)));
    let out = run(name, Some(lookup), &config);
    assert_eq!(out.tokens, plain.tokens);
    assert!(stats(&out).verify_steps > 0);
}

/// A chat with drafts: later turns continue from what the cache kept, the same as without.
#[test]
fn chat_turns_with_drafts_match_without() {
    let config = greedy(20);
    let mut plain = generator("tiny-gemma/gemma3");
    let mut drafted = generator("tiny-gemma/gemma3");
    drafted.set_speculation(Some(Speculation::prompt_lookup(k(4)))).unwrap();
    for message in ["w300 w301 w302 w300 w301", "again w300 w301", "w302"] {
        let a = plain.chat(message, &config, |_| {}).unwrap();
        let b = drafted.chat(message, &config, |_| {}).unwrap();
        assert_eq!(a.tokens, b.tokens, "{message}");
    }
    assert_eq!(plain.context(), drafted.context());
}

/// The cache taken back past drafts a verify step wrote, where they straddle the ring of an
/// 8-position window (positions 14..20 overwrite slots 6, 7, 0, 1, 2, 3, which held positions
/// the next queries still see): the logits that follow are those of a cache that never saw them.
#[test]
fn rewind_across_a_window_wrap() {
    let model = model("tiny-gemma/gemma3");
    let prefix: Vec<u32> = (0..14).map(|i| 300 + (i * 7) % 50).collect();
    let drafts: Vec<u32> = vec![401, 402, 403, 404, 405, 406];
    let next: Vec<u32> = vec![450, 451, 452, 453, 454, 455, 456, 457, 458, 459];
    for kept in 0..=drafts.len() {
        let mut rewound = model.new_cache(1, 64).unwrap();
        model.forward(ids(&prefix), &mut rewound).unwrap();
        let checkpoint = rewound.checkpoint(drafts.len()).unwrap();
        model.forward(ids(&drafts), &mut rewound).unwrap();
        rewound.rewind(&checkpoint, prefix.len() + kept).unwrap();
        let got = model.forward(ids(&next), &mut rewound).unwrap();

        let mut clean = model.new_cache(1, 64).unwrap();
        model.forward(ids(&prefix), &mut clean).unwrap();
        if kept > 0 {
            model.forward(ids(&drafts[..kept]), &mut clean).unwrap();
        }
        let want = model.forward(ids(&next), &mut clean).unwrap();
        let diff = (got - want).abs().max().into_scalar();
        // f32 on the same kernels: what is left is the drafts' chunk length changing sums.
        assert!(diff < 1e-4, "{kept} drafts kept: logits differ by {diff}");
    }
    // A rewind outside the checkpoint's span is refused and changes nothing.
    let mut cache = model.new_cache(1, 64).unwrap();
    model.forward(ids(&prefix), &mut cache).unwrap();
    let checkpoint = cache.checkpoint(3).unwrap();
    model.forward(ids(&drafts[..2]), &mut cache).unwrap();
    assert!(cache.rewind(&checkpoint, prefix.len() - 1).is_err());
    assert_eq!(cache.len(), prefix.len() + 2);
    // More positions ahead than the window holds cannot be taken back.
    assert!(cache.checkpoint(9).is_err());
}

/// Weights between two random models: `(1 - mix) * a + mix * b`, tensor by tensor. A draft
/// model blended a little away from its target proposes the target's likely tokens with other
/// probabilities: its drafts are kept and refused alike, so both halves of the rule show.
struct Blend {
    a: RandomWeights,
    b: RandomWeights,
    mix: f32,
}

impl<Bk: Backend> WeightSource<Bk> for Blend {
    fn load<const D: usize>(
        &mut self,
        name: &str,
        shape: [usize; D],
        kind: WeightKind,
        dtype: DType,
        device: &Bk::Device,
    ) -> Result<Tensor<Bk, D>, ModelError> {
        let a = WeightSource::<Bk>::load(&mut self.a, name, shape, kind, dtype, device)?;
        let b = WeightSource::<Bk>::load(&mut self.b, name, shape, kind, dtype, device)?;
        Ok(a.mul_scalar(1.0 - self.mix) + b.mul_scalar(self.mix))
    }

    fn load_row_chunks(
        &mut self,
        name: &str,
        shape: [usize; 2],
        rows: usize,
        dtype: DType,
        device: &Bk::Device,
    ) -> Result<Vec<Tensor<Bk, 2>>, ModelError> {
        let a = WeightSource::<Bk>::load_row_chunks(&mut self.a, name, shape, rows, dtype, device)?;
        let b = WeightSource::<Bk>::load_row_chunks(&mut self.b, name, shape, rows, dtype, device)?;
        Ok(a.into_iter().zip(b).map(|(a, b)| a.mul_scalar(1.0 - self.mix) + b.mul_scalar(self.mix)).collect())
    }
}

/// Sampled decoding with a draft model near the target: the second token (the first a verify
/// step makes: a kept draft or a redraw from the residual) follows the target's own
/// distribution given the first. Chi-square over many seeds, against the target's
/// probabilities (computed apart, by a forward pass and the sampler's filters).
#[test]
fn sampled_output_keeps_the_model_distribution() {
    sampled_distribution::<B>(&Default::default());
}

/// The same on CUDA, where the verify step and the draft model's steps replay recorded graphs
/// and their logits are read back for the rule (f32).
#[cfg(feature = "cuda")]
#[test]
fn sampled_output_keeps_the_model_distribution_on_cuda() {
    sampled_distribution::<burn_gemma::backends::Cuda>(&burn::backend::cuda::CudaDevice::new(0));
}

fn sampled_distribution<Bk: burn_gemma::GemmaBackend>(device: &Bk::Device) {
    let sampling = |seed| SamplingConfig { temperature: 1.0, top_k: Some(5), seed, ..Default::default() };
    let config = |seed| GenerationConfig { max_new_tokens: 3, sampling: sampling(seed), ..Default::default() };
    let shape = model("tiny-gemma/gemma3").config().clone();
    let options = ModelOptions { dtype: DType::F32, ..ModelOptions::default() };
    let target = || Gemma::<Bk>::random(shape.clone(), 1, &options, device).unwrap();
    // 5% of another model: about 70% of drafts kept. (Redrawing refused drafts from the
    // target instead of the residual gives a chi-square near 110 here.)
    let blend = Blend { a: RandomWeights::new(1), b: RandomWeights::new(2), mix: 0.05 };
    let draft = Gemma::<Bk>::load(shape.clone(), &mut { blend }, &options, device).unwrap();
    let mut g = Generator::new(target(), common::tiny_tokenizer()).unwrap();
    g.set_speculation(Some(Speculation::new(
        Drafter::Model(Box::new(DraftModel::new(draft))),
        DraftLength::Fixed(k(3)),
    )))
    .unwrap();
    let prompt = prompt();
    let fresh: u64 = rand::random();
    eprintln!("fresh seed base: {fresh}");
    for base in [1_000_000u64, fresh] {
        let runs = 2000;
        let mut accepted = SpeculationStats::default();
        let outputs: Vec<Vec<u32>> = (0..runs)
            .map(|i| {
                g.reset();
                let out = g.continue_ids(&prompt, &config(base.wrapping_add(i)), |_| {}).unwrap();
                let s = stats(&out);
                accepted.drafted += s.drafted;
                accepted.accepted += s.accepted;
                out.tokens
            })
            .collect();
        // Both halves of the rule ran: drafts kept and drafts refused.
        assert!(accepted.accepted > 0 && accepted.accepted < accepted.drafted, "base {base}: {accepted:?}");
        // The commonest first token; the second's frequencies given it.
        let mut first = std::collections::BTreeMap::<u32, usize>::new();
        for out in &outputs {
            *first.entry(out[0]).or_default() += 1;
        }
        let (&t1, _) = first.iter().max_by_key(|e| e.1).unwrap();
        let seconds: Vec<u32> = outputs.iter().filter(|o| o[0] == t1 && o.len() >= 2).map(|o| o[1]).collect();
        let target = target();
        let mut cache = target.new_cache(1, 64).unwrap();
        let context: Vec<u32> = prompt.iter().copied().chain([t1]).collect();
        let logits = target.forward(burn_gemma::generation::token_tensor::<Bk>(&context, device), &mut cache).unwrap();
        let vocab = logits.dims()[2];
        let row: Vec<f32> =
            logits.slice([0..1, context.len() - 1..context.len(), 0..vocab]).into_data().to_vec().unwrap();
        let p = Sampler::new(sampling(0)).unwrap().distribution(&row);
        assert_eq!(p.len(), 5);
        let n = seconds.len();
        assert!(n > 300, "base {base}: only {n} runs began with {t1}");
        let chi2: f64 = p
            .iter()
            .map(|&(token, prob)| {
                let observed = seconds.iter().filter(|&&t| t == token).count() as f64;
                let expected = f64::from(prob) * n as f64;
                (observed - expected).powi(2) / expected
            })
            .sum();
        let outside = seconds.iter().filter(|t| !p.iter().any(|c| c.0 == **t)).count();
        assert_eq!(outside, 0, "base {base}: tokens outside the model's top 5");
        // The 0.999 quantile of chi-square with 4 degrees of freedom.
        assert!(chi2 < 18.467, "base {base}: chi-square {chi2:.2} over {n} runs, distribution {p:?}, {accepted:?}");
        eprintln!("base {base}: chi-square {chi2:.2} over {n} runs, {accepted:?}");
    }
}

#[test]
fn a_draft_model_of_another_vocabulary_is_refused() {
    let mut g = generator("tiny-gemma/gemma3");
    let mut config = g.model().config().clone();
    config.vocab_size = 600;
    let other = Gemma::<B>::random(config, 3, &ModelOptions::default(), &Default::default()).unwrap();
    let drafter = Drafter::Model(Box::new(DraftModel::new(other)));
    let err = g.set_speculation(Some(Speculation::new(drafter, DraftLength::Fixed(k(2))))).unwrap_err();
    assert!(matches!(err, Error::Request(RequestError::DraftVocabulary { target: 512, draft: 600 })), "{err}");
}

/// The verify step's rows ([`Gemma::forward_each`]) equal one-token steps, on chunks
/// straddling the 8-position window's wrap, for models with and without KV sharing: within
/// f32 rounding here, where the dense products of 7 rows and of 1 sum in different orders (bit
/// for bit with block weights on the CPU: `real_model.rs`).
#[test]
fn verify_rows_equal_one_token_steps() {
    verify_rows::<B>();
    verify_rows::<burn_gemma::backends::Candle>();
}

fn verify_rows<Bk: burn_gemma::GemmaBackend>() {
    let device = Default::default();
    for name in ["tiny-gemma/gemma3", "tiny-gemma/gemma4-e", "tiny-gemma/gemma2"] {
        let model = model_on::<Bk>(name, &device);
        let ids = |t: &[u32]| burn_gemma::generation::token_tensor::<Bk>(t, &device);
        let tokens: Vec<u32> = (0..40u32).map(|i| 300 + (i * 37) % 200).collect();
        for start in [2usize, 5, 6, 13, 20] {
            let (prefix, chunk) = (&tokens[..start], &tokens[start..start + 7]);
            let mut together = model.new_cache(1, 64).unwrap();
            let mut steps = model.new_cache(1, 64).unwrap();
            model.forward(ids(prefix), &mut together).unwrap();
            model.forward(ids(prefix), &mut steps).unwrap();
            let rows = model.forward_each(ids(chunk), &mut together).unwrap();
            for (i, &t) in chunk.iter().enumerate() {
                let one = model.forward(ids(&[t]), &mut steps).unwrap();
                let vocab = one.dims()[2];
                let diff: f32 = (rows.clone().slice([0..1, i..i + 1, 0..vocab]) - one).abs().max().into_scalar().elem();
                assert!(diff < 1e-4, "{name}: position {} after a prefix of {start}: {diff}", start + i);
            }
        }
    }
}

/// The verify step as one decode step of consecutive rows (what a recorded verify step runs on
/// CUDA) in a cache that keeps every position of its sliding windows: each row's logits are the
/// eager verify step's (each row on its own, in a ring cache), before and past the 8-position
/// window's wrap; taking rows back only moves the length, and the next tokens' logits are
/// those of a cache that never held the rejected rows. The bound is f32 rounding, as in
/// `verify_rows_equal_one_token_steps` (products of 5 rows and of 1 sum in other orders).
#[test]
fn consecutive_rows_equal_the_verify_step() {
    consecutive_rows::<B>();
    consecutive_rows::<burn_gemma::backends::Candle>();
}

fn consecutive_rows<Bk: burn_gemma::GemmaBackend>() {
    let device = Default::default();
    let close = |got: Tensor<Bk, 2>, want: Tensor<Bk, 2>, what: &str| {
        let got = got.cast(DType::F32);
        assert!(got.clone().is_finite().all().into_scalar().elem::<bool>(), "{what}: non-finite logits");
        let diff: f32 = (got - want).abs().max().into_scalar().elem();
        assert!(diff < 1e-4, "{what}: logits differ by {diff}");
    };
    for name in ["tiny-gemma/gemma3", "tiny-gemma/gemma4-e", "tiny-gemma/gemma2"] {
        let model = model_on::<Bk>(name, &device);
        let ids = |t: &[u32]| burn_gemma::generation::token_tensor::<Bk>(t, &device);
        let tokens: Vec<u32> = (0..40u32).map(|i| 300 + (i * 37) % 200).collect();
        let next = [450u32, 451, 452, 453];
        for start in [2usize, 6, 13, 20] {
            let (prefix, chunk) = (&tokens[..start], &tokens[start..start + 5]);
            for kept in [0, 2, 5] {
                let what = format!("{name}: 5 rows after {start}, {kept} kept");
                let mut ring = model.new_cache(1, 64).unwrap();
                model.forward(ids(prefix), &mut ring).unwrap();
                // A ring the rows would wrap refuses them.
                assert!(model.decode_consecutive(chunk, &mut ring).is_err(), "{what}: a ring took consecutive rows");
                assert_eq!(ring.len(), start, "{what}: a refused step moved the cache");
                let want = model.forward_each(ids(chunk), &mut ring).unwrap();
                let vocab = want.dims()[2];
                let mut every = model.new_cache_with(1, 64, WindowStore::EveryPosition).unwrap();
                model.forward(ids(prefix), &mut every).unwrap();
                let checkpoint = every.checkpoint(chunk.len()).unwrap();
                let got = model.decode_consecutive(chunk, &mut every).unwrap();
                assert_eq!(every.len(), start + chunk.len(), "{what}");
                close(got, want.reshape([chunk.len(), vocab]), &format!("{what}: verify rows"));
                every.rewind(&checkpoint, start + kept).unwrap();
                let got = model.forward(ids(&next), &mut every).unwrap().reshape([next.len(), vocab]);
                let mut clean = model.new_cache(1, 64).unwrap();
                model.forward(ids(&tokens[..start + kept]), &mut clean).unwrap();
                let want = model.forward(ids(&next), &mut clean).unwrap().reshape([next.len(), vocab]);
                close(got, want, &format!("{what}: the tokens after the rewind"));
            }
        }
    }
}

/// A stream dropped while a verify step's kept drafts are still queued (they are in the cache,
/// not in the context): the next request takes the cache back to the context first, and
/// continues as it does without drafts.
#[test]
fn a_stream_dropped_among_kept_drafts_leaves_the_cache_at_the_context() {
    let name = "tiny-gemma/gemma3";
    // The model drafting for itself: every draft kept, five queued after each verify step.
    let itself = || Speculation::new(Drafter::Model(Box::new(DraftModel::new(model(name)))), DraftLength::Fixed(k(5)));
    let config = greedy(100);
    let more = [300u32, 301, 302];
    for taken in [7usize, 9, 14, 20, 33] {
        let (mut plain, mut drafted) = (generator(name), generator(name));
        drafted.set_speculation(Some(itself())).unwrap();
        let a: Vec<u32> = plain.stream_ids(&prompt(), &config).unwrap().take(taken).map(|t| t.unwrap().id).collect();
        let b: Vec<u32> = drafted.stream_ids(&prompt(), &config).unwrap().take(taken).map(|t| t.unwrap().id).collect();
        assert_eq!(a, b, "the first {taken} tokens");
        let a = plain.continue_ids(&more, &greedy(30), |_| {}).unwrap();
        let b = drafted.continue_ids(&more, &greedy(30), |_| {}).unwrap();
        assert_eq!(a.tokens, b.tokens, "the request after a stream dropped at {taken} tokens");
        assert_eq!(plain.context(), drafted.context());
    }
}

/// A random Gemma 3 1B-shaped model on CUDA: prompt lookup and a draft model (the target
/// itself: every draft kept) give the tokens of greedy decoding without drafts, over a
/// 530-token prompt whose 512-position windows wrap while drafts are kept and refused. f32, so
/// that the verify step (prompt kernels over k + 1 positions) and the one-token decode step,
/// which sum in different orders, cannot flip a greedy choice between two random logits (their
/// difference is f32 rounding, orders of magnitude under the gaps between the top logits).
#[cfg(feature = "cuda")]
#[test]
fn random_1b_drafts_keep_greedy_output_on_cuda() {
    use burn_gemma::{backends::Cuda, GemmaConfig, WeightFormat};
    let device = burn::backend::cuda::CudaDevice::new(0);
    let shape = GemmaConfig::preset("gemma3-1b").expect("preset");
    let options = ModelOptions { dtype: DType::F32, weights: WeightFormat::Dense, kv_cache: None };
    let load = || Gemma::<Cuda>::load(shape.clone(), &mut RandomWeights::new(5), &options, &device).expect("random 1B");
    // Every id of the model's vocabulary as a token of its own (the text is not the subject).
    let vocab = shape.vocab_size;
    let tokenizer = || {
        let mut tokens: Vec<String> = ["<pad>", "<eos>", "<bos>", "<unk>"].map(String::from).to_vec();
        tokens.extend((4..vocab).map(|i| format!("w{i}")));
        let types = (0..vocab).map(|i| if i < 4 { 3 } else { 1 }).collect();
        burn_gemma::Tokenizer::from_vocab(tokens, (0..vocab).map(|i| -(i as f32)).collect(), types, 2)
            .expect("a vocabulary of the model's size")
    };
    // A 40-token phrase, repeated through the prompt and ending it: lookup drafts from the start.
    let phrase: Vec<u32> = (0..40u32).map(|i| 1000 + (i * 7919) % 200_000).collect();
    let prompt: Vec<u32> = std::iter::once(2).chain(phrase.iter().copied().cycle().take(529)).collect();
    let config = greedy(48);
    let run = |speculation: Option<Speculation<Cuda>>| {
        let mut g = Generator::new(load(), tokenizer()).expect("generator");
        g.set_speculation(speculation).expect("speculation");
        g.continue_ids(&prompt, &config, |_| {}).expect("generation")
    };
    let plain = run(None);
    assert_eq!(plain.tokens.len(), 48, "greedy without drafts stopped early");
    let lookup =
        Speculation::new(Drafter::PromptLookup(PromptLookup { max_ngram: 3, min_ngram: 1 }), DraftLength::Fixed(k(4)))
            .with_misses(Misses::KeepDrafting);
    let itself = Speculation::new(Drafter::Model(Box::new(DraftModel::new(load()))), DraftLength::Fixed(k(5)))
        .with_misses(Misses::KeepDrafting);
    // Adaptive lengths: one recorded verify step of 1 + max rows serves every length.
    let adaptive = Speculation::new(
        Drafter::PromptLookup(PromptLookup { max_ngram: 3, min_ngram: 1 }),
        DraftLength::Adaptive { max: k(6) },
    )
    .with_misses(Misses::KeepDrafting);
    let runs =
        [("prompt lookup", lookup), ("prompt lookup, adaptive", adaptive), ("the target as its draft model", itself)];
    for (what, speculation) in runs {
        let out = run(Some(speculation));
        assert_eq!(out.tokens, plain.tokens, "random 1B with {what}");
        let s = stats(&out);
        println!("random 1B with {what}: {s:?}");
        assert!(s.drafted > 0 && s.verify_steps > 0, "random 1B with {what}: {s:?}");
        assert_eq!(s.target_steps + s.accepted, out.tokens.len() - 1, "random 1B with {what}: {s:?}");
        if what.starts_with("the target") {
            assert_eq!(s.accepted, s.drafted, "the target drafting for itself: {s:?}");
        }
    }
}
