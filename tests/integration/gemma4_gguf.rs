//! The GGUF `gemma4` mapping: each tiny Gemma 4 fixture is written as a GGUF the way llama.cpp's
//! converter lays one out (its tensor names, dims innermost first, norms as stored, the metadata
//! keys of `Gemma4Model.set_gguf_parameters`, per-layer arrays, the `rope_freqs` tensor of
//! proportional RoPE), loaded back, and must give the logits of the same checkpoint read from
//! safetensors, and HF's.

use crate::common;

use burn_gemma::generation::token_tensor;
use burn_gemma::{backends::NdArray, Checkpoint};
use common::gguf::{GgufWriter, Meta};
use serde_json::Value as Json;
use std::collections::BTreeMap;
use std::path::Path;

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
fn write_gguf(name: &str, vocab: Option<&Gemma4Vocab>) -> common::ScratchFile {
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
    // Gemma 4 12B's config has no per-layer inputs (nor the key).
    let per_layer = config["hidden_size_per_layer_input"].as_u64().unwrap_or(0) as u32;
    g.meta(&a("embedding_length_per_layer_input"), Meta::U32(per_layer));
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
    if let Some(vocab) = vocab {
        g.meta("tokenizer.ggml.model", Meta::Str("gemma4".into()));
        g.meta("tokenizer.ggml.pre", Meta::Str("gemma4".into()));
        g.meta("tokenizer.ggml.tokens", Meta::Strs(vocab.tokens.clone()));
        g.meta("tokenizer.ggml.token_type", Meta::I32s(vocab.types.clone()));
        g.meta("tokenizer.ggml.merges", Meta::Strs(vocab.merges.clone()));
        g.meta("tokenizer.ggml.bos_token_id", Meta::U32(2));
        g.meta("tokenizer.ggml.eos_token_id", Meta::U32(1));
    }
    for (hf, (shape, values)) in safetensors(&dir.join("model.safetensors")) {
        g.tensor(&gguf_name(&hf), shape, values);
    }
    // One directory per call: tests run in parallel and each maps its own file (rewriting a file
    // another test has mapped would pull its pages away).
    let path = common::Scratch::new("gemma4-gguf").file(&format!("{name}.gguf"));
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
    for name in ["gemma4-e", "gemma4-dense", "gemma4-moe", "gemma4-unified"] {
        let dir = common::fixtures().join("tiny-gemma").join(name);
        let reference = common::read_json(dir.join("reference.json"));
        let input = common::ids(&reference["input_ids"]);
        let gguf = write_gguf(name, None);
        let (from_gguf, gguf_config) = logits(&gguf, &input);
        let (from_hf, hf_config) = logits(&dir, &input);
        // GGUF stores epsilon as f32.
        assert!((gguf_config.rms_norm_eps - hf_config.rms_norm_eps).abs() < 1e-12, "{name}: epsilon");
        // GGUF does not record how image tokens attend: llama.cpp's rule (causal for the E
        // models, both ways on sliding layers for the others); HF configs say it with
        // `use_bidirectional_attention: "vision"` (unset: causal).
        let expected_images = if gguf_config.hidden_size_per_layer_input > 0 {
            burn_gemma_model::ImageAttention::Causal
        } else {
            burn_gemma_model::ImageAttention::BothWaysOnSlidingLayers
        };
        assert_eq!(gguf_config.image_attention, expected_images, "{name}: image attention");
        let json = common::read_json(dir.join("config.json"));
        let text = if json["text_config"].is_object() { &json["text_config"] } else { &json };
        let hf_images = match text["use_bidirectional_attention"].as_str() {
            Some("vision") => burn_gemma_model::ImageAttention::BothWaysOnSlidingLayers,
            _ => burn_gemma_model::ImageAttention::Causal,
        };
        assert_eq!(hf_config.image_attention, hf_images, "{name}: image attention");
        let gguf_config = burn_gemma::GemmaConfig {
            rms_norm_eps: hf_config.rms_norm_eps,
            image_attention: hf_config.image_attention,
            ..gguf_config
        };
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

/// A Gemma 4 style BPE vocabulary: control and user-defined tokens, the 256 byte tokens, and
/// pieces with their merges trained by the `tokenizers` crate on a small corpus.
struct Gemma4Vocab {
    tokens: Vec<String>,
    /// GGUF token types: 1 normal, 3 control, 4 user-defined, 6 byte.
    types: Vec<i32>,
    /// `"left right"`, in rank order.
    merges: Vec<String>,
}

/// Gemma 4's control tokens (type 3) and the turn and tool tokens kept whole in text (type 4).
const GEMMA4_SPECIALS: [(&str, i32); 17] = [
    ("<pad>", 3),
    ("<eos>", 3),
    ("<bos>", 3),
    ("<unk>", 3),
    ("<mask>", 3),
    ("<|turn>", 4),
    ("<turn|>", 4),
    ("<|think|>", 4),
    ("<|channel>", 4),
    ("<channel|>", 4),
    ("<|tool_call>", 4),
    ("<tool_call|>", 4),
    ("<|\"|>", 4),
    ("<|tool>", 4),
    ("<tool|>", 4),
    ("<|tool_response>", 4),
    ("<tool_response|>", 4),
];

/// The strings the two tokenizers must agree on: runs of spaces and newlines, tabs, emoji
/// (some outside the vocabulary: byte fallback), CJK, combining marks, control tokens inside
/// text, and edges (empty, only spaces, only newlines).
const AWKWARD: [&str; 22] = [
    "",
    " ",
    "   ",
    "\n",
    "\n\n\n\n\n",
    "Hello world",
    "  leading and trailing spaces  ",
    "tabs\tand\t\ttabs",
    "line one\nline two\n\n\nline five",
    " \n \n  \n",
    "emoji 🙂👍🏽 and 🦀 crab",
    "日本語のテキストと中文",
    "e\u{301}t\u{E9} cafe\u{301} na\u{EF}ve",
    "<|turn>user\nHi there<turn|>\n<|turn>model\n",
    "<|channel>thought\nthinking...<channel|>the answer",
    "<|tool_call>call:get_weather{city:<|\"|>Paris<|\"|>}<tool_call|>",
    "<|turn<turn|>|> <bos><eos>",
    "text<|think|>more",
    "a\r\nb\r\n",
    "x  y   z    w",
    "the the the theme thermal",
    "🦀\n🦀\n\n🦀",
];

/// Text the vocabulary is trained on.
fn training_corpus() -> Vec<String> {
    let base = [
        "the quick brown fox jumps over the lazy dog",
        "Hello world, hello there. The theme of the thermal test.",
        "line one\nline two\n\nparagraph\n\n\nthree newlines",
        "  indented  text   with    spaces",
        "tabs\tare\there",
        "日本語のテキスト 中文 文本",
        "café naïve résumé",
        "emoji 🙂 and 👍",
        "user model thought answer call get weather city Paris",
    ];
    base.iter().flat_map(|s| std::iter::repeat_n(s.to_string(), 3)).collect()
}

impl Gemma4Vocab {
    /// The 512-token vocabulary the tests share, trained once per test binary.
    fn shared() -> &'static Self {
        static VOCAB: std::sync::OnceLock<Gemma4Vocab> = std::sync::OnceLock::new();
        VOCAB.get_or_init(|| Self::trained(512))
    }

    /// Trains pieces and merges with the `tokenizers` crate (its normalizer and pre-tokenizer
    /// set as llama.cpp's Gemma 4 pre-tokenization), then lays the vocabulary out as a GGUF
    /// holds it, `size` tokens in all.
    fn trained(size: usize) -> Self {
        use tokenizers::models::bpe::{BpeTrainerBuilder, BPE};
        use tokenizers::models::TrainerWrapper;
        use tokenizers::normalizers::replace::Replace;
        use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
        use tokenizers::SplitDelimiterBehavior;

        let mut tokens: Vec<String> = GEMMA4_SPECIALS.iter().map(|(t, _)| t.to_string()).collect();
        let mut types: Vec<i32> = GEMMA4_SPECIALS.iter().map(|&(_, ty)| ty).collect();
        for b in 0..=255u8 {
            tokens.push(format!("<0x{b:02X}>"));
            types.push(6);
        }
        let mut trainer = TrainerWrapper::BpeTrainer(
            BpeTrainerBuilder::new().vocab_size(size - tokens.len()).show_progress(false).build(),
        );
        let mut t = tokenizers::Tokenizer::new(BPE::default());
        t.with_normalizer(Some(Replace::new(" ", "\u{2581}").unwrap()));
        t.with_pre_tokenizer(Some(
            Split::new(SplitPattern::Regex("\n+".into()), SplitDelimiterBehavior::Isolated, false).unwrap(),
        ));
        t.train(&mut trainer, training_corpus().into_iter()).unwrap();
        let json: Json = serde_json::from_str(&t.to_string(false).unwrap()).unwrap();
        let mut pieces: Vec<(String, u64)> = json["model"]["vocab"]
            .as_object()
            .unwrap()
            .iter()
            .map(|(piece, id)| (piece.clone(), id.as_u64().unwrap()))
            .collect();
        pieces.sort_by_key(|(_, id)| *id);
        for (piece, _) in pieces {
            if !tokens.contains(&piece) {
                tokens.push(piece);
                types.push(1);
            }
        }
        assert!(tokens.len() <= size, "{} tokens for a vocabulary of {size}", tokens.len());
        let merges = json["model"]["merges"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| match m {
                Json::String(s) => s.clone(),
                Json::Array(pair) => format!("{} {}", pair[0].as_str().unwrap(), pair[1].as_str().unwrap()),
                other => panic!("merge {other}"),
            })
            .collect();
        Self { tokens, types, merges }
    }

    /// The same vocabulary and merges as a `tokenizer.json` for the `tokenizers` crate:
    /// control and user-defined tokens added (matched whole), spaces to `▁`, runs of newlines
    /// split from the rest, BPE with byte fallback.
    fn reference(&self) -> tokenizers::Tokenizer {
        let vocab: serde_json::Map<String, Json> =
            self.tokens.iter().enumerate().map(|(i, t)| (t.clone(), i.into())).collect();
        let added: Vec<Json> = self
            .tokens
            .iter()
            .zip(&self.types)
            .enumerate()
            .filter(|(_, (_, &ty))| ty == 3 || ty == 4)
            .map(|(id, (t, _))| {
                serde_json::json!({"id": id, "content": t, "single_word": false, "lstrip": false,
                    "rstrip": false, "normalized": false, "special": true})
            })
            .collect();
        let merges: Vec<Json> = self
            .merges
            .iter()
            .map(|m| {
                let (a, b) = m.split_once(' ').unwrap();
                serde_json::json!([a, b])
            })
            .collect();
        let json = serde_json::json!({
            "version": "1.0",
            "added_tokens": added,
            "normalizer": {"type": "Replace", "pattern": {"String": " "}, "content": "\u{2581}"},
            "pre_tokenizer": {"type": "Split", "pattern": {"Regex": "\n+"}, "behavior": "Isolated", "invert": false},
            "post_processor": null,
            "decoder": null,
            "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
                      "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": true, "ignore_merges": false,
                      "vocab": vocab, "merges": merges}
        });
        json.to_string().parse().unwrap()
    }
}

