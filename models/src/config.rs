//! Model configuration: parsed from Hugging Face `config.json` (both the newer `rope_parameters`
//! and `layer_types` layout and the older `rope_theta` / `rope_local_base_freq` / `rope_scaling` /
//! `sliding_window_pattern` keys) or built from GGUF metadata by the loader, and validated before
//! anything is allocated.

use crate::ModelError;
use burn::config::Config;
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

/// Which Gemma generation a checkpoint belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Architecture {
    /// Gemma 1 (`model_type: gemma`).
    Gemma,
    /// Gemma 2 (`gemma2`): sandwich norms, softcapping, alternating sliding windows.
    Gemma2,
    /// Gemma 3 (`gemma3_text`, or the language model of `gemma3`): QK-norm, 5:1 local/global.
    Gemma3,
}

impl Architecture {
    /// Parses an HF `model_type` or a GGUF `general.architecture`.
    pub fn from_name(name: &str) -> Result<Self, ModelError> {
        match name {
            "gemma" => Ok(Self::Gemma),
            "gemma2" => Ok(Self::Gemma2),
            "gemma3" | "gemma3_text" => Ok(Self::Gemma3),
            other => Err(ModelError::NotGemma(other.to_string())),
        }
    }

    /// Gemma 2 and 3 normalize after attention and after the MLP as well as before.
    pub fn has_sandwich_norms(self) -> bool {
        !matches!(self, Self::Gemma)
    }

    /// Gemma 3 normalizes queries and keys per head.
    pub fn has_qk_norm(self) -> bool {
        matches!(self, Self::Gemma3)
    }
}

/// Attention kind of one decoder layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LayerType {
    /// Local attention over the last `sliding_window` positions.
    SlidingAttention,
    /// Global causal attention.
    FullAttention,
}

/// Rotary embedding of one layer type: `rope_theta`, and linear position scaling `factor`
/// (1 for none).
#[derive(Config, Debug, Copy)]
pub struct RopeConfig {
    /// Base of the rotary frequencies.
    pub rope_theta: f64,
    /// Linear scaling: positions are divided by this factor.
    #[config(default = 1.0)]
    pub factor: f64,
}

/// A resolved Gemma configuration. Field names follow HF `config.json`.
#[derive(Config, Debug)]
pub struct GemmaConfig {
    /// Model generation (HF `model_type`).
    pub model_type: Architecture,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub head_dim: usize,
    pub rms_norm_eps: f64,
    pub max_position_embeddings: usize,
    /// Attention scores are scaled by `query_pre_attn_scalar^-0.5`.
    pub query_pre_attn_scalar: f64,
    pub attn_logit_softcapping: Option<f64>,
    pub final_logit_softcapping: Option<f64>,
    /// Window of the sliding-attention layers, including the current position.
    pub sliding_window: Option<usize>,
    /// One entry per layer.
    pub layer_types: Vec<LayerType>,
    /// RoPE of the global (`full_attention`) layers.
    pub rope_full_attention: RopeConfig,
    /// RoPE of the local (`sliding_attention`) layers.
    pub rope_sliding_attention: RopeConfig,
    pub bos_token_id: u32,
    /// Tokens that end generation (`eos_token_id`, which may be a list in HF configs).
    pub eos_token_id: Vec<u32>,
}

fn invalid(field: &'static str, reason: impl Into<String>) -> ModelError {
    ModelError::InvalidConfig { field, reason: reason.into() }
}

fn get_usize(obj: &Map<String, Value>, key: &'static str) -> Result<Option<usize>, ModelError> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v
            .as_u64()
            .and_then(|n| usize::try_from(n).ok())
            .map(Some)
            .ok_or_else(|| invalid(key, format!("must be a non-negative integer, found {v}"))),
    }
}

fn require_usize(obj: &Map<String, Value>, key: &'static str) -> Result<usize, ModelError> {
    get_usize(obj, key)?.ok_or_else(|| invalid(key, "is missing"))
}

