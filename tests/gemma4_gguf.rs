//! The GGUF `gemma4` mapping: each tiny Gemma 4 fixture is written as a GGUF the way llama.cpp's
//! converter lays one out (its tensor names, dims innermost first, norms as stored, the metadata
//! keys of `Gemma4Model.set_gguf_parameters`, per-layer arrays, the `rope_freqs` tensor of
//! proportional RoPE), loaded back, and must give the logits of the same checkpoint read from
//! safetensors, and HF's.

mod common;

use burn_gemma::generation::token_tensor;
use burn_gemma::{backends::NdArray, Checkpoint};
use serde_json::Value as Json;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// GGUF metadata values this test writes.
enum Meta {
    U32(u32),
    F32(f32),
    Str(String),
    U32s(Vec<u32>),
    Bools(Vec<bool>),
}

/// A GGUF version 3 file of f32 tensors.
#[derive(Default)]
struct GgufWriter {
    meta: Vec<(String, Meta)>,
    tensors: Vec<(String, Vec<usize>, Vec<f32>)>,
}

impl GgufWriter {
    fn meta(&mut self, key: &str, value: Meta) {
        self.meta.push((key.to_string(), value));
    }

    /// `shape` outermost first (PyTorch order), as the loader reports it.
    fn tensor(&mut self, name: &str, shape: Vec<usize>, values: Vec<f32>) {
        assert_eq!(shape.iter().product::<usize>(), values.len(), "{name}");
        self.tensors.push((name.to_string(), shape, values));
    }

    fn bytes(&self) -> Vec<u8> {
        const ALIGNMENT: usize = 32;
        let mut out = b"GGUF".to_vec();
        out.extend(3u32.to_le_bytes());
        out.extend((self.tensors.len() as u64).to_le_bytes());
        out.extend((self.meta.len() as u64).to_le_bytes());
        let string = |out: &mut Vec<u8>, s: &str| {
            out.extend((s.len() as u64).to_le_bytes());
            out.extend(s.as_bytes());
        };
        for (key, value) in &self.meta {
            string(&mut out, key);
            match value {
                Meta::U32(v) => {
                    out.extend(4u32.to_le_bytes());
                    out.extend(v.to_le_bytes());
                }
                Meta::F32(v) => {
                    out.extend(6u32.to_le_bytes());
                    out.extend(v.to_le_bytes());
                }
                Meta::Str(s) => {
                    out.extend(8u32.to_le_bytes());
                    string(&mut out, s);
                }
                Meta::U32s(items) => {
                    out.extend(9u32.to_le_bytes());
                    out.extend(4u32.to_le_bytes());
                    out.extend((items.len() as u64).to_le_bytes());
                    items.iter().for_each(|v| out.extend(v.to_le_bytes()));
                }
                Meta::Bools(items) => {
                    out.extend(9u32.to_le_bytes());
                    out.extend(7u32.to_le_bytes());
                    out.extend((items.len() as u64).to_le_bytes());
                    items.iter().for_each(|&b| out.push(u8::from(b)));
                }
            }
        }
        let mut offset = 0usize;
        let mut data = Vec::new();
        for (name, shape, values) in &self.tensors {
            string(&mut out, name);
            out.extend((shape.len() as u32).to_le_bytes());
            // GGML lists dims innermost first.
            shape.iter().rev().for_each(|&d| out.extend((d as u64).to_le_bytes()));
            out.extend(0u32.to_le_bytes()); // F32
            out.extend((offset as u64).to_le_bytes());
            values.iter().for_each(|v| data.extend(v.to_le_bytes()));
            data.resize(data.len().div_ceil(ALIGNMENT) * ALIGNMENT, 0);
            offset = data.len();
        }
        out.resize(out.len().div_ceil(ALIGNMENT) * ALIGNMENT, 0);
        out.extend(data);
        out
    }
}

/// The f32 tensors of a safetensors file.
fn safetensors(path: &Path) -> BTreeMap<String, (Vec<usize>, Vec<f32>)> {
    common::f32_tensors(&std::fs::read(path).unwrap())
}