/// The GGUF `gemma4` tokenizer gives the ids of the `tokenizers` crate's BPE over the same
/// vocabulary and merges on every awkward string, decodes them back to the text, and the
/// model in the same GGUF generates from a prompt it encodes.
#[test]
fn gemma4_gguf_tokenizer_matches_the_tokenizers_crate() {
    let vocab = Gemma4Vocab::shared();
    assert!(vocab.merges.len() > 50, "the trainer made {} merges", vocab.merges.len());
    let reference = vocab.reference();
    let gguf = write_gguf("gemma4-e", Some(vocab));
    let checkpoint = Checkpoint::open(&gguf).unwrap();
    let tokenizer = checkpoint.tokenizer().expect("the gemma4 vocabulary builds");
    let mut fallbacks = 0;
    for text in AWKWARD {
        let ours = tokenizer.encode(text, burn_gemma::Bos::Omit).unwrap();
        let theirs = reference.encode(text, false).unwrap().get_ids().to_vec();
        assert_eq!(ours, theirs, "{text:?}");
        let bytes = GEMMA4_SPECIALS.len() as u32;
        fallbacks += ours.iter().filter(|&&id| (bytes..bytes + 256).contains(&id)).count();
        // Decoding drops `<bos>`, `<eos>` and `<pad>`, and keeps everything else.
        let silent_dropped = text.replace("<bos>", "").replace("<eos>", "").replace("<pad>", "");
        assert_eq!(tokenizer.decode(&ours), silent_dropped, "round trip of {text:?}");
        // BOS first when the text starts a sequence, as llama.cpp always adds it for Gemma 4.
        assert_eq!(tokenizer.encode(text, burn_gemma::Bos::Prepend).unwrap()[0], 2);
    }
    assert!(fallbacks > 0, "the corpus should reach the byte fallback");
    let tool_call = tokenizer.encode("<|tool_call>call:f{}<tool_call|>", burn_gemma::Bos::Omit).unwrap();
    assert_eq!((tool_call[0], *tool_call.last().unwrap()), (10, 11), "control tokens kept whole");

    // Generation from text: the first greedy token is the argmax of the prompt's logits.
    let prompt = "Hello world";
    let prompt_ids = tokenizer.encode(prompt, burn_gemma::Bos::Prepend).unwrap();
    let device: burn::backend::ndarray::NdArrayDevice = Default::default();
    let model = checkpoint.load(common::dense_f32::<NdArray>(&device)).unwrap().model;
    let mut cache = model.new_cache(1, prompt_ids.len()).unwrap();
    let last = model.forward_last(token_tensor::<NdArray>(&prompt_ids, &device), &mut cache).unwrap();
    let last = last.into_data().to_vec::<f32>().unwrap();
    let expected = last.iter().enumerate().max_by(|a, b| a.1.total_cmp(b.1)).unwrap().0 as u32;
    let mut generator = burn_gemma::Generator::new(model, tokenizer).unwrap();
    let config = burn_gemma::GenerationConfig { max_new_tokens: 5, ..Default::default() };
    let out = generator.generate(prompt, &config, |_| {}).unwrap();
    assert_eq!(out.tokens.first(), Some(&expected), "{out:?}");
    match out.stop {
        burn_gemma::StopReason::MaxTokens => assert_eq!(out.tokens.len(), 5),
        burn_gemma::StopReason::StopToken(t) => assert_eq!(out.tokens.last(), Some(&t)),
        other => panic!("generation stopped with {other:?}"),
    }
    std::fs::remove_file(gguf).ok();
}