fn get_f64(obj: &Map<String, Value>, key: &'static str) -> Result<Option<f64>, ModelError> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v.as_f64().map(Some).ok_or_else(|| invalid(key, format!("must be a number, found {v}"))),
    }
}

fn get_str<'a>(obj: &'a Map<String, Value>, key: &'static str) -> Result<Option<&'a str>, ModelError> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s)),
        Some(v) => Err(invalid(key, format!("must be a string, found {v}"))),
    }
}

/// Parses one RoPE entry (`{"rope_type", "rope_theta", "factor"}`), with `theta` as fallback.
fn rope_entry(entry: Option<&Value>, theta: Option<f64>, field: &'static str) -> Result<RopeConfig, ModelError> {
    let empty = Map::new();
    let obj = match entry {
        None | Some(Value::Null) => &empty,
        Some(Value::Object(o)) => o,
        Some(v) => return Err(invalid(field, format!("must be an object, found {v}"))),
    };
    let rope_type = get_str(obj, "rope_type")?.or(get_str(obj, "type")?).unwrap_or("default");
    let factor = match rope_type {
        "default" => 1.0,
        "linear" => get_f64(obj, "factor")?.ok_or_else(|| invalid(field, "linear scaling needs `factor`"))?,
        other => return Err(ModelError::UnsupportedConfig { field, value: format!("rope_type {other:?}") }),
    };
    let rope_theta = get_f64(obj, "rope_theta")?.or(theta).unwrap_or(10_000.0);
    Ok(RopeConfig { rope_theta, factor })
}

