//! Gemma 4 assistants (multi-token prediction drafters) against HF transformers 5.23: the draft
//! logits of drafting rounds on tiny random targets (tests/fixtures/tiny-gemma-assistant, made
//! by scripts/make_assistant_fixtures.py), greedy output with the assistant drafting equal to
//! greedy output without, checks of what fits, and llama.cpp's GGUF of an assistant.

use crate::common;

use burn::tensor::{DType, Tensor};
use burn_gemma::{
    backends::NdArray,
    generation::token_tensor,
    speculative::{AssistantDrafter, DraftLength, Drafter, Misses, Speculation},
    AssistantCheckpoint, Checkpoint, Error, Gemma, Gemma4Assistant, GemmaBackend, GenerationConfig, Generator,
    RequestError,
};
use burn_gemma_model::{DraftInput, QueryRows};
use common::gguf::{GgufWriter, Meta};
use std::{num::NonZeroUsize, path::PathBuf};

/// The fixtures: assistant directory name, its target's.
const FIXTURES: [(&str, &str); 2] = [
    // A target with KV-sharing layers and per-layer inputs; the masked (centroid) lm_head.
    ("gemma4-e", "gemma4-e"),
    // A target without KV sharing, values from keys on full layers; the whole lm_head.
    ("gemma4-dense", "gemma4-dense"),
];

/// The bound on every draft logit, f32 against HF's f32 run (the committed logits are rounded to
/// 6 decimals). The tiny targets' own logits are held to 1e-3 over 40 positions
/// (tests/integration/tiny_models.rs: Gemma 4's attention at scale 1 grows product errors with every
/// position); drafting rounds read at most 21.
const TOLERANCE: f32 = 1e-4;

fn assistant_dir(name: &str) -> PathBuf {
    common::fixtures().join("tiny-gemma-assistant").join(name)
}

fn target<B: GemmaBackend>(name: &str, device: &B::Device) -> Gemma<B> {
    let dir = common::fixtures().join("tiny-gemma").join(name);
    Checkpoint::open(&dir).unwrap().load(common::dense_f32::<B>(device)).unwrap().model
}

