//! The model config from GGUF metadata: llama.cpp's keys (`{arch}.embedding_length`, ...) mapped
//! onto [`GemmaConfig`]'s HF fields, the counterpart of [`GemmaConfig::from_hf_json`] for HF
//! checkpoints. Every config made here is validated before it is returned.

use crate::gguf::{GgufFile, Value};
use burn_gemma_model::{
    config::default_layer_types,
    vision::{gemma4_config::VisionRope, Gemma4VisionConfig, SiglipConfig},
    Architecture, AssistantConfig, Gemma3VisionConfig, Gemma4ImageConfig, GemmaConfig, ImageAttention, LayerType,
    ModelError, MoeConfig, RopeConfig,
};

fn meta<'a>(file: &'a GgufFile, key: &str) -> Option<&'a Value> {
    file.get(key)
}

/// A Gemma 1-4 config from a GGUF file's metadata (and, for Gemma 4, from which tensors it
/// holds).
pub(crate) fn config_from_gguf(file: &GgufFile) -> Result<GemmaConfig, ModelError> {
    let arch_name = meta(file, "general.architecture").and_then(Value::as_str).unwrap_or("");
    let arch = Architecture::from_name(arch_name)?;
    let key = |k: &str| format!("{arch_name}.{k}");
    let uint = |k: &'static str| -> Result<Option<usize>, ModelError> {
        match meta(file, &key(k)) {
            None => Ok(None),
            Some(v) => v.as_u64().and_then(|n| usize::try_from(n).ok()).map(Some).ok_or_else(|| {
                ModelError::InvalidConfig { field: k, reason: format!("must be an unsigned integer, found {v:?}") }
            }),
        }
    };
    let required = |k: &'static str| {
        uint(k)?.ok_or(ModelError::InvalidConfig { field: k, reason: "is missing from the GGUF metadata".into() })
    };
    let float = |k: &str| meta(file, &key(k)).and_then(Value::as_f64);

    let per_layer = |k: &'static str| per_layer_values(file, arch_name, k);
    if arch == Architecture::Gemma4 {
        let config = gemma4_config_from_gguf(file, arch_name, &per_layer)?;
        config.validate()?;
        return Ok(config);
    }
    let hidden_size = required("embedding_length")?;
    let num_attention_heads = required("attention.head_count")?;
    let num_hidden_layers = required("block_count")?;
    let head_dim = match uint("attention.key_length")? {
        Some(d) => d,
        None => hidden_size / num_attention_heads.max(1),
    };
    let vocab_size = match meta(file, "tokenizer.ggml.tokens").and_then(Value::as_array) {
        Some(tokens) => tokens.len(),
        None => file.tensors().get("token_embd.weight").and_then(|t| t.shape().first().copied()).unwrap_or(0),
    };
    // GGUF does not store query_pre_attn_scalar; llama.cpp uses hidden_size / heads for the 27B
    // models (Gemma 2: 46 layers, Gemma 3: 62 layers) and head_dim otherwise.
    let is_27b = matches!((arch, num_hidden_layers), (Architecture::Gemma2, 46) | (Architecture::Gemma3, 62));
    let query_pre_attn_scalar =
        if is_27b { (hidden_size / num_attention_heads.max(1)) as f64 } else { head_dim as f64 };
    let pattern = match arch {
        Architecture::Gemma => None,
        Architecture::Gemma2 => Some(2),
        Architecture::Gemma3 | Architecture::Gemma4 => Some(uint("attention.sliding_window_pattern")?.unwrap_or(6)),
    };
    let theta = float("rope.freq_base").unwrap_or(10_000.0);
    let scaling = meta(file, &key("rope.scaling.type")).and_then(Value::as_str);
    let factor = match scaling {
        None | Some("none") => 1.0,
        Some("linear") => float("rope.scaling.factor").unwrap_or(1.0),
        Some(other) => {
            return Err(ModelError::UnsupportedConfig { field: "rope.scaling.type", value: other.to_string() })
        }
    };
    let rope_full_attention = RopeConfig { rope_theta: theta, factor, partial_rotary_factor: 1.0 };
    let rope_sliding_attention = match arch {
        // llama.cpp uses a fixed local base of 10000 for Gemma 3's sliding layers.
        Architecture::Gemma3 => RopeConfig { rope_theta: 10_000.0, factor: 1.0, partial_rotary_factor: 1.0 },
        _ => rope_full_attention,
    };
    let token = |k: &'static str, default: u32| token_id(file, k, default);
    let num_key_value_heads = uint("attention.head_count_kv")?.unwrap_or(num_attention_heads);
    let config = GemmaConfig {
        model_type: arch,
        image_attention: match arch {
            Architecture::Gemma3 => ImageAttention::BothWays,
            _ => ImageAttention::Causal,
        },
        pad_token_id: token("tokenizer.ggml.padding_token_id", 0)?,
        vocab_size,
        hidden_size,
        intermediate_size: required("feed_forward_length")?,
        num_hidden_layers,
        num_attention_heads,
        num_key_value_heads,
        head_dim,
        rms_norm_eps: float("attention.layer_norm_rms_epsilon").unwrap_or(1e-6),
        max_position_embeddings: uint("context_length")?.unwrap_or(8192),
        query_pre_attn_scalar,
        attn_logit_softcapping: float("attn_logit_softcapping"),
        final_logit_softcapping: float("final_logit_softcapping"),
        sliding_window: if arch == Architecture::Gemma { None } else { uint("attention.sliding_window")? },
        layer_types: default_layer_types(num_hidden_layers, pattern)?,
        rope_full_attention,
        rope_sliding_attention,
        bos_token_id: token("tokenizer.ggml.bos_token_id", 2)?,
        eos_token_id: vec![token("tokenizer.ggml.eos_token_id", 1)?],
        global_head_dim: head_dim,
        num_global_key_value_heads: num_key_value_heads,
        attention_k_eq_v: false,
        num_kv_shared_layers: 0,
        use_double_wide_mlp: false,
        hidden_size_per_layer_input: 0,
        vocab_size_per_layer_input: 0,
        moe: None,
    };
    config.validate()?;
    Ok(config)
}