impl GemmaConfig {
    /// Parses an HF `config.json`. A multimodal `gemma3` config is read through its `text_config`.
    pub fn from_hf_json(json: &str) -> Result<Self, ModelError> {
        let root: Value = serde_json::from_str(json)?;
        let root = root.as_object().ok_or_else(|| invalid("config", "must be a JSON object"))?;
        let top_type = get_str(root, "model_type")?.unwrap_or("");
        let (obj, model_type) = match root.get("text_config") {
            Some(Value::Object(text)) => (text, get_str(text, "model_type")?.unwrap_or("gemma3_text")),
            _ => (root, top_type),
        };
        let model_type = if model_type.is_empty() { top_type } else { model_type };
        if model_type.is_empty() {
            return Err(invalid("model_type", "is missing"));
        }
        let arch = Architecture::from_name(model_type)?;

        let activation =
            get_str(obj, "hidden_activation")?.or(get_str(obj, "hidden_act")?).unwrap_or("gelu_pytorch_tanh");
        // Gemma 1 configs say `gelu`; every Gemma checkpoint was trained with the tanh approximation,
        // which transformers also uses for them.
        if !matches!(activation, "gelu_pytorch_tanh" | "gelu_tanh" | "gelu") {
            return Err(ModelError::UnsupportedConfig { field: "hidden_activation", value: activation.to_string() });
        }
        if obj.get("tie_word_embeddings").and_then(Value::as_bool) == Some(false) {
            return Err(ModelError::UnsupportedConfig { field: "tie_word_embeddings", value: "false".into() });
        }

        let hidden_size = require_usize(obj, "hidden_size")?;
        let num_attention_heads = require_usize(obj, "num_attention_heads")?;
        let num_hidden_layers = require_usize(obj, "num_hidden_layers")?;
        let head_dim = match get_usize(obj, "head_dim")? {
            Some(d) => d,
            None if num_attention_heads > 0 => hidden_size / num_attention_heads,
            None => 0,
        };
        let sliding_window = match arch {
            Architecture::Gemma => None,
            _ => get_usize(obj, "sliding_window")?,
        };

        let layer_types = match obj.get("layer_types") {
            Some(Value::Array(items)) if arch != Architecture::Gemma => items
                .iter()
                .map(|v| match v.as_str() {
                    Some("sliding_attention") => Ok(LayerType::SlidingAttention),
                    Some("full_attention") => Ok(LayerType::FullAttention),
                    _ => Err(invalid("layer_types", format!("has unknown entry {v}"))),
                })
                .collect::<Result<Vec<_>, _>>()?,
            _ => {
                let pattern = match arch {
                    Architecture::Gemma => None,
                    Architecture::Gemma2 => Some(2),
                    Architecture::Gemma3 => Some(
                        get_usize(obj, "sliding_window_pattern")?
                            .or(get_usize(obj, "_sliding_window_pattern")?)
                            .unwrap_or(6),
                    ),
                };
                default_layer_types(num_hidden_layers, pattern)
            }
        };

        let (rope_full_attention, rope_sliding_attention) = match obj.get("rope_parameters") {
            Some(Value::Object(params))
                if params.contains_key("full_attention") || params.contains_key("sliding_attention") =>
            {
                (
                    rope_entry(params.get("full_attention"), None, "rope_parameters.full_attention")?,
                    rope_entry(params.get("sliding_attention"), None, "rope_parameters.sliding_attention")?,
                )
            }
            Some(Value::Object(_)) => {
                let rope = rope_entry(obj.get("rope_parameters"), None, "rope_parameters")?;
                (rope, rope)
            }
            _ => {
                let theta = get_f64(obj, "rope_theta")?;
                let global = rope_entry(obj.get("rope_scaling"), theta, "rope_scaling")?;
                let local = match arch {
                    Architecture::Gemma3 => RopeConfig {
                        rope_theta: get_f64(obj, "rope_local_base_freq")?.unwrap_or(10_000.0),
                        factor: 1.0,
                    },
                    _ => global,
                };
                (global, local)
            }
        };

        let eos_token_id = match obj.get("eos_token_id").or(root.get("eos_token_id")) {
            None | Some(Value::Null) => vec![1],
            Some(Value::Array(items)) => items
                .iter()
                .map(|v| {
                    v.as_u64()
                        .and_then(|n| u32::try_from(n).ok())
                        .ok_or_else(|| invalid("eos_token_id", format!("bad entry {v}")))
                })
                .collect::<Result<_, _>>()?,
            Some(v) => vec![v
                .as_u64()
                .and_then(|n| u32::try_from(n).ok())
                .ok_or_else(|| invalid("eos_token_id", format!("bad value {v}")))?],
        };
        let bos = get_usize(obj, "bos_token_id")?.or(get_usize(root, "bos_token_id")?).unwrap_or(2);

        let config = GemmaConfig {
            model_type: arch,
            vocab_size: require_usize(obj, "vocab_size")?,
            hidden_size,
            intermediate_size: require_usize(obj, "intermediate_size")?,
            num_hidden_layers,
            num_attention_heads,
            num_key_value_heads: get_usize(obj, "num_key_value_heads")?.unwrap_or(num_attention_heads),
            head_dim,
            rms_norm_eps: get_f64(obj, "rms_norm_eps")?.unwrap_or(1e-6),
            max_position_embeddings: get_usize(obj, "max_position_embeddings")?.unwrap_or(8192),
            query_pre_attn_scalar: get_f64(obj, "query_pre_attn_scalar")?.unwrap_or(head_dim as f64),
            attn_logit_softcapping: get_f64(obj, "attn_logit_softcapping")?,
            final_logit_softcapping: get_f64(obj, "final_logit_softcapping")?,
            sliding_window,
            layer_types,
            rope_full_attention,
            rope_sliding_attention,
            bos_token_id: u32::try_from(bos).map_err(|_| invalid("bos_token_id", "is too large"))?,
            eos_token_id,
        };
        config.validate()?;
        Ok(config)
    }

