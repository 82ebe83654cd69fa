//! The generator on a real (tiny) model: seeded determinism, reset, stop tokens, chat history,
//! context limits and non-finite logits.

use crate::common;

use burn::tensor::{backend::Backend, DType, Tensor};
use burn_gemma::{
    backends::NdArray, Checkpoint, Error, Gemma, GemmaBackend, GenerationConfig, Generator, ModelOptions, RequestError,
    SamplingConfig, StopReason,
};
use burn_gemma_model::{weights::WeightKind, ModelError, RandomWeights, WeightSource};

fn tiny_generator() -> Generator<NdArray> {
    let dir = common::fixtures().join("tiny-gemma/gemma3");
    let (model, _) = Checkpoint::open(&dir)
        .unwrap()
        .load(common::dense_f32::<NdArray>(&Default::default()))
        .map(burn_gemma::Loaded::into_parts)
        .unwrap();
    Generator::new(model, common::tiny_tokenizer()).unwrap()
}

fn sampled(seed: u64) -> GenerationConfig {
    GenerationConfig {
        max_new_tokens: 12,
        sampling: SamplingConfig { temperature: 0.9, top_k: Some(40), top_p: Some(0.95), seed, ..Default::default() },
        stop_tokens: vec![],
        ..Default::default()
    }
}

#[test]
fn same_seed_same_tokens_also_after_reset() {
    let mut g = tiny_generator();
    let a = g.generate("w300 w301 hello", &sampled(5), |_| {}).unwrap();
    let b = g.generate("w300 w301 hello", &sampled(5), |_| {}).unwrap();
    g.reset();
    let c = g.generate("w300 w301 hello", &sampled(5), |_| {}).unwrap();
    let d = g.generate("w300 w301 hello", &sampled(6), |_| {}).unwrap();
    assert_eq!(a.tokens, b.tokens);
    assert_eq!(a.tokens, c.tokens);
    assert_ne!(a.tokens, d.tokens, "different seeds should differ on a random model");
    assert_eq!(a.tokens.len(), 12);
}

#[test]
fn greedy_generation_matches_the_reference_continuation() {
    let reference = common::read_json(common::fixtures().join("tiny-gemma/gemma3/reference.json"));
    let prompt = common::ids(&reference["greedy_prompt_ids"]);
    let want = common::ids(&reference["greedy_ids"]);
    let mut g = tiny_generator();
    let config = GenerationConfig { max_new_tokens: want.len(), ..Default::default() };
    let out = g.continue_ids(&prompt, &config, |_| {}).unwrap();
    // The reference never hits a stop token in these 12 steps.
    assert_eq!(out.tokens, want);
    assert_eq!(out.stop, StopReason::MaxTokens);
    assert_eq!(out.stats.generated_tokens, want.len());
}

/// A prompt run in chunks (here of 1, 2 and 3 tokens, each attending to the cache the previous
/// ones filled) continues exactly as the whole prompt in one pass: HF's greedy continuation.
#[test]
fn prompt_in_chunks_continues_as_in_one_pass() {
    let reference = common::read_json(common::fixtures().join("tiny-gemma/gemma3/reference.json"));
    let prompt = common::ids(&reference["greedy_prompt_ids"]);
    let want = common::ids(&reference["greedy_ids"]);
    assert!(prompt.len() > 3, "the fixture's prompt has {} tokens", prompt.len());
    for chunk in [1, 2, 3] {
        let mut g = tiny_generator();
        let prefill_chunk = std::num::NonZeroUsize::new(chunk).unwrap();
        let config = GenerationConfig { max_new_tokens: want.len(), prefill_chunk, ..Default::default() };
        let out = g.continue_ids(&prompt, &config, |_| {}).unwrap();
        assert_eq!(out.tokens, want, "prompt of {} tokens in chunks of {chunk}", prompt.len());
        assert_eq!(out.stats.prompt_tokens, prompt.len());
    }
}