/// A per-layer value (Gemma 4 writes some keys as one entry per layer): its entries, one for a
/// single value.
fn per_layer_values(file: &GgufFile, arch_name: &str, k: &'static str) -> Result<Option<Vec<usize>>, ModelError> {
    match meta(file, &format!("{arch_name}.{k}")) {
        None => Ok(None),
        Some(Value::Array(items)) => items
            .iter()
            .map(|v| v.as_u64().and_then(|n| usize::try_from(n).ok()))
            .collect::<Option<Vec<_>>>()
            .filter(|v| !v.is_empty())
            .map(Some)
            .ok_or(ModelError::InvalidConfig { field: k, reason: "must be unsigned integers".into() }),
        Some(v) => v.as_u64().and_then(|n| usize::try_from(n).ok()).map(|n| Some(vec![n])).ok_or_else(|| {
            ModelError::InvalidConfig { field: k, reason: format!("must be an unsigned integer, found {v:?}") }
        }),
    }
}

/// A Gemma 4 assistant's config from llama.cpp's `gemma4-assistant` metadata: the Gemma 4 keys
/// of its stack, `embedding_length_out` the target's hidden size. llama.cpp's converter leaves
/// out the masked lm_head (`masked_embedding.*`), so the lm_head is the whole table, as
/// llama.cpp runs it.
pub(crate) fn assistant_config_from_gguf(file: &GgufFile) -> Result<AssistantConfig, ModelError> {
    let arch_name = "gemma4-assistant";
    let per_layer = |k: &'static str| per_layer_values(file, arch_name, k);
    let mut text = gemma4_config_from_gguf(file, arch_name, &per_layer)?;
    text.num_kv_shared_layers = text.num_hidden_layers;
    let field = "embedding_length_out";
    let backbone_hidden_size = meta(file, &format!("{arch_name}.{field}"))
        .and_then(Value::as_u64)
        .and_then(|n| usize::try_from(n).ok())
        .ok_or(ModelError::InvalidConfig { field, reason: "is missing from the GGUF metadata".into() })?;
    let config = AssistantConfig { text, backbone_hidden_size, ordered_embeddings: None };
    config.validate()?;
    Ok(config)
}

