//! Hugging Face `config.json` as serde structs, and their resolution into [`GemmaConfig`] by
//! `TryFrom`.
//!
//! [`HfConfig`] mirrors the keys HF writes for Gemma 1-4 text models (both the newer
//! `rope_parameters` / `layer_types` layout and the older `rope_theta` / `rope_local_base_freq` /
//! `rope_scaling` / `sliding_window_pattern` keys); every key is optional here, and the
//! `TryFrom` fills HF's defaults, refuses what this crate does not implement and validates the
//! result. A value of the wrong type is refused while parsing, with the key's path in the error
//! (`ModelError::ConfigValue`).

use crate::config::{
    default_layer_types, invalid, Architecture, GemmaConfig, ImageAttention, LayerType, MoeConfig, RopeConfig,
};
use crate::ModelError;
use serde::Deserialize;
use std::collections::BTreeMap;

/// A `config.json`: a text config at the top level, or a multimodal one whose language model is
/// in `text_config`.
#[derive(Debug, Clone, PartialEq)]
pub struct HfConfig {
    /// The top level's `model_type` (`gemma3`, `gemma4` for multimodal configs).
    pub model_type: Option<String>,
    /// The text model's keys: `text_config` where there is one, else the top level.
    pub text: HfTextConfig,
    /// Whether the keys came from `text_config`.
    pub nested: bool,
    /// Token ids that multimodal configs keep at the top level.
    pub bos_token_id: Option<u32>,
    pub eos_token_id: Option<TokenIds>,
}

/// `eos_token_id`: one id or a list.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(untagged, expecting = "a token id or a list of token ids")]
pub enum TokenIds {
    One(u32),
    Many(Vec<u32>),
}

impl TokenIds {
    fn into_vec(self) -> Vec<u32> {
        match self {
            Self::One(id) => vec![id],
            Self::Many(ids) => ids,
        }
    }
}

/// `use_bidirectional_attention`: a flag in Gemma 3 (embedding models), a mode in Gemma 4.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(untagged, expecting = "true, false, \"vision\" or \"all\"")]
pub enum Bidirectional {
    Flag(bool),
    Mode(String),
}

impl Bidirectional {
    /// Whether text tokens attend both ways (`"vision"` only concerns image tokens).
    fn text_is_bidirectional(&self) -> bool {
        match self {
            Self::Flag(on) => *on,
            Self::Mode(mode) => mode != "vision",
        }
    }
}

/// One RoPE entry (`rope_scaling`, or an entry of `rope_parameters`).
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(default, expecting = "a RoPE object")]
pub struct HfRope {
    pub rope_type: Option<String>,
    /// The older spelling of `rope_type`.
    #[serde(rename = "type")]
    pub kind: Option<String>,
    pub rope_theta: Option<f64>,
    pub factor: Option<f64>,
    pub partial_rotary_factor: Option<f64>,
}

/// `rope_parameters`: one entry per layer type, or one entry for every layer. The single entry's
/// keys are spelled out rather than flattened from [`HfRope`]: serde's `flatten` would drop the
/// key from the path a wrong type is reported at (`rope_parameters` for
/// `rope_parameters.factor`).
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(default, expecting = "a RoPE object")]
pub struct HfRopeParameters {
    pub full_attention: Option<HfRope>,
    pub sliding_attention: Option<HfRope>,
    pub rope_type: Option<String>,
    #[serde(rename = "type")]
    pub kind: Option<String>,
    pub rope_theta: Option<f64>,
    pub factor: Option<f64>,
    pub partial_rotary_factor: Option<f64>,
}

/// Gemma 4's `per_layer_config` entry: the shape a (full) layer overrides.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct HfLayerOverride {
    pub head_dim: Option<usize>,
    pub num_key_value_heads: Option<usize>,
}