#[test]
fn stop_tokens_and_streamed_text() {
    let reference = common::read_json(common::fixtures().join("tiny-gemma/gemma3/reference.json"));
    let prompt = common::ids(&reference["greedy_prompt_ids"]);
    let want = common::ids(&reference["greedy_ids"]);
    let mut g = tiny_generator();
    let config = GenerationConfig { max_new_tokens: 12, stop_tokens: vec![want[3]], ..Default::default() };
    let mut streamed = String::new();
    let out = g.continue_ids(&prompt, &config, |t| streamed.push_str(t)).unwrap();
    let first_stop = want.iter().position(|&t| t == want[3]).unwrap();
    assert_eq!(out.tokens, want[..=first_stop]);
    assert_eq!(out.stop, StopReason::StopToken(want[3]));
    assert_eq!(streamed, out.text);
    assert_eq!(out.text, g.tokenizer().decode(&want[..first_stop]));
}

#[test]
fn chat_keeps_history_and_checks_context() {
    let mut g = tiny_generator();
    let config = GenerationConfig { max_new_tokens: 4, ..Default::default() };
    let first = g.chat("hello", &config, |_| {}).unwrap();
    let second = g.chat("again", &config, |_| {}).unwrap();
    // The second turn's prompt is only the new turn, the history stays in the cache.
    let turn = g
        .tokenizer()
        .encode("<end_of_turn>\n<start_of_turn>user\nagain<end_of_turn>\n<start_of_turn>model\n", burn_gemma::Bos::Omit)
        .unwrap();
    assert_eq!(second.stats.prompt_tokens, turn.len());
    assert!(first.stats.prompt_tokens > 1);
    // tiny model: 256 positions.
    let too_long = GenerationConfig { max_new_tokens: 300, ..Default::default() };
    let err = g.generate("hello", &too_long, |_| {}).unwrap_err().to_string();
    assert!(err.contains("300") && err.contains("256"), "{err}");
    assert!(matches!(g.generate("", &config, |_| {}), Err(Error::Request(RequestError::EmptyPrompt))));
    let zero = GenerationConfig { max_new_tokens: 0, ..Default::default() };
    assert!(matches!(g.generate("hi", &zero, |_| {}), Err(Error::Request(RequestError::NoNewTokens))));
}

/// Where [`PoisonedWeights`] puts a NaN.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Poison {
    Nowhere,
    /// The final norm: every step's logits.
    FinalNorm,
    /// One row of Gemma 4's per-layer token embedding: read only when its token is fed (the
    /// table is not the output projection), so the logits turn non-finite mid-decode, at the
    /// step after the model first produces that token.
    PerLayerRow(usize),
}

/// Random weights with a NaN where `poison` says.
struct PoisonedWeights {
    weights: RandomWeights,
    poison: Poison,
}

impl<B: Backend> WeightSource<B> for PoisonedWeights {
    fn load<const D: usize>(
        &mut self,
        name: &str,
        shape: [usize; D],
        kind: WeightKind,
        dtype: DType,
        device: &B::Device,
    ) -> Result<Tensor<B, D>, ModelError> {
        let t = WeightSource::<B>::load(&mut self.weights, name, shape, kind, dtype, device)?;
        Ok(if self.poison == Poison::FinalNorm && name == "model.norm.weight" { t.add_scalar(f32::NAN) } else { t })
    }

    fn load_row_chunks(
        &mut self,
        name: &str,
        shape: [usize; 2],
        rows: usize,
        dtype: DType,
        device: &B::Device,
    ) -> Result<Vec<Tensor<B, 2>>, ModelError> {
        let mut chunks = WeightSource::<B>::load_row_chunks(&mut self.weights, name, shape, rows, dtype, device)?;
        if let (Poison::PerLayerRow(row), "model.embed_tokens_per_layer.weight") = (self.poison, name) {
            let mut first = 0;
            for chunk in &mut chunks {
                let n = chunk.dims()[0];
                if (first..first + n).contains(&row) {
                    let nan = Tensor::<B, 2>::full([1, shape[1]], f32::NAN, (device, dtype));
                    *chunk = chunk.clone().slice_assign([row - first..row - first + 1, 0..shape[1]], nan);
                }
                first += n;
            }
        }
        Ok(chunks)
    }
}