/// A Gemma 4 config from llama.cpp's `gemma4` metadata: head sizes `key_length` (full layers)
/// and `key_length_swa`, KV heads and MLP widths per layer, the sliding pattern as one flag per
/// layer, `shared_kv_layers`, `embedding_length_per_layer_input`, the expert counts; the share
/// of rotating pairs from the `rope_freqs` tensor (1 for a rotating pair, 1e30 for one left as
/// it is), and the full layers' values-from-keys from the missing `attn_v` tensors. Not yet
/// validated: a model and an assistant validate it each as theirs.
fn gemma4_config_from_gguf(
    file: &GgufFile,
    arch_name: &str,
    per_layer: &dyn Fn(&'static str) -> Result<Option<Vec<usize>>, ModelError>,
) -> Result<GemmaConfig, ModelError> {
    let key = |k: &str| format!("{arch_name}.{k}");
    let float = |k: &str| meta(file, &key(k)).and_then(Value::as_f64);
    let missing =
        |field: &'static str| ModelError::InvalidConfig { field, reason: "is missing from the GGUF metadata".into() };
    let first = |field: &'static str| -> Result<usize, ModelError> {
        per_layer(field)?.and_then(|v| v.first().copied()).ok_or_else(|| missing(field))
    };
    let hidden_size = first("embedding_length")?;
    let num_attention_heads = first("attention.head_count")?;
    let num_hidden_layers = first("block_count")?;
    let global_head_dim = first("attention.key_length")?;
    let head_dim = per_layer("attention.key_length_swa")?.and_then(|v| v.first().copied()).unwrap_or(global_head_dim);
    let field = "attention.sliding_window_pattern";
    let layer_types: Vec<LayerType> = match meta(file, &key(field)) {
        Some(Value::Array(flags)) => flags
            .iter()
            .map(|f| match f {
                Value::Bool(true) => Ok(LayerType::SlidingAttention),
                Value::Bool(false) => Ok(LayerType::FullAttention),
                other => Err(ModelError::InvalidConfig { field, reason: format!("has a non-boolean entry {other:?}") }),
            })
            .collect::<Result<_, _>>()?,
        _ => return Err(missing(field)),
    };
    let kv_heads = per_layer("attention.head_count_kv")?.unwrap_or_else(|| vec![num_attention_heads]);
    let kv_of = |kind: LayerType| {
        let at = layer_types.iter().position(|t| *t == kind);
        at.and_then(|i| kv_heads.get(i)).or(kv_heads.first()).copied().unwrap_or(num_attention_heads)
    };
    let widths = per_layer("feed_forward_length")?.ok_or_else(|| missing("feed_forward_length"))?;
    let intermediate_size = *widths.first().ok_or_else(|| missing("feed_forward_length"))?;
    let shared = meta(file, &key("attention.shared_kv_layers")).and_then(Value::as_u64).unwrap_or(0) as usize;
    let use_double_wide_mlp = widths.last().is_some_and(|&w| w == 2 * intermediate_size) && widths.len() > 1;
    let per_layer_width =
        meta(file, &key("embedding_length_per_layer_input")).and_then(Value::as_u64).unwrap_or(0) as usize;
    let vocab_size = match meta(file, "tokenizer.ggml.tokens").and_then(Value::as_array) {
        Some(tokens) => tokens.len(),
        None => file.tensors().get("token_embd.weight").and_then(|t| t.shape().first().copied()).unwrap_or(0),
    };
    let vocab_size_per_layer_input =
        file.tensors().get("per_layer_token_embd.weight").and_then(|t| t.shape().first().copied()).unwrap_or(0);
    // Full layers with keys of their own but no `attn_v`: their values are the keys.
    let first_shared = num_hidden_layers.saturating_sub(shared);
    let attention_k_eq_v = layer_types.iter().take(first_shared).enumerate().any(|(i, t)| {
        *t == LayerType::FullAttention
            && file.tensors().contains_key(&format!("blk.{i}.attn_k.weight"))
            && !file.tensors().contains_key(&format!("blk.{i}.attn_v.weight"))
    });
    let partial_rotary_factor = match file.tensors().get("rope_freqs.weight") {
        Some(_) => {
            let factors = file.dequantize("rope_freqs.weight").map_err(|e| ModelError::Source(Box::new(e)))?;
            let rotated = factors.iter().filter(|f| **f < 1e10).count();
            2.0 * rotated as f64 / global_head_dim.max(1) as f64
        }
        None => 1.0,
    };
    let moe = match meta(file, &key("expert_count")).and_then(Value::as_u64) {
        Some(experts) if experts > 0 => Some(MoeConfig {
            num_experts: experts as usize,
            top_k_experts: meta(file, &key("expert_used_count"))
                .and_then(Value::as_u64)
                .ok_or_else(|| missing("expert_used_count"))? as usize,
            moe_intermediate_size: first("expert_feed_forward_length")?,
        }),
        _ => None,
    };
    let token = |k: &'static str, default: u32| token_id(file, k, default);
    let config = GemmaConfig {
        model_type: Architecture::Gemma4,
        // The files do not say; as llama.cpp's mtmd decides: causal for the E models (per-layer
        // inputs), both ways on the sliding layers for the others.
        image_attention: if per_layer_width > 0 {
            ImageAttention::Causal
        } else {
            ImageAttention::BothWaysOnSlidingLayers
        },
        pad_token_id: token("tokenizer.ggml.padding_token_id", 0)?,
        vocab_size,
        hidden_size,
        intermediate_size,
        num_hidden_layers,
        num_attention_heads,
        num_key_value_heads: kv_of(LayerType::SlidingAttention),
        head_dim,
        global_head_dim,
        num_global_key_value_heads: kv_of(LayerType::FullAttention),
        rms_norm_eps: float("attention.layer_norm_rms_epsilon").unwrap_or(1e-6),
        max_position_embeddings: first("context_length").unwrap_or(131_072),
        query_pre_attn_scalar: 1.0,
        attn_logit_softcapping: None,
        final_logit_softcapping: float("final_logit_softcapping"),
        sliding_window: Some(first("attention.sliding_window")?),
        layer_types,
        rope_full_attention: RopeConfig {
            rope_theta: float("rope.freq_base").unwrap_or(1_000_000.0),
            factor: 1.0,
            partial_rotary_factor,
        },
        rope_sliding_attention: RopeConfig {
            rope_theta: float("rope.freq_base_swa").unwrap_or(10_000.0),
            factor: 1.0,
            partial_rotary_factor: 1.0,
        },
        bos_token_id: token("tokenizer.ggml.bos_token_id", 2)?,
        eos_token_id: vec![token("tokenizer.ggml.eos_token_id", 1)?],
        attention_k_eq_v,
        num_kv_shared_layers: shared,
        use_double_wide_mlp,
        hidden_size_per_layer_input: per_layer_width,
        vocab_size_per_layer_input,
        moe,
    };
    Ok(config)
}