    /// Names accepted by [`GemmaConfig::preset`].
    pub const PRESETS: [&'static str; 5] = ["gemma3-270m", "gemma3-1b", "gemma3-4b", "gemma3-12b", "gemma3-27b"];

    /// The published configuration of a Gemma 3 text model (as in its HF `config.json`), for
    /// synthetic (random-weight) models in tests and benchmarks: `gemma3-270m`, `gemma3-1b`,
    /// `gemma3-4b`, `gemma3-12b` or `gemma3-27b`.
    pub fn preset(name: &str) -> Result<Self, ModelError> {
        // (hidden, intermediate, layers, heads, kv heads, head size, query_pre_attn_scalar,
        // sliding window, global RoPE factor, context)
        let (hidden, inter, layers, heads, kv, head_dim, scalar, window, factor, context) = match name {
            "gemma3-270m" => (640, 2048, 18, 4, 1, 256, 256, 512, None, 32_768),
            "gemma3-1b" => (1152, 6912, 26, 4, 1, 256, 256, 512, None, 32_768),
            "gemma3-4b" => (2560, 10240, 34, 8, 4, 256, 256, 1024, Some(8.0), 131_072),
            "gemma3-12b" => (3840, 15360, 48, 16, 8, 256, 256, 1024, Some(8.0), 131_072),
            "gemma3-27b" => (5376, 21504, 62, 32, 16, 128, 168, 1024, Some(8.0), 131_072),
            other => {
                return Err(ModelError::UnsupportedConfig {
                    field: "preset",
                    value: format!("{other} (known: {})", Self::PRESETS.join(", ")),
                })
            }
        };
        let full_rope = match factor {
            Some(f) => format!(r#"{{"rope_theta": 1000000.0, "rope_type": "linear", "factor": {f}}}"#),
            None => r#"{"rope_theta": 1000000.0, "rope_type": "default"}"#.to_string(),
        };
        let json = format!(
            r#"{{"model_type": "gemma3_text", "vocab_size": 262144, "hidden_size": {hidden},
            "intermediate_size": {inter}, "num_hidden_layers": {layers}, "num_attention_heads": {heads},
            "num_key_value_heads": {kv}, "head_dim": {head_dim}, "query_pre_attn_scalar": {scalar},
            "sliding_window": {window}, "_sliding_window_pattern": 6, "rms_norm_eps": 1e-6,
            "max_position_embeddings": {context}, "bos_token_id": 2, "eos_token_id": [1, 106],
            "rope_parameters": {{"full_attention": {full_rope},
                "sliding_attention": {{"rope_theta": 10000.0, "rope_type": "default"}}}}}}"#
        );
        Self::from_hf_json(&json)
    }