/// llama.cpp's Gemma 4 rule: a run of newlines that is a token is that token, even where no
/// merge builds it; a run that is not a token merges like any other text.
#[test]
fn newline_runs_are_whole_tokens_where_the_vocabulary_has_them() {
    let mut tokens: Vec<String> = vec!["<pad>".into(), "<eos>".into(), "<bos>".into()];
    let mut types = vec![3, 3, 3];
    for b in 0..=255u8 {
        tokens.push(format!("<0x{b:02X}>"));
        types.push(6);
    }
    for piece in ["\n", "\n\n", "\n\n\n\n", "a", "b", "ab"] {
        tokens.push(piece.into());
        types.push(1);
    }
    let id = |p: &str| tokens.iter().position(|t| t == p).unwrap() as u32;
    let (nl, nl2, nl4, a, ab) = (id("\n"), id("\n\n"), id("\n\n\n\n"), id("a"), id("ab"));
    let merges = vec!["\n \n".to_string(), "a b".to_string()];
    let t = burn_gemma::Tokenizer::from_bpe_vocab(tokens, types, &merges, 2).unwrap();
    let enc = |s: &str| t.encode(s, burn_gemma::Bos::Omit).unwrap();
    // Four newlines are a token, though the merges only build pairs.
    assert_eq!(enc("ab\n\n\n\nab"), [ab, nl4, ab]);
    // Three are not: merged as text, leftmost pair first.
    assert_eq!(enc("\n\n\na"), [nl2, nl, a]);
    // Spaces are `▁`, absent here: spelled in bytes (0xE2 0x96 0x81).
    assert_eq!(enc(" "), [3 + 0xE2, 3 + 0x96, 3 + 0x81]);
    assert!(burn_gemma::Tokenizer::from_bpe_vocab(vec!["a".into()], vec![1], &["ab".into()], 0).is_err());
}