/// A token id of the GGUF metadata (`default` where the key is absent); ids past `u32` are
/// refused rather than truncated (the config's validation checks them against the vocabulary).
fn token_id(file: &GgufFile, key: &'static str, default: u32) -> Result<u32, ModelError> {
    match meta(file, key).map(|v| (v, v.as_u64())) {
        None => Ok(default),
        Some((_, Some(id))) => u32::try_from(id)
            .map_err(|_| ModelError::InvalidConfig { field: key, reason: format!("is {id}, past any token id") }),
        Some((v, None)) => {
            Err(ModelError::InvalidConfig { field: key, reason: format!("must be an unsigned integer, found {v:?}") })
        }
    }
}

/// A projector GGUF's vision projector type (`gemma3`, `gemma4v`, ...; empty where it has none).
pub(crate) fn projector_type(file: &GgufFile) -> &str {
    meta(file, "clip.vision.projector_type")
        .or_else(|| meta(file, "clip.projector_type"))
        .and_then(Value::as_str)
        .unwrap_or("")
}

/// A projector GGUF's required unsigned metadata value.
fn clip_uint(file: &GgufFile, field: &'static str) -> Result<usize, ModelError> {
    meta(file, field)
        .and_then(Value::as_u64)
        .and_then(|n| usize::try_from(n).ok())
        .ok_or(ModelError::InvalidConfig { field, reason: "is missing from the GGUF metadata".into() })
}

/// Gemma 3's vision config from llama.cpp's projector GGUF (`mmproj`, `clip.projector_type`
/// `gemma3`): the tower's `clip.vision.*` keys, the pooling from `projector.scale_factor`
/// (patches per soft token along a side, 4 by default), the text width from
/// `mm.input_projection`; the image token ids are the text model's (`ids`: `<start_of_image>`,
/// `<end_of_image>`, `<image_soft_token>`).
pub(crate) fn gemma3_vision_config_from_gguf(
    file: &GgufFile,
    (boi, eoi, image): (u32, u32, u32),
) -> Result<Gemma3VisionConfig, ModelError> {
    let projector = projector_type(file);
    if projector != "gemma3" {
        return Err(ModelError::UnsupportedConfig {
            field: "clip.projector_type",
            value: format!("{projector:?} (Gemma 3's projector is \"gemma3\")"),
        });
    }
    let uint = |field: &'static str| clip_uint(file, field);
    let vision = SiglipConfig {
        hidden_size: uint("clip.vision.embedding_length")?,
        intermediate_size: uint("clip.vision.feed_forward_length")?,
        num_hidden_layers: uint("clip.vision.block_count")?,
        num_attention_heads: uint("clip.vision.attention.head_count")?,
        num_channels: 3,
        image_size: uint("clip.vision.image_size")?,
        patch_size: uint("clip.vision.patch_size")?,
        layer_norm_eps: meta(file, "clip.vision.attention.layer_norm_epsilon").and_then(Value::as_f64).unwrap_or(1e-6),
        hidden_act: "gelu_pytorch_tanh".into(),
        vision_use_head: false,
    };
    let scale = meta(file, "clip.vision.projector.scale_factor").and_then(Value::as_u64).unwrap_or(4) as usize;
    let side = vision.patches_per_side() / scale.max(1);
    let text_hidden_size = file
        .tensors()
        .get("mm.input_projection.weight")
        .and_then(|t| t.shape().get(1).copied())
        .ok_or(ModelError::MissingTensor("mm.input_projection.weight".into()))?;
    let config = Gemma3VisionConfig {
        vision,
        mm_tokens_per_image: side * side,
        image_token_index: image,
        boi_token_index: boi,
        eoi_token_index: eoi,
        text_hidden_size,
    };
    config.validate()?;
    Ok(config)
}