    /// Checks every value before anything is allocated.
    pub fn validate(&self) -> Result<(), ModelError> {
        const MAX_DIM: usize = 1 << 20;
        for (field, value) in [
            ("vocab_size", self.vocab_size),
            ("hidden_size", self.hidden_size),
            ("intermediate_size", self.intermediate_size),
            ("num_hidden_layers", self.num_hidden_layers),
            ("num_attention_heads", self.num_attention_heads),
            ("num_key_value_heads", self.num_key_value_heads),
            ("head_dim", self.head_dim),
            ("max_position_embeddings", self.max_position_embeddings),
        ] {
            if value == 0 {
                return Err(invalid(field, "must be positive"));
            }
            if value > MAX_DIM * 16 {
                return Err(invalid(field, format!("is implausibly large ({value})")));
            }
        }
        if self.hidden_size > MAX_DIM || self.intermediate_size > MAX_DIM || self.num_hidden_layers > 4096 {
            return Err(invalid("hidden_size", "or intermediate_size / num_hidden_layers is implausibly large"));
        }
        if !self.num_attention_heads.is_multiple_of(self.num_key_value_heads) {
            return Err(invalid(
                "num_key_value_heads",
                format!(
                    "({}) must divide num_attention_heads ({})",
                    self.num_key_value_heads, self.num_attention_heads
                ),
            ));
        }
        if !self.head_dim.is_multiple_of(2) {
            return Err(invalid("head_dim", format!("must be even for rotary embeddings, found {}", self.head_dim)));
        }
        if self.vocab_size.checked_mul(self.hidden_size).is_none_or(|n| n > 1 << 36) {
            return Err(invalid("vocab_size", "times hidden_size is implausibly large"));
        }
        if self.layer_types.len() != self.num_hidden_layers {
            return Err(invalid(
                "layer_types",
                format!("has {} entries for {} layers", self.layer_types.len(), self.num_hidden_layers),
            ));
        }
        if self.layer_types.contains(&LayerType::SlidingAttention) && self.sliding_window.is_none_or(|w| w == 0) {
            return Err(invalid("sliding_window", "must be a positive integer when layers use sliding attention"));
        }
        let positive = |field: &'static str, v: f64| {
            if v.is_finite() && v > 0.0 {
                Ok(())
            } else {
                Err(invalid(field, format!("must be a positive finite number, found {v}")))
            }
        };
        positive("rms_norm_eps", self.rms_norm_eps)?;
        positive("query_pre_attn_scalar", self.query_pre_attn_scalar)?;
        for (field, cap) in [
            ("attn_logit_softcapping", self.attn_logit_softcapping),
            ("final_logit_softcapping", self.final_logit_softcapping),
        ] {
            if let Some(cap) = cap {
                positive(field, cap)?;
            }
        }
        for (field, rope) in [
            ("rope_theta (full_attention)", self.rope_full_attention),
            ("rope_theta (sliding_attention)", self.rope_sliding_attention),
        ] {
            positive(field, rope.rope_theta)?;
            positive("rope factor", rope.factor)?;
        }
        if self.bos_token_id as usize >= self.vocab_size {
            return Err(invalid("bos_token_id", format!("({}) is outside the vocabulary", self.bos_token_id)));
        }
        if let Some(eos) = self.eos_token_id.iter().find(|&&e| e as usize >= self.vocab_size) {
            return Err(invalid("eos_token_id", format!("({eos}) is outside the vocabulary")));
        }
        Ok(())
    }

    /// RoPE settings of a layer type.
    pub fn rope(&self, layer_type: LayerType) -> RopeConfig {
        match layer_type {
            LayerType::FullAttention => self.rope_full_attention,
            LayerType::SlidingAttention => self.rope_sliding_attention,
        }
    }

    /// The sliding window of a layer type (`None` for global layers).
    pub fn window(&self, layer_type: LayerType) -> Option<usize> {
        match layer_type {
            LayerType::FullAttention => None,
            LayerType::SlidingAttention => self.sliding_window,
        }
    }

    /// Number of parameters (embeddings counted once: the lm_head is tied).
    pub fn num_parameters(&self) -> usize {
        let attn = self.hidden_size * self.head_dim * (2 * self.num_attention_heads + 2 * self.num_key_value_heads);
        let mlp = 3 * self.hidden_size * self.intermediate_size;
        self.vocab_size * self.hidden_size + self.num_hidden_layers * (attn + mlp)
    }
}