/// The chat layer on a Gemma 4 model: the system turn with thinking and tools opens the
/// conversation, tool responses continue the model's turn, and models before Gemma 4 refuse
/// thinking and tools.
#[test]
fn gemma4_chat_with_thinking_and_tools() {
    use burn_gemma::chat::{ChatError, SystemTurn, Thinking, ToolDeclaration, ToolResponse};
    use burn_gemma::{Bos, Error, RequestError};
    let vocab = Gemma4Vocab::shared();
    let gguf = write_gguf("gemma4-e", Some(vocab));
    let checkpoint = Checkpoint::open(&gguf).unwrap();
    let tokenizer = checkpoint.tokenizer().unwrap();
    let device: burn::backend::ndarray::NdArrayDevice = Default::default();
    let model = checkpoint.load(common::dense_f32::<NdArray>(&device)).unwrap().model;
    let mut generator = burn_gemma::Generator::new(model, tokenizer).unwrap();
    let config = burn_gemma::GenerationConfig { max_new_tokens: 3, ..Default::default() };
    let no_responses = generator.send_tool_responses(&[], &config, |_| {});
    assert!(matches!(no_responses, Err(Error::Request(RequestError::NoToolResponses))));

    let weather = ToolDeclaration {
        name: "get_weather".into(),
        description: "Weather in a city".into(),
        parameters: serde_json::json!({"type": "object", "properties": {"city": {"type": "string"}}}),
    };
    let system = SystemTurn { instructions: Some("Be brief.".into()), thinking: Thinking::On, tools: vec![weather] };
    let expected_prompt = format!("{}<|turn>user\nWeather in Paris?<turn|>\n<|turn>model\n", system.render());
    generator.set_system(system).unwrap();
    let out = generator.chat("Weather in Paris?", &config, |_| {}).unwrap();
    let prompt_ids = generator.tokenizer().encode(&expected_prompt, Bos::Prepend).unwrap();
    assert_eq!(&generator.context()[..prompt_ids.len()], prompt_ids, "the system turn opens the conversation");
    assert!(prompt_ids.contains(&7), "<|think|> is one token");
    assert_eq!(generator.context().len(), prompt_ids.len() + out.tokens.len());

    let before = generator.context().to_vec();
    let response = ToolResponse { name: "get_weather".into(), response: serde_json::json!({"temperature": 15}) };
    let opened = before.last() == generator.tokenizer().token_id("<|tool_response>").as_ref();
    let rendered = if opened { response.render_after_open() } else { response.render() };
    let expected = generator.tokenizer().encode(&rendered, Bos::Omit).unwrap();
    generator.send_tool_responses(&[response], &config, |_| {}).unwrap();
    assert_eq!(&generator.context()[before.len()..before.len() + expected.len()], expected);
    std::fs::remove_file(gguf).ok();

    // Gemma 3: instructions yes (in the first user turn), thinking no.
    let gemma3 = common::fixtures().join("tiny-gemma/gemma3");
    let model = Checkpoint::open(&gemma3).unwrap().load(common::dense_f32::<NdArray>(&device)).unwrap().model;
    let mut generator = burn_gemma::Generator::new(model, common::tiny_tokenizer()).unwrap();
    let thinking = SystemTurn { thinking: Thinking::On, ..Default::default() };
    assert!(matches!(
        generator.set_system(thinking),
        Err(Error::Request(RequestError::Chat(ChatError::Gemma4Only { feature: "thinking" })))
    ));
    generator.set_system(SystemTurn { instructions: Some("Be brief.".into()), ..Default::default() }).unwrap();
    generator.chat("Hi", &config, |_| {}).unwrap();
    let expected = generator
        .tokenizer()
        .encode("<start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\n", Bos::Prepend)
        .unwrap();
    assert_eq!(&generator.context()[..expected.len()], expected);
}