/// The token iterator yields what `generate` returns, token by token; dropping it part way
/// leaves the generator usable (the next request starts from a reset context as usual).
#[test]
fn token_stream_yields_what_generate_returns() {
    let mut g = tiny_generator();
    let config = GenerationConfig { max_new_tokens: 12, stop_tokens: vec![], ..Default::default() };
    let whole = g.generate("hello", &config, |_| {}).unwrap();
    let mut stream = g.generate_stream("hello", &config).unwrap();
    let (mut ids, mut text) = (Vec::new(), String::new());
    for token in &mut stream {
        let token = token.unwrap();
        ids.push(token.id);
        text.push_str(&token.text);
    }
    let out = stream.finish();
    assert_eq!(out.tokens, whole.tokens);
    assert_eq!(out.text, whole.text);
    assert_eq!(out.stop, whole.stop);
    // Stop tokens end the stream without being yielded.
    let yielded = match whole.stop {
        StopReason::StopToken(_) => &whole.tokens[..whole.tokens.len() - 1],
        _ => &whole.tokens[..],
    };
    assert_eq!(ids, yielded);
    assert!(whole.text.starts_with(&text), "{text:?} vs {:?}", whole.text);

    let mut partial = g.generate_stream("hello", &config).unwrap();
    let first: Vec<u32> = partial.by_ref().take(3).map(|t| t.unwrap().id).collect();
    drop(partial);
    assert_eq!(first, whole.tokens[..3]);
    assert_eq!(g.generate("hello", &config, |_| {}).unwrap().tokens, whole.tokens);
    // A chat turn streamed after a dropped stream continues the conversation it left.
    let turn: Vec<u32> = g.chat_stream("hi", &config).unwrap().map(|t| t.unwrap().id).collect();
    assert!(!turn.is_empty());
}

#[test]
fn non_finite_logits_stop_with_the_step() {
    let dir = common::fixtures().join("tiny-gemma/gemma3");
    let config = Checkpoint::open(&dir).unwrap().config().clone();
    let model = Gemma::<NdArray>::load(
        config,
        &mut PoisonedWeights { weights: RandomWeights::new(1), poison: Poison::FinalNorm },
        &ModelOptions::dense(DType::F32),
        &Default::default(),
    )
    .unwrap();
    let mut g = Generator::new(model, common::tiny_tokenizer()).unwrap();
    let err = g.generate("hello", &GenerationConfig::default(), |_| {}).unwrap_err();
    assert!(matches!(err, Error::NonFiniteLogits { step: 0 }), "{err}");
}

/// A NaN injected into the model mid-decode ends generation with an error at that step.
fn nan_mid_decode<B: GemmaBackend>(device: B::Device) {
    let dir = common::fixtures().join("tiny-gemma/gemma4-e");
    let config = Checkpoint::open(&dir).unwrap().config().clone();
    let generator = |poison| {
        let mut source = PoisonedWeights { weights: RandomWeights::new(5), poison };
        let model = Gemma::<B>::load(config.clone(), &mut source, &ModelOptions::dense(DType::F32), &device).unwrap();
        Generator::new(model, common::tiny_tokenizer()).unwrap()
    };
    let greedy = GenerationConfig { max_new_tokens: 12, stop_tokens: vec![], ..Default::default() };
    let clean = generator(Poison::Nowhere).generate("hello", &greedy, |_| {}).unwrap().tokens;
    let prompt = common::tiny_tokenizer().encode("hello", burn_gemma::Bos::Prepend).unwrap();
    // The first token produced at step 2 or later that was neither in the prompt nor produced
    // before: feeding it is the first read of its row.
    let step = (2..clean.len())
        .find(|&k| !prompt.contains(&clean[k]) && !clean[..k].contains(&clean[k]))
        .expect("a fresh token among the greedy steps");
    let mut poisoned = generator(Poison::PerLayerRow(clean[step] as usize));
    let mut streamed = 0;
    let err = poisoned.generate("hello", &greedy, |_| streamed += 1).unwrap_err();
    println!("NaN row of token {} (step {step}): {err}; {streamed} pieces streamed before", clean[step]);
    assert!(matches!(err, Error::NonFiniteLogits { step: s } if s == step + 1), "{err}");
}

#[test]
fn nan_mid_decode_ends_generation_at_its_step() {
    nan_mid_decode::<NdArray>(Default::default());
}

#[cfg(feature = "wgpu")]
#[test]
fn nan_mid_decode_ends_generation_at_its_step_on_wgpu() {
    nan_mid_decode::<burn_gemma::backends::Wgpu>(Default::default());
}