/// The keys of a Gemma text config, named as HF names them. Keys this crate does not read are
/// ignored.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(default, expecting = "a JSON object")]
pub struct HfTextConfig {
    pub model_type: Option<String>,
    pub vocab_size: Option<usize>,
    pub hidden_size: Option<usize>,
    pub intermediate_size: Option<usize>,
    pub num_hidden_layers: Option<usize>,
    pub num_attention_heads: Option<usize>,
    pub num_key_value_heads: Option<usize>,
    pub head_dim: Option<usize>,
    pub hidden_activation: Option<String>,
    pub hidden_act: Option<String>,
    pub tie_word_embeddings: Option<bool>,
    pub rms_norm_eps: Option<f64>,
    pub max_position_embeddings: Option<usize>,
    pub query_pre_attn_scalar: Option<f64>,
    pub attn_logit_softcapping: Option<f64>,
    pub final_logit_softcapping: Option<f64>,
    pub sliding_window: Option<usize>,
    pub sliding_window_pattern: Option<usize>,
    #[serde(rename = "_sliding_window_pattern")]
    pub sliding_window_pattern_private: Option<usize>,
    pub layer_types: Option<Vec<LayerType>>,
    pub rope_parameters: Option<HfRopeParameters>,
    pub rope_theta: Option<f64>,
    pub rope_scaling: Option<HfRope>,
    pub rope_local_base_freq: Option<f64>,
    pub bos_token_id: Option<u32>,
    pub eos_token_id: Option<TokenIds>,
    pub pad_token_id: Option<u32>,
    // Gemma 4.
    pub global_head_dim: Option<usize>,
    pub num_global_key_value_heads: Option<usize>,
    pub attention_k_eq_v: Option<bool>,
    pub per_layer_config: Option<BTreeMap<String, HfLayerOverride>>,
    pub use_bidirectional_attention: Option<Bidirectional>,
    pub num_kv_shared_layers: Option<usize>,
    pub use_double_wide_mlp: Option<bool>,
    pub hidden_size_per_layer_input: Option<usize>,
    pub vocab_size_per_layer_input: Option<usize>,
    pub enable_moe_block: Option<bool>,
    pub num_experts: Option<usize>,
    pub top_k_experts: Option<usize>,
    pub moe_intermediate_size: Option<usize>,
}

/// The keys read from the top level of a multimodal config.
#[derive(Default, Deserialize)]
#[serde(default, expecting = "a JSON object")]
struct HfRoot {
    model_type: Option<String>,
    bos_token_id: Option<u32>,
    eos_token_id: Option<TokenIds>,
}

/// A value of the wrong type, named by its path in the JSON.
fn at_path(e: serde_path_to_error::Error<serde_json::Error>, prefix: &str) -> ModelError {
    let path = e.path().to_string();
    let inner = e.into_inner();
    if !inner.is_data() {
        return ModelError::ConfigJson(inner);
    }
    let path = match (prefix, path.as_str()) {
        (_, ".") => prefix.trim_end_matches('.').to_string(),
        ("", p) => p.to_string(),
        (pre, p) => format!("{pre}{p}"),
    };
    let path = if path.is_empty() { "config".to_string() } else { path };
    ModelError::ConfigValue { path, reason: inner.to_string() }
}

impl HfConfig {
    /// Parses a `config.json`. Fails on invalid JSON, on a top level that is not an object, and on
    /// a known key whose value has the wrong type (naming the key).
    pub fn from_json(json: &str) -> Result<Self, ModelError> {
        let value: serde_json::Value = serde_json::from_str(json)?;
        if !value.is_object() {
            return Err(ModelError::InvalidConfig { field: "config", reason: "must be a JSON object".into() });
        }
        let root: HfRoot = serde_path_to_error::deserialize(&value).map_err(|e| at_path(e, ""))?;
        match value.get("text_config").filter(|t| t.is_object()) {
            Some(text) => Ok(Self {
                model_type: root.model_type,
                text: serde_path_to_error::deserialize(text).map_err(|e| at_path(e, "text_config."))?,
                nested: true,
                bos_token_id: root.bos_token_id,
                eos_token_id: root.eos_token_id,
            }),
            None => Ok(Self {
                model_type: root.model_type,
                text: serde_path_to_error::deserialize(&value).map_err(|e| at_path(e, ""))?,
                nested: false,
                bos_token_id: None,
                eos_token_id: None,
            }),
        }
    }
}

fn missing(field: &'static str, value: Option<usize>) -> Result<usize, ModelError> {
    value.ok_or_else(|| invalid(field, "is missing"))
}