/// Layer types from a local:global pattern: with pattern `p`, layer `i` is global when
/// `(i + 1) % p == 0`; no pattern means every layer is global.
pub fn default_layer_types(layers: usize, pattern: Option<usize>) -> Vec<LayerType> {
    (0..layers)
        .map(|i| match pattern {
            Some(p) if p > 0 && (i + 1) % p != 0 => LayerType::SlidingAttention,
            _ => LayerType::FullAttention,
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    const FIXTURES: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../shared/fixtures/tiny-gemma");

    fn load(name: &str) -> GemmaConfig {
        let text = std::fs::read_to_string(format!("{FIXTURES}/{name}/config.json")).expect("fixture config");
        GemmaConfig::from_hf_json(&text).expect("valid config")
    }

    #[test]
    fn new_and_legacy_layouts_agree() {
        let new = load("gemma3");
        let legacy = load("gemma3-legacy-config");
        assert_eq!(new.layer_types, legacy.layer_types);
        assert_eq!(new.rope_full_attention.rope_theta, legacy.rope_full_attention.rope_theta);
        assert_eq!(new.rope_full_attention.factor, 8.0);
        assert_eq!(legacy.rope_full_attention.factor, 8.0);
        assert_eq!(new.rope_sliding_attention.rope_theta, legacy.rope_sliding_attention.rope_theta);
        assert_eq!(legacy.rope_sliding_attention.factor, 1.0);
        assert_eq!(new.layer_types[5], LayerType::FullAttention);
        assert_eq!(new.layer_types[4], LayerType::SlidingAttention);
    }

    #[test]
    fn gemma1_and_gemma2_defaults() {
        let g1 = load("gemma1");
        assert_eq!(g1.model_type, Architecture::Gemma);
        assert!(g1.layer_types.iter().all(|t| *t == LayerType::FullAttention));
        assert_eq!(g1.query_pre_attn_scalar, 16.0);
        let g2 = load("gemma2");
        assert_eq!(g2.attn_logit_softcapping, Some(50.0));
        assert_eq!(g2.layer_types[0], LayerType::SlidingAttention);
        assert_eq!(g2.layer_types[1], LayerType::FullAttention);
    }

    #[test]
    fn multimodal_config_reads_text_config() {
        let json = r#"{"model_type": "gemma3", "text_config": {"hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 16,
            "vocab_size": 300, "sliding_window": 4}, "vision_config": {"hidden_size": 32}}"#;
        let c = GemmaConfig::from_hf_json(json).unwrap();
        assert_eq!(c.model_type, Architecture::Gemma3);
        assert_eq!(c.num_key_value_heads, 1);
    }

    #[test]
    fn bad_configs_are_named() {
        let base = std::fs::read_to_string(format!("{FIXTURES}/gemma3/config.json")).unwrap();
        let edit = |key: &str, value: Value| {
            let mut v: Value = serde_json::from_str(&base).unwrap();
            v[key] = value;
            GemmaConfig::from_hf_json(&v.to_string()).unwrap_err().to_string()
        };
        assert!(edit("model_type", "llama".into()).contains("not a Gemma model"));
        assert!(edit("num_key_value_heads", 3.into()).contains("num_key_value_heads"));
        assert!(edit("hidden_size", 0.into()).contains("hidden_size"));
        assert!(edit("head_dim", 15.into()).contains("head_dim"));
        assert!(edit("rms_norm_eps", (-1.0).into()).contains("rms_norm_eps"));
        assert!(edit("vocab_size", "big".into()).contains("vocab_size"));
        assert!(edit("layer_types", serde_json::json!(["full_attention"])).contains("layer_types"));
        assert!(edit("hidden_activation", "relu".into()).contains("hidden_activation"));
        assert!(GemmaConfig::from_hf_json("[1, 2]").unwrap_err().to_string().contains("JSON object"));
        assert!(GemmaConfig::from_hf_json("{not json").unwrap_err().to_string().contains("not valid JSON"));
    }
}

#[cfg(test)]
mod preset_tests {
    use super::*;

    #[test]
    fn presets_have_the_published_sizes() {
        // Parameter counts of the published models (text weights, tied embedding).
        for (name, approx) in [
            ("gemma3-270m", 268e6),
            ("gemma3-1b", 1.0e9),
            ("gemma3-4b", 3.88e9),
            ("gemma3-12b", 11.77e9),
            ("gemma3-27b", 27.0e9),
        ] {
            let c = GemmaConfig::preset(name).unwrap();
            c.validate().unwrap();
            let n = c.num_parameters() as f64;
            assert!((n / approx - 1.0).abs() < 0.03, "{name}: {n}");
        }
        let c = GemmaConfig::preset("gemma3-4b").unwrap();
        assert_eq!((c.rope(LayerType::FullAttention).factor, c.sliding_window), (8.0, Some(1024)));
        assert!(GemmaConfig::preset("gemma3-2b").unwrap_err().to_string().contains("gemma3-1b"));
    }
}