/// llama.cpp's name of an HF Gemma 4 tensor.
fn gguf_name(hf: &str) -> String {
    let fixed = [
        ("model.embed_tokens.weight", "token_embd.weight"),
        ("model.norm.weight", "output_norm.weight"),
        ("model.embed_tokens_per_layer.weight", "per_layer_token_embd.weight"),
        ("model.per_layer_model_projection.weight", "per_layer_model_proj.weight"),
        ("model.per_layer_projection_norm.weight", "per_layer_proj_norm.weight"),
    ];
    if let Some((_, g)) = fixed.iter().find(|(h, _)| *h == hf) {
        return g.to_string();
    }
    let rest = hf.strip_prefix("model.layers.").unwrap_or_else(|| panic!("unmapped {hf}"));
    let (layer, part) = rest.split_once('.').unwrap();
    let g = match part {
        "layer_scalar" => "layer_output_scale.weight",
        "input_layernorm.weight" => "attn_norm.weight",
        "post_attention_layernorm.weight" => "post_attention_norm.weight",
        "pre_feedforward_layernorm.weight" => "ffn_norm.weight",
        "post_feedforward_layernorm.weight" => "post_ffw_norm.weight",
        "pre_feedforward_layernorm_2.weight" => "pre_ffw_norm_2.weight",
        "post_feedforward_layernorm_1.weight" => "post_ffw_norm_1.weight",
        "post_feedforward_layernorm_2.weight" => "post_ffw_norm_2.weight",
        "self_attn.q_proj.weight" => "attn_q.weight",
        "self_attn.k_proj.weight" => "attn_k.weight",
        "self_attn.v_proj.weight" => "attn_v.weight",
        "self_attn.o_proj.weight" => "attn_output.weight",
        "self_attn.q_norm.weight" => "attn_q_norm.weight",
        "self_attn.k_norm.weight" => "attn_k_norm.weight",
        "mlp.gate_proj.weight" => "ffn_gate.weight",
        "mlp.up_proj.weight" => "ffn_up.weight",
        "mlp.down_proj.weight" => "ffn_down.weight",
        "per_layer_input_gate.weight" => "inp_gate.weight",
        "per_layer_projection.weight" => "proj.weight",
        "post_per_layer_input_norm.weight" => "post_norm.weight",
        "router.proj.weight" => "ffn_gate_inp.weight",
        "router.scale" => "ffn_gate_inp.scale",
        "router.per_expert_scale" => "ffn_down_exps.scale",
        "experts.gate_up_proj" => "ffn_gate_up_exps.weight",
        "experts.down_proj" => "ffn_down_exps.weight",
        other => panic!("unmapped {other}"),
    };
    format!("blk.{layer}.{g}")
}

/// Writes fixture `name` as a GGUF beside the test's scratch files.
fn write_gguf(name: &str) -> PathBuf {
    let dir = common::fixtures().join("tiny-gemma").join(name);
    let config: Json = serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    let u = |k: &str| config[k].as_u64().unwrap() as u32;
    let layers = u("num_hidden_layers");
    let layer_types: Vec<bool> =
        config["layer_types"].as_array().unwrap().iter().map(|t| t == "sliding_attention").collect();
    let full = layer_types.iter().position(|s| !s).unwrap();
    let full_override = &config["per_layer_config"][full.to_string()];
    let head_full = full_override["head_dim"].as_u64().unwrap() as u32;
    let kv_full = full_override["num_key_value_heads"].as_u64().map(|v| v as u32);
    let partial = config["rope_parameters"]["full_attention"]["partial_rotary_factor"].as_f64().unwrap();

    let mut g = GgufWriter::default();
    let a = |k: &str| format!("gemma4.{k}");
    g.meta("general.architecture", Meta::Str("gemma4".into()));
    g.meta(&a("block_count"), Meta::U32(layers));
    g.meta(&a("context_length"), Meta::U32(u("max_position_embeddings")));
    g.meta(&a("embedding_length"), Meta::U32(u("hidden_size")));
    g.meta(&a("attention.head_count"), Meta::U32(u("num_attention_heads")));
    g.meta(&a("attention.layer_norm_rms_epsilon"), Meta::F32(config["rms_norm_eps"].as_f64().unwrap() as f32));
    g.meta(&a("attention.sliding_window"), Meta::U32(u("sliding_window")));
    g.meta(&a("final_logit_softcapping"), Meta::F32(config["final_logit_softcapping"].as_f64().unwrap() as f32));
    g.meta(&a("rope.freq_base"), Meta::F32(1_000_000.0));
    g.meta(&a("rope.freq_base_swa"), Meta::F32(10_000.0));
    g.meta(&a("attention.shared_kv_layers"), Meta::U32(u("num_kv_shared_layers")));
    g.meta(&a("embedding_length_per_layer_input"), Meta::U32(u("hidden_size_per_layer_input")));
    g.meta(&a("attention.sliding_window_pattern"), Meta::Bools(layer_types.clone()));
    g.meta(&a("attention.key_length"), Meta::U32(head_full));
    g.meta(&a("attention.value_length"), Meta::U32(head_full));
    g.meta(&a("attention.key_length_swa"), Meta::U32(u("head_dim")));
    g.meta(&a("attention.value_length_swa"), Meta::U32(u("head_dim")));
    g.meta(&a("rope.dimension_count"), Meta::U32(head_full));
    g.meta(&a("rope.dimension_count_swa"), Meta::U32(u("head_dim")));
    let inter = u("intermediate_size");
    if config["use_double_wide_mlp"].as_bool() == Some(true) {
        let first_shared = layers - u("num_kv_shared_layers");
        g.meta(
            &a("feed_forward_length"),
            Meta::U32s((0..layers).map(|i| if i < first_shared { inter } else { 2 * inter }).collect()),
        );
    } else {
        g.meta(&a("feed_forward_length"), Meta::U32(inter));
    }
    match kv_full {
        Some(kv_full) => {
            let kv = u("num_key_value_heads");
            g.meta(
                &a("attention.head_count_kv"),
                Meta::U32s(layer_types.iter().map(|&s| if s { kv } else { kv_full }).collect()),
            );
        }
        None => g.meta(&a("attention.head_count_kv"), Meta::U32(u("num_key_value_heads"))),
    }
    if config["enable_moe_block"].as_bool() == Some(true) {
        g.meta(&a("expert_count"), Meta::U32(u("num_experts")));
        g.meta(&a("expert_used_count"), Meta::U32(u("top_k_experts")));
        g.meta(&a("expert_feed_forward_length"), Meta::U32(u("moe_intermediate_size")));
    }
    // Proportional RoPE as llama.cpp encodes it: frequency factors of 1 for the rotated pairs,
    // 1e30 (no rotation) for the rest.
    let rotated = (partial * head_full as f64 / 2.0) as usize;
    let factors = (0..head_full as usize / 2).map(|i| if i < rotated { 1.0 } else { 1e30 }).collect();
    g.tensor("rope_freqs.weight", vec![head_full as usize / 2], factors);
    for (hf, (shape, values)) in safetensors(&dir.join("model.safetensors")) {
        g.tensor(&gguf_name(&hf), shape, values);
    }
    let out = std::env::temp_dir().join(format!("burn-gemma-tests-{}", std::process::id()));
    std::fs::create_dir_all(&out).unwrap();
    let path = out.join(format!("{name}.gguf"));
    std::fs::write(&path, g.bytes()).unwrap();
    path
}