impl HfRope {
    /// Resolves one RoPE entry, with `theta` as the fallback base.
    fn resolve(&self, theta: Option<f64>, field: &'static str) -> Result<RopeConfig, ModelError> {
        let rope_type = self.rope_type.as_deref().or(self.kind.as_deref()).unwrap_or("default");
        let partial = self.partial_rotary_factor;
        let (factor, partial_rotary_factor) = match rope_type {
            "default" => (1.0, 1.0),
            "linear" => (self.factor.ok_or_else(|| invalid(field, "linear scaling needs `factor`"))?, 1.0),
            // Frequencies over the full head size, the pairs past the rotated share left as they are.
            "proportional" => (self.factor.unwrap_or(1.0), partial.unwrap_or(1.0)),
            other => return Err(ModelError::UnsupportedConfig { field, value: format!("rope_type {other:?}") }),
        };
        if rope_type != "proportional" && partial.is_some_and(|p| p != 1.0) {
            return Err(ModelError::UnsupportedConfig {
                field,
                value: format!("partial_rotary_factor with rope_type {rope_type:?} (only `proportional` takes it)"),
            });
        }
        let rope_theta = self.rope_theta.or(theta).unwrap_or(10_000.0);
        Ok(RopeConfig { rope_theta, factor, partial_rotary_factor })
    }
}

impl HfRopeParameters {
    fn per_type(&self) -> bool {
        self.full_attention.is_some() || self.sliding_attention.is_some()
    }

    fn single(&self) -> HfRope {
        HfRope {
            rope_type: self.rope_type.clone(),
            kind: self.kind.clone(),
            rope_theta: self.rope_theta,
            factor: self.factor,
            partial_rotary_factor: self.partial_rotary_factor,
        }
    }
}

impl HfTextConfig {
    /// The head size and KV heads of Gemma 4's full layers: from `per_layer_config` (which 5.23
    /// writes: one override, the same for every full layer and none for sliding layers), else
    /// `global_head_dim` (default 512) and `num_global_key_value_heads` (read where
    /// `attention_k_eq_v`, as HF does).
    fn gemma4_full_shape(
        &self,
        layer_types: &[LayerType],
        base: (usize, usize),
        k_eq_v: bool,
    ) -> Result<(usize, usize), ModelError> {
        let field = "per_layer_config";
        let Some(per_layer) = &self.per_layer_config else {
            let head_dim = self.global_head_dim.unwrap_or(512);
            let kv_heads = if k_eq_v { self.num_global_key_value_heads } else { None };
            return Ok((head_dim, kv_heads.unwrap_or(base.1)));
        };
        let mut full_shape: Option<(usize, usize)> = None;
        for (key, entry) in per_layer {
            let index: usize =
                key.parse().map_err(|_| invalid(field, format!("has key {key:?}, not a layer index")))?;
            match layer_types.get(index) {
                Some(LayerType::FullAttention) => {}
                Some(LayerType::SlidingAttention) => {
                    return Err(ModelError::UnsupportedConfig {
                        field,
                        value: format!("override of sliding layer {index} (only full layers differ)"),
                    })
                }
                None => return Err(invalid(field, format!("names layer {index} of {}", layer_types.len()))),
            }
            let shape = (entry.head_dim.unwrap_or(base.0), entry.num_key_value_heads.unwrap_or(base.1));
            if full_shape.is_some_and(|s| s != shape) {
                return Err(invalid(field, "gives the full layers different shapes"));
            }
            full_shape = Some(shape);
        }
        let full_layers = layer_types.iter().filter(|t| **t == LayerType::FullAttention).count();
        if full_shape.is_some() && per_layer.len() != full_layers {
            return Err(invalid(field, format!("overrides {} of the {full_layers} full layers", per_layer.len())));
        }
        Ok(full_shape.unwrap_or(base))
    }