/// A Gemma 4 vision tower's config from llama.cpp's projector GGUF (`gemma4v`), with the text
/// model's image tokens `(boi, eoi, image)`. The file records the tower's sizes; what it does not
/// (llama.cpp fixes them in `clip.cpp`: RoPE theta 100, the GELU, a pooling kernel of 3 unless
/// `clip.vision.projector.scale_factor` says otherwise) is taken as llama.cpp takes it, and the
/// head size, key-value heads, position table, clipped linears and standardization follow from
/// the tensors the file holds.
pub(crate) fn gemma4_vision_config_from_gguf(
    file: &GgufFile,
    (boi, eoi, image): (u32, u32, u32),
) -> Result<Gemma4ImageConfig, ModelError> {
    let projector = projector_type(file);
    if projector != "gemma4v" {
        return Err(ModelError::UnsupportedConfig {
            field: "clip.vision.projector_type",
            value: format!("{projector:?} (Gemma 4's vision projector is \"gemma4v\")"),
        });
    }
    let uint = |field: &'static str| clip_uint(file, field);
    let dim = |tensor: &'static str, axis: usize| -> Result<usize, ModelError> {
        file.tensors()
            .get(tensor)
            .and_then(|t| t.shape().get(axis).copied())
            .ok_or(ModelError::MissingTensor(tensor.into()))
    };
    let heads = uint("clip.vision.attention.head_count")?;
    // The per-head query norm holds one weight per head dimension; the keys' rows are a head's
    // worth per key-value head.
    let head_dim = dim("v.blk.0.attn_q_norm.weight", 0)?;
    let kv_rows = dim("v.blk.0.attn_k.weight", 0)?;
    if head_dim == 0 || !kv_rows.is_multiple_of(head_dim) {
        return Err(ModelError::InvalidConfig {
            field: "v.blk.0.attn_k.weight",
            reason: format!("{kv_rows} rows are not whole heads of {head_dim}"),
        });
    }
    let vision = Gemma4VisionConfig {
        hidden_size: uint("clip.vision.embedding_length")?,
        intermediate_size: uint("clip.vision.feed_forward_length")?,
        num_hidden_layers: uint("clip.vision.block_count")?,
        num_attention_heads: heads,
        num_key_value_heads: kv_rows / head_dim,
        head_dim,
        hidden_activation: "gelu_pytorch_tanh".into(),
        rms_norm_eps: meta(file, "clip.vision.attention.layer_norm_epsilon").and_then(Value::as_f64).unwrap_or(1e-6),
        rope_parameters: VisionRope::default(),
        pooling_kernel_size: meta(file, "clip.vision.projector.scale_factor").and_then(Value::as_u64).unwrap_or(3)
            as usize,
        patch_size: uint("clip.vision.patch_size")?,
        position_embedding_size: dim("v.position_embd.weight", 1)?,
        use_clipped_linears: file.tensors().contains_key("v.blk.0.attn_q.input_min"),
        standardize: file.tensors().contains_key("v.std_bias"),
    };
    let config = Gemma4ImageConfig {
        vision,
        image_token_id: image,
        boi_token_id: boi,
        eoi_token_id: eoi,
        // The embedder's projection is a linear layer `[text hidden, vision hidden]`.
        text_hidden_size: dim("mm.input_projection.weight", 0)?,
    };
    config.validate()?;
    Ok(config)
}