fn assistant<B: GemmaBackend>(path: PathBuf, device: &B::Device) -> Gemma4Assistant<B> {
    let checkpoint = AssistantCheckpoint::open(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    checkpoint.load(common::dense_f32::<B>(device)).unwrap()
}

fn values(t: Tensor<impl burn::tensor::backend::Backend, 2>) -> Vec<f32> {
    t.cast(DType::F32).into_data().convert::<f32>().to_vec().unwrap()
}

/// The rounds of `reference.json` through our target and assistant: the largest logit error.
fn drafting_rounds_match<B: GemmaBackend>(
    assistant: &Gemma4Assistant<B>,
    target: &Gemma<B>,
    reference: &serde_json::Value,
) -> f32 {
    let device = target.device();
    let input = common::ids(&reference["input_ids"]);
    let mut worst = 0.0f32;
    for round in reference["rounds"].as_array().unwrap() {
        let p = round["position"].as_u64().unwrap() as usize;
        let mut cache = target.new_cache(1, input.len()).unwrap();
        let hidden =
            target.forward_hidden(token_tensor::<B>(&input[..p], &device), &mut cache, QueryRows::Together).unwrap();
        let width = hidden.dims()[2];
        let mut state = hidden.slice([0..1, p - 1..p, 0..width]).reshape([1, width]);
        let mut token = input[p];
        let want_tokens = common::ids(&round["tokens"]);
        for (step, (want_logits, &want_token)) in
            round["logits"].as_array().unwrap().iter().zip(&want_tokens).enumerate()
        {
            let input = DraftInput { ids: token_tensor::<B>(&[token], &device), hidden: state };
            let out = assistant.step(target, &cache, input).unwrap();
            let got = values(out.logits);
            let want: Vec<f32> = want_logits.as_array().unwrap().iter().map(|v| v.as_f64().unwrap() as f32).collect();
            assert_eq!(got.len(), want.len());
            assert!(got.iter().all(|v| v.is_finite()), "position {p} step {step}: non-finite logits");
            let err = got.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
            worst = worst.max(err);
            assert!(err <= TOLERANCE, "position {p} step {step}: max logit error {err:.2e}");
            let argmax = got.iter().enumerate().fold((0, f32::MIN), |m, (i, &v)| if v > m.1 { (i, v) } else { m }).0;
            assert_eq!(argmax as u32, want_token, "position {p} step {step}: draft token");
            token = want_token;
            state = out.hidden;
        }
        // Drafting read the target's cache and wrote nothing.
        assert_eq!(cache.len(), p);
    }
    worst
}

fn rounds_match_hf<B: GemmaBackend>(device: &B::Device) {
    for (name, target_name) in FIXTURES {
        let reference = common::read_json(assistant_dir(name).join("reference.json"));
        let target = target::<B>(target_name, device);
        let assistant = assistant::<B>(assistant_dir(name), device);
        assistant.check_target(&target).unwrap();
        let worst = drafting_rounds_match(&assistant, &target, &reference);
        println!("{name}: draft logits within {worst:.2e} of HF (bound {TOLERANCE:.0e})");
    }
}

#[test]
fn assistant_drafts_match_hf_on_ndarray() {
    rounds_match_hf::<NdArray>(&Default::default());
}

#[cfg(feature = "candle")]
#[test]
fn assistant_drafts_match_hf_on_candle() {
    rounds_match_hf::<burn_gemma::backends::Candle>(&Default::default());
}

#[cfg(feature = "wgpu")]
#[test]
fn assistant_drafts_match_hf_on_wgpu() {
    rounds_match_hf::<burn_gemma::backends::Wgpu>(&Default::default());
}

#[cfg(feature = "cuda")]
#[test]
fn assistant_drafts_match_hf_on_cuda() {
    rounds_match_hf::<burn_gemma::backends::Cuda>(&Default::default());
}

fn k(n: usize) -> NonZeroUsize {
    NonZeroUsize::new(n).unwrap()
}

fn generate(name: &str, drafts: Option<usize>, config: &GenerationConfig) -> burn_gemma::GenerationOutput {
    let device = Default::default();
    let mut g = Generator::new(target::<NdArray>(name, &device), common::tiny_tokenizer()).unwrap();
    if let Some(n) = drafts {
        let drafter = Drafter::Assistant(Box::new(AssistantDrafter::new(assistant(assistant_dir(name), &device))));
        let speculation = Speculation::new(drafter, DraftLength::Fixed(k(n))).with_misses(Misses::KeepDrafting);
        g.set_speculation(Some(speculation)).unwrap();
    }
    let reference = common::read_json(common::fixtures().join("tiny-gemma").join(name).join("reference.json"));
    let prompt = common::ids(&reference["input_ids"]);
    g.continue_ids(&prompt[..12], config, |_| {}).unwrap()
}

/// The assistant only drafts: greedy output is the model's own, token for token, past the
/// sliding window (8) and with rounds that keep none, some and all of their drafts.
#[test]
fn greedy_output_with_the_assistant_equals_greedy_output_without() {
    let config = GenerationConfig { max_new_tokens: 40, ..Default::default() };
    for (name, _) in FIXTURES {
        let plain = generate(name, None, &config);
        for n in [1, 3, 5] {
            let drafted = generate(name, Some(n), &config);
            assert_eq!(drafted.tokens, plain.tokens, "{name}, {n} drafts per round");
            let stats = drafted.stats.speculation.expect("speculation stats");
            assert!(stats.verify_steps > 0 && stats.drafted >= stats.verify_steps, "{name}: {stats:?}");
            println!("{name}, {n} drafts: {stats:?}");
        }
    }
}

/// Sampled output with the assistant drafting runs both halves of the acceptance rule and keeps
/// the model's tokens in the vocabulary; the rule itself is tested against the model's
/// distribution in tests/integration/speculative.rs.
#[test]
fn sampled_output_with_the_assistant_runs() {
    let sampling = burn_gemma::SamplingConfig { temperature: 1.0, top_k: Some(8), seed: 7, ..Default::default() };
    let config = GenerationConfig { max_new_tokens: 30, sampling, ..Default::default() };
    let out = generate("gemma4-e", Some(3), &config);
    assert_eq!(out.tokens.len(), 30);
    assert!(out.tokens.iter().all(|&t| t < 512));
    let stats = out.stats.speculation.unwrap();
    assert!(stats.verify_steps > 0, "{stats:?}");
}

/// The hidden state each round starts from is the model's at the position before the pending
/// token, after rounds that kept none, some and all of their drafts: sampled decoding (top 2 of
/// both distributions) keeps some of a random assistant's drafts. Each state the generator keeps
/// is checked against a forward pass of the tokens so far.
#[test]
fn each_round_starts_from_the_model_hidden_state_before_the_pending_token() {
    let device = Default::default();
    let name = "gemma4-e";
    let mut g = Generator::new(target::<NdArray>(name, &device), common::tiny_tokenizer()).unwrap();
    let drafter = Drafter::Assistant(Box::new(AssistantDrafter::new(assistant(assistant_dir(name), &device))));
    let speculation = Speculation::new(drafter, DraftLength::Fixed(k(3))).with_misses(Misses::KeepDrafting);
    g.set_speculation(Some(speculation)).unwrap();
    let reference = target::<NdArray>(name, &device);
    let (mut checked, mut after_kept) = (0, 0);
    for seed in 0..16 {
        let sampling = burn_gemma::SamplingConfig { temperature: 1.0, top_k: Some(2), seed, ..Default::default() };
        let config = GenerationConfig { max_new_tokens: 24, sampling, ..Default::default() };
        g.reset();
        let mut stream = g.stream_ids(&[2, 40, 41, 42, 43], &config).unwrap();
        let mut tokens = vec![2, 40, 41, 42, 43];
        let mut last = None;
        while let Some(token) = stream.next() {
            tokens.push(token.unwrap().id);
            let Some((position, hidden)) = stream.generator().last_hidden_state() else { continue };
            if last == Some(position) {
                // A kept draft handed out: the model did not run.
                continue;
            }
            let mut cache = reference.new_cache(1, 64).unwrap();
            let ids = token_tensor::<NdArray>(&tokens[..=position], &device);
            let all = reference.forward_hidden(ids, &mut cache, QueryRows::Together).unwrap();
            let width = all.dims()[2];
            let want = values(all.slice([0..1, position..position + 1, 0..width]).reshape([1, width]));
            let err = values(hidden).iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
            assert!(err < 1e-4, "seed {seed}: the hidden state at {position} is {err:.2e} from the model's");
            checked += 1;
            // A round that kept drafts moves the state past them.
            if last.is_some_and(|l| position > l + 1) {
                after_kept += 1;
            }
            last = Some(position);
        }
    }
    assert!(after_kept > 0 && checked > after_kept, "{checked} states checked, {after_kept} after kept drafts");
    println!("{checked} hidden states checked, {after_kept} after rounds that kept drafts");
}

#[test]
fn an_assistant_that_does_not_fit_the_model_is_refused() {
    let device = Default::default();
    // gemma4-e's assistant reads one KV head on sliding layers; gemma4-dense has two.
    let mut g = Generator::new(target::<NdArray>("gemma4-dense", &device), common::tiny_tokenizer()).unwrap();
    let drafter = Drafter::Assistant(Box::new(AssistantDrafter::new(assistant(assistant_dir("gemma4-e"), &device))));
    let err = g.set_speculation(Some(Speculation::new(drafter, DraftLength::Fixed(k(2))))).unwrap_err();
    assert!(matches!(&err, Error::Request(RequestError::AssistantMismatch(m)) if m.contains("KV heads")), "{err}");
    // A Gemma 3 model.
    let mut g = Generator::new(target::<NdArray>("gemma3", &device), common::tiny_tokenizer()).unwrap();
    let drafter = Drafter::Assistant(Box::new(AssistantDrafter::new(assistant(assistant_dir("gemma4-e"), &device))));
    let err = g.set_speculation(Some(Speculation::new(drafter, DraftLength::Fixed(k(2))))).unwrap_err();
    assert!(err.to_string().contains("Gemma 4"), "{err}");
}

#[test]
fn cuda_graphs_on_with_an_assistant_are_refused() {
    let device = Default::default();
    let mut g = Generator::new(target::<NdArray>("gemma4-e", &device), common::tiny_tokenizer()).unwrap();
    let drafter = Drafter::Assistant(Box::new(AssistantDrafter::new(assistant(assistant_dir("gemma4-e"), &device))));
    g.set_speculation(Some(Speculation::new(drafter, DraftLength::Fixed(k(2))))).unwrap();
    let config = GenerationConfig { cuda_graph: burn_gemma::CudaGraph::On, ..Default::default() };
    let err = g.continue_ids(&[2, 10, 11], &config, |_| {}).unwrap_err();
    assert!(matches!(err, Error::Request(RequestError::CudaGraphWithAssistant)), "{err}");
}

#[test]
fn checkpoints_say_which_is_a_model_and_which_an_assistant() {
    let err = Checkpoint::open(assistant_dir("gemma4-e")).err().expect("an assistant is no model");
    assert!(err.to_string().contains("assistant"), "{err}");
    let err =
        AssistantCheckpoint::open(common::fixtures().join("tiny-gemma/gemma4-e")).err().expect("not an assistant");
    assert!(err.to_string().contains("not a Gemma 4 assistant"), "{err}");
}

/// llama.cpp's `gemma4-assistant` GGUF of the whole-lm_head fixture (its converter's names and
/// metadata) drafts the same logits as the safetensors checkpoint.
#[test]
fn gemma4_assistant_gguf_matches_safetensors() {
    let dir = assistant_dir("gemma4-dense");
    let config = common::read_json(dir.join("config.json"));
    let text = &config["text_config"];
    let u = |k: &str| text[k].as_u64().unwrap() as u32;
    let layers = u("num_hidden_layers");
    let sliding: Vec<bool> = text["layer_types"].as_array().unwrap().iter().map(|t| t == "sliding_attention").collect();
    let full = sliding.iter().position(|s| !s).unwrap();
    let full_override = &text["per_layer_config"][full.to_string()];
    let head_full = full_override["head_dim"].as_u64().unwrap() as u32;
    let kv_full = full_override["num_key_value_heads"].as_u64().unwrap() as u32;
    let partial = text["rope_parameters"]["full_attention"]["partial_rotary_factor"].as_f64().unwrap();

    let mut g = GgufWriter::default();
    let a = |k: &str| format!("gemma4-assistant.{k}");
    g.meta("general.architecture", Meta::Str("gemma4-assistant".into()));
    g.meta(&a("block_count"), Meta::U32(layers));
    g.meta(&a("nextn_predict_layers"), Meta::U32(layers));
    g.meta(&a("context_length"), Meta::U32(u("max_position_embeddings")));
    g.meta(&a("embedding_length"), Meta::U32(u("hidden_size")));
    g.meta(&a("embedding_length_out"), Meta::U32(config["backbone_hidden_size"].as_u64().unwrap() as u32));
    g.meta(&a("attention.head_count"), Meta::U32(u("num_attention_heads")));
    g.meta(&a("attention.layer_norm_rms_epsilon"), Meta::F32(text["rms_norm_eps"].as_f64().unwrap() as f32));
    g.meta(&a("attention.sliding_window"), Meta::U32(u("sliding_window")));
    g.meta(&a("rope.freq_base"), Meta::F32(1_000_000.0));
    g.meta(&a("rope.freq_base_swa"), Meta::F32(10_000.0));
    g.meta(&a("attention.shared_kv_layers"), Meta::U32(layers));
    g.meta(&a("embedding_length_per_layer_input"), Meta::U32(0));
    g.meta(&a("attention.sliding_window_pattern"), Meta::Bools(sliding.clone()));
    g.meta(&a("attention.key_length"), Meta::U32(head_full));
    g.meta(&a("attention.value_length"), Meta::U32(head_full));
    g.meta(&a("attention.key_length_swa"), Meta::U32(u("head_dim")));
    g.meta(&a("attention.value_length_swa"), Meta::U32(u("head_dim")));
    g.meta(&a("feed_forward_length"), Meta::U32(u("intermediate_size")));
    let kv = u("num_key_value_heads");
    g.meta(&a("attention.head_count_kv"), Meta::U32s(sliding.iter().map(|&s| if s { kv } else { kv_full }).collect()));
    let rotated = (partial * head_full as f64 / 2.0) as usize;
    let factors = (0..head_full as usize / 2).map(|i| if i < rotated { 1.0 } else { 1e30 }).collect();
    g.tensor("rope_freqs.weight", vec![head_full as usize / 2], factors);
    let tensors = common::f32_tensors(&std::fs::read(dir.join("model.safetensors")).unwrap());
    for (hf, (shape, values)) in tensors {
        let name = match hf.as_str() {
            "model.embed_tokens.weight" => "token_embd.weight".to_string(),
            "model.norm.weight" => "output_norm.weight".to_string(),
            "pre_projection.weight" => "nextn.pre_projection.weight".to_string(),
            "post_projection.weight" => "nextn.post_projection.weight".to_string(),
            other => {
                let rest = other.strip_prefix("model.layers.").unwrap_or_else(|| panic!("unmapped {other}"));
                let (layer, part) = rest.split_once('.').unwrap();
                let g = match part {
                    "layer_scalar" => "layer_output_scale.weight",
                    "input_layernorm.weight" => "attn_norm.weight",
                    "post_attention_layernorm.weight" => "post_attention_norm.weight",
                    "pre_feedforward_layernorm.weight" => "ffn_norm.weight",
                    "post_feedforward_layernorm.weight" => "post_ffw_norm.weight",
                    "self_attn.q_proj.weight" => "attn_q.weight",
                    "self_attn.o_proj.weight" => "attn_output.weight",
                    "self_attn.q_norm.weight" => "attn_q_norm.weight",
                    "mlp.gate_proj.weight" => "ffn_gate.weight",
                    "mlp.up_proj.weight" => "ffn_up.weight",
                    "mlp.down_proj.weight" => "ffn_down.weight",
                    other => panic!("unmapped {other}"),
                };
                format!("blk.{layer}.{g}")
            }
        };
        g.tensor(&name, shape, values);
    }
    let path = common::Scratch::new("assistant").file("gemma4-dense-assistant.gguf");
    std::fs::write(&path, g.bytes()).unwrap();

    let from_gguf = AssistantCheckpoint::open(&path).unwrap_or_else(|e| panic!("{e}"));
    let from_hf = AssistantCheckpoint::open(&dir).unwrap();
    // The same stack (the GGUF leaves out what an assistant does not use: the final softcap,
    // values-from-keys of layers without keys).
    let (a, b) = (&from_gguf.config().text, &from_hf.config().text);
    assert_eq!(from_gguf.config().backbone_hidden_size, from_hf.config().backbone_hidden_size);
    assert_eq!(
        (a.hidden_size, a.num_attention_heads, &a.layer_types, a.head_dim, a.global_head_dim, a.sliding_window),
        (b.hidden_size, b.num_attention_heads, &b.layer_types, b.head_dim, b.global_head_dim, b.sliding_window)
    );
    assert_eq!(
        (a.num_key_value_heads, a.num_global_key_value_heads),
        (b.num_key_value_heads, b.num_global_key_value_heads)
    );
    let device = Default::default();
    let target = target::<NdArray>("gemma4-dense", &device);
    let reference = common::read_json(dir.join("reference.json"));
    let assistant = from_gguf.load(common::dense_f32::<NdArray>(&device)).unwrap();
    let worst = drafting_rounds_match(&assistant, &target, &reference);
    println!("gemma4-dense assistant from GGUF: draft logits within {worst:.2e} of HF");
}