    /// RoPE of the (full, sliding) layers.
    fn ropes(&self, arch: Architecture) -> Result<(RopeConfig, RopeConfig), ModelError> {
        match &self.rope_parameters {
            None if arch == Architecture::Gemma4 => Ok((
                RopeConfig { rope_theta: 1_000_000.0, factor: 1.0, partial_rotary_factor: 0.25 },
                RopeConfig { rope_theta: 10_000.0, factor: 1.0, partial_rotary_factor: 1.0 },
            )),
            Some(params) if params.per_type() => Ok((
                params.full_attention.clone().unwrap_or_default().resolve(None, "rope_parameters.full_attention")?,
                params
                    .sliding_attention
                    .clone()
                    .unwrap_or_default()
                    .resolve(None, "rope_parameters.sliding_attention")?,
            )),
            Some(params) => {
                let rope = params.single().resolve(None, "rope_parameters")?;
                Ok((rope, rope))
            }
            None => {
                let global = self.rope_scaling.clone().unwrap_or_default().resolve(self.rope_theta, "rope_scaling")?;
                let local = match arch {
                    Architecture::Gemma3 => RopeConfig {
                        rope_theta: self.rope_local_base_freq.unwrap_or(10_000.0),
                        factor: 1.0,
                        partial_rotary_factor: 1.0,
                    },
                    _ => global,
                };
                Ok((global, local))
            }
        }
    }

    fn layer_types(&self, arch: Architecture, layers: usize) -> Result<Vec<LayerType>, ModelError> {
        let layer_types = match (&self.layer_types, arch) {
            (Some(types), arch) if arch != Architecture::Gemma => types.clone(),
            _ => {
                let pattern = match arch {
                    Architecture::Gemma => None,
                    Architecture::Gemma2 => Some(2),
                    Architecture::Gemma4 => Some(6),
                    Architecture::Gemma3 => {
                        Some(self.sliding_window_pattern.or(self.sliding_window_pattern_private).unwrap_or(6))
                    }
                };
                default_layer_types(layers, pattern)?
            }
        };
        if layer_types.len() != layers {
            return Err(invalid("layer_types", format!("has {} entries for {layers} layers", layer_types.len())));
        }
        if arch == Architecture::Gemma4 && layer_types.last() != Some(&LayerType::FullAttention) {
            return Err(invalid(
                "layer_types",
                "must end with a full_attention layer (Gemma 4's last layer is global)",
            ));
        }
        Ok(layer_types)
    }
}

impl TryFrom<HfConfig> for GemmaConfig {
    type Error = ModelError;

    fn try_from(hf: HfConfig) -> Result<Self, ModelError> {
        let config = resolve(hf)?;
        config.validate()?;
        Ok(config)
    }
}