/// Logits of `input` through the checkpoint at `path`, and its config.
fn logits(path: &Path, input: &[u32]) -> (Vec<f32>, burn_gemma::GemmaConfig) {
    let checkpoint = Checkpoint::open(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let device: burn::backend::ndarray::NdArrayDevice = Default::default();
    let (model, report) =
        checkpoint.load(common::dense_f32::<NdArray>(&device)).map(burn_gemma::Loaded::into_parts).expect("load");
    assert!(report.unused_tensors.is_empty(), "{}: unused {:?}", path.display(), report.unused_tensors);
    let mut cache = model.new_cache(1, input.len()).unwrap();
    let logits = model.forward(token_tensor::<NdArray>(input, &device), &mut cache).unwrap();
    (logits.into_data().to_vec::<f32>().unwrap(), checkpoint.config().clone())
}

#[test]
fn gemma4_gguf_matches_safetensors() {
    for name in ["gemma4-e", "gemma4-dense", "gemma4-moe"] {
        let dir = common::fixtures().join("tiny-gemma").join(name);
        let reference = common::read_json(dir.join("reference.json"));
        let input = common::ids(&reference["input_ids"]);
        let gguf = write_gguf(name);
        let (from_gguf, gguf_config) = logits(&gguf, &input);
        let (from_hf, hf_config) = logits(&dir, &input);
        // GGUF stores epsilon as f32.
        assert!((gguf_config.rms_norm_eps - hf_config.rms_norm_eps).abs() < 1e-12, "{name}: epsilon");
        let gguf_config = burn_gemma::GemmaConfig { rms_norm_eps: hf_config.rms_norm_eps, ..gguf_config };
        assert_eq!(format!("{gguf_config:?}"), format!("{hf_config:?}"), "{name}: configs");
        let expected: Vec<f32> = reference["logits"]
            .as_array()
            .unwrap()
            .iter()
            .flat_map(|r| r.as_array().unwrap().iter().map(|v| v.as_f64().unwrap() as f32))
            .collect();
        let diff = |a: &[f32], b: &[f32]| a.iter().zip(b).fold(0.0f32, |m, (x, y)| m.max((x - y).abs()));
        let (vs_hf, vs_reference) = (diff(&from_gguf, &from_hf), diff(&from_gguf, &expected));
        println!("{name}: GGUF vs safetensors max |diff| {vs_hf:.2e}, vs HF transformers {vs_reference:.2e}");
        assert!(from_gguf.iter().all(|v| v.is_finite()), "{name}: non-finite");
        assert!(vs_hf <= 1e-5, "{name}: the GGUF and safetensors models differ by {vs_hf}");
        assert!(vs_reference <= 1e-3, "{name}: {vs_reference}");
        std::fs::remove_file(gguf).ok();
    }
}