#[cfg(feature = "cuda")]
#[test]
fn nan_mid_decode_ends_generation_at_its_step_on_cuda() {
    nan_mid_decode::<burn_gemma::backends::Cuda>(Default::default());
}

/// `--cuda-graph on` is an error where graphs cannot work (here: not CUDA), not a silent
/// fallback; `auto` quietly decodes eagerly there, with the same tokens as `off`.
#[test]
fn cuda_graph_modes_without_cuda() {
    use burn_gemma::CudaGraph;
    let mut g = tiny_generator();
    let config = |cuda_graph| GenerationConfig { max_new_tokens: 6, cuda_graph, ..sampled(3) };
    let mut streamed = String::new();
    let err = g.generate("w300 w301 hello", &config(CudaGraph::On), |t| streamed.push_str(t)).unwrap_err();
    assert!(err.to_string().contains("CUDA"), "{err}");
    assert!(streamed.is_empty(), "`on` failed after generating {streamed:?}");
    let auto = g.generate("w300 w301 hello", &config(CudaGraph::Auto), |_| {}).unwrap();
    let off = g.generate("w300 w301 hello", &config(CudaGraph::Off), |_| {}).unwrap();
    assert_eq!(auto.tokens, off.tokens);
    assert_eq!(auto.stats.graph_steps, 0);
    // A repetition penalty runs eagerly: `on` refuses it up front, whatever the backend.
    let mut penalized = config(CudaGraph::On);
    penalized.sampling.repeat_penalty = 1.3;
    let err = g.generate("w300 w301 hello", &penalized, |_| {}).unwrap_err();
    assert!(err.to_string().contains("repetition penalty"), "{err}");
}

/// On CUDA, generation with the decode graph gives the tokens of eager generation, greedy and
/// sampled with a seed, over several turns of a chat (the cache is reset and reused).
#[cfg(feature = "cuda")]
#[test]
fn cuda_graph_generation_equals_eager() {
    use burn_gemma::{backends::Cuda, CudaGraph};
    let dir = common::fixtures().join("tiny-gemma/gemma3");
    let device = burn::backend::cuda::CudaDevice::new(0);
    let generator = || {
        let (model, _) = Checkpoint::open(&dir)
            .unwrap()
            .load(common::dense_f32::<Cuda>(&device))
            .map(burn_gemma::Loaded::into_parts)
            .unwrap();
        Generator::new(model, common::tiny_tokenizer()).unwrap()
    };
    let (mut on, mut off) = (generator(), generator());
    for (turn, base) in [GenerationConfig { max_new_tokens: 40, ..Default::default() }, sampled(11), sampled(12)]
        .into_iter()
        .enumerate()
    {
        let run = |g: &mut Generator<Cuda>, cuda_graph| {
            let config = GenerationConfig { cuda_graph, ..base.clone() };
            g.chat(&format!("w30{turn} w40{turn} hello"), &config, |_| {}).unwrap()
        };
        let (a, b) = (run(&mut on, CudaGraph::On), run(&mut off, CudaGraph::Off));
        assert_eq!(a.tokens, b.tokens, "turn {turn}");
        assert!(a.stats.graph_steps + 1 >= a.tokens.len(), "turn {turn}: {} graph steps", a.stats.graph_steps);
        println!("turn {turn}: {} tokens equal; {}", a.tokens.len(), a.stats);
    }
}

/// A chat's second turn continues exactly as the whole conversation (first turn, its reply and
/// the second turn) run from an empty context: the cache holds every token of the context,
/// the reply's last token included, at its position.
#[test]
fn chat_turns_continue_as_the_whole_conversation() {
    let config = GenerationConfig { max_new_tokens: 5, ..Default::default() };
    let mut g = tiny_generator();
    g.chat("hello", &config, |_| {}).unwrap();
    let second = g.chat("again", &config, |_| {}).unwrap();
    let turns = g.context()[..g.context().len() - second.tokens.len()].to_vec();
    let mut fresh = tiny_generator();
    let whole = fresh.continue_ids(&turns, &config, |_| {}).unwrap();
    assert_eq!(second.tokens, whole.tokens);
}