/// The [`GemmaConfig`] an HF config describes, HF's defaults filled in, not yet validated (a
/// Gemma 4 assistant's text config is validated as one: [`crate::KvSource::Target`]).
pub(crate) fn resolve(hf: HfConfig) -> Result<GemmaConfig, ModelError> {
    let top_type = hf.model_type.as_deref().unwrap_or("");
    let c = &hf.text;
    let model_type = match c.model_type.as_deref() {
        Some(t) if !t.is_empty() => t,
        _ if hf.nested && top_type == "gemma4" => "gemma4_text",
        _ if hf.nested && top_type == "gemma4_unified" => "gemma4_unified_text",
        _ if hf.nested => "gemma3_text",
        _ => top_type,
    };
    // Gemma 4 12B's config class: other defaults, no per-layer inputs, no experts.
    let unified = model_type.starts_with("gemma4_unified");
    if model_type.is_empty() {
        return Err(invalid("model_type", "is missing"));
    }
    let arch = Architecture::from_name(model_type)?;
    let gemma4 = arch == Architecture::Gemma4;

    let activation = c.hidden_activation.as_deref().or(c.hidden_act.as_deref()).unwrap_or("gelu_pytorch_tanh");
    // Gemma 1 configs say `gelu`; every Gemma checkpoint was trained with the tanh approximation,
    // which transformers also uses for them.
    if !matches!(activation, "gelu_pytorch_tanh" | "gelu_tanh" | "gelu") {
        return Err(ModelError::UnsupportedConfig { field: "hidden_activation", value: activation.to_string() });
    }
    if c.tie_word_embeddings == Some(false) {
        return Err(ModelError::UnsupportedConfig { field: "tie_word_embeddings", value: "false".into() });
    }
    if let Some(mode) = c.use_bidirectional_attention.as_ref().filter(|m| m.text_is_bidirectional()) {
        let mode = match mode {
            Bidirectional::Flag(on) => on.to_string(),
            Bidirectional::Mode(mode) => format!("{mode:?}"),
        };
        return Err(ModelError::UnsupportedConfig {
            field: "use_bidirectional_attention",
            value: format!("{mode} (text generation is causal)"),
        });
    }

    let hidden_size = missing("hidden_size", c.hidden_size)?;
    let num_attention_heads = missing("num_attention_heads", c.num_attention_heads)?;
    let num_hidden_layers = missing("num_hidden_layers", c.num_hidden_layers)?;
    let head_dim = match c.head_dim {
        Some(d) => d,
        None if num_attention_heads > 0 => hidden_size / num_attention_heads,
        None => 0,
    };
    let layer_types = c.layer_types(arch, num_hidden_layers)?;
    let (rope_full_attention, rope_sliding_attention) = c.ropes(arch)?;
    let num_key_value_heads = c.num_key_value_heads.unwrap_or(num_attention_heads);
    let attention_k_eq_v = gemma4 && c.attention_k_eq_v == Some(true);
    let (global_head_dim, num_global_key_value_heads) = if gemma4 {
        c.gemma4_full_shape(&layer_types, (head_dim, num_key_value_heads), attention_k_eq_v)?
    } else {
        (head_dim, num_key_value_heads)
    };
    if unified {
        for (field, present) in [
            ("hidden_size_per_layer_input", c.hidden_size_per_layer_input.is_some_and(|w| w > 0)),
            ("enable_moe_block", c.enable_moe_block == Some(true)),
        ] {
            if present {
                return Err(ModelError::UnsupportedConfig {
                    field,
                    value: format!("in a {model_type} config (that model has none)"),
                });
            }
        }
    }
    let moe = if gemma4 && c.enable_moe_block == Some(true) {
        let need = |key: &'static str, v: Option<usize>| {
            v.ok_or_else(|| invalid(key, "is missing (enable_moe_block is true)"))
        };
        Some(MoeConfig {
            num_experts: need("num_experts", c.num_experts)?,
            top_k_experts: need("top_k_experts", c.top_k_experts)?,
            moe_intermediate_size: need("moe_intermediate_size", c.moe_intermediate_size)?,
        })
    } else {
        None
    };
    // HF's Gemma 4 text config defaults to 256-wide per-layer inputs; Gemma 4 12B has none.
    let per_layer_width = match (gemma4, unified) {
        (true, false) => c.hidden_size_per_layer_input.unwrap_or(256),
        _ => 0,
    };
    // The table's rows only matter where there is a table.
    let per_layer_rows = if per_layer_width > 0 { c.vocab_size_per_layer_input.unwrap_or(262_144) } else { 0 };

    let config = GemmaConfig {
        model_type: arch,
        vocab_size: missing("vocab_size", c.vocab_size)?,
        hidden_size,
        intermediate_size: missing("intermediate_size", c.intermediate_size)?,
        num_hidden_layers,
        num_attention_heads,
        num_key_value_heads,
        head_dim,
        global_head_dim,
        num_global_key_value_heads,
        rms_norm_eps: c.rms_norm_eps.unwrap_or(1e-6),
        max_position_embeddings: c.max_position_embeddings.unwrap_or(match (gemma4, unified) {
            (true, true) => 262_144,
            (true, false) => 131_072,
            _ => 8192,
        }),
        // Gemma 4 attends with a scale of 1 (its QK-norm sets the magnitude) and no softcap.
        query_pre_attn_scalar: if gemma4 { 1.0 } else { c.query_pre_attn_scalar.unwrap_or(head_dim as f64) },
        attn_logit_softcapping: if gemma4 { None } else { c.attn_logit_softcapping },
        final_logit_softcapping: c.final_logit_softcapping,
        sliding_window: match arch {
            Architecture::Gemma => None,
            Architecture::Gemma4 => Some(c.sliding_window.unwrap_or(if unified { 1024 } else { 512 })),
            _ => c.sliding_window,
        },
        layer_types,
        rope_full_attention,
        rope_sliding_attention,
        bos_token_id: c.bos_token_id.or(hf.bos_token_id).unwrap_or(2),
        eos_token_id: c.eos_token_id.clone().or(hf.eos_token_id.clone()).map_or(vec![1], TokenIds::into_vec),
        attention_k_eq_v,
        num_kv_shared_layers: if gemma4 { c.num_kv_shared_layers.unwrap_or(0) } else { 0 },
        use_double_wide_mlp: gemma4 && c.use_double_wide_mlp == Some(true),
        hidden_size_per_layer_input: per_layer_width,
        vocab_size_per_layer_input: per_layer_rows,
        moe,
        image_attention: match arch {
            Architecture::Gemma3 => ImageAttention::BothWays,
            Architecture::Gemma4 if c.use_bidirectional_attention == Some(Bidirectional::Mode("vision".into())) => {
                ImageAttention::BothWaysOnSlidingLayers
            }
            _ => ImageAttention::Causal,
        },
        pad_token_id: c.pad_token_id.unwrap_or(0),
    };
    Ok(config)
}

// Beside the parser rather than in `config.rs`, so that the config does not depend on the
// HF format it is read from.
impl GemmaConfig {
    /// Parses an HF `config.json` ([`HfConfig`], resolved by `TryFrom`). A multimodal config is
    /// read through its `text_config`.
    pub fn from_hf_json(json: &str) -> Result<Self, ModelError> {
        Self::try_from(HfConfig::from_json(json)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::gemma4_tests::fixture;
    use serde_json::{json, Value};

    fn resolve(config: &Value) -> Result<GemmaConfig, ModelError> {
        GemmaConfig::from_hf_json(&config.to_string())
    }

    /// A wrong type is refused with its path, at the top level and inside `text_config`.
    #[test]
    fn wrong_types_name_their_path() {
        let mut c = fixture("gemma3");
        c["layer_types"][3] = "windowed".into();
        let e = resolve(&c).unwrap_err();
        assert!(matches!(&e, ModelError::ConfigValue { path, .. } if path == "layer_types[3]"), "{e}");
        let mut c = fixture("gemma3");
        c["rope_parameters"]["full_attention"]["factor"] = "eight".into();
        let e = resolve(&c).unwrap_err().to_string();
        assert!(e.contains("rope_parameters.full_attention.factor"), "{e}");
        let nested = json!({"model_type": "gemma3", "text_config": {"hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": -2, "num_attention_heads": 4, "vocab_size": 300}});
        let e = resolve(&nested).unwrap_err().to_string();
        assert!(e.contains("text_config.num_hidden_layers"), "{e}");
        let mut c = fixture("gemma3");
        c["eos_token_id"] = json!(["one"]);
        assert!(resolve(&c).unwrap_err().to_string().contains("eos_token_id"));
        let mut c = fixture("gemma4-dense");
        c["per_layer_config"]["5"]["sliding_window"] = 8.into();
        let e = resolve(&c).unwrap_err().to_string();
        assert!(e.contains("per_layer_config.5") && e.contains("sliding_window"), "{e}");
    }

    /// Keys this crate does not read are ignored; keys it reads but must refuse are named.
    #[test]
    fn bidirectional_attention_by_generation() {
        let mut c = fixture("gemma3");
        c["use_bidirectional_attention"] = false.into();
        c["some_future_key"] = json!({"anything": [1, 2]});
        assert!(resolve(&c).is_ok());
        c["use_bidirectional_attention"] = true.into();
        let e = resolve(&c).unwrap_err();
        assert!(matches!(e, ModelError::UnsupportedConfig { field: "use_bidirectional_attention", .. }), "{e}");
        // Gemma 4's "vision" mode only concerns image tokens: text stays causal.
        let mut c = fixture("gemma4-dense");
        c["use_bidirectional_attention"] = "vision".into();
        assert!(resolve(&c).is_ok());
        c["use_bidirectional_attention"] = "all".into();
        assert!(resolve(&c).unwrap_err().to_string().contains("use_bidirectional_attention"));
    }

    /// Multimodal configs keep token ids at the top level; the text config's own win.
    #[test]
    fn token_ids_from_either_level() {
        let text = json!({"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 16, "vocab_size": 300, "sliding_window": 4});
        let top = json!({"model_type": "gemma3", "eos_token_id": [1, 106], "bos_token_id": 2, "text_config": text});
        let c = resolve(&top).unwrap();
        assert_eq!((c.bos_token_id, c.eos_token_id.clone()), (2, vec![1, 106]));
        let mut inner = top.clone();
        inner["text_config"]["eos_token_id"] = 7.into();
        assert_eq!(resolve(&inner).unwrap().eos_token_id, vec![7]);
        let parsed = HfConfig::from_json(&top.to_string()).unwrap();
        assert!(parsed.nested && parsed.text.model_type.is_none());
    }
}
