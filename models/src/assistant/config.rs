//! HF's `Gemma4AssistantConfig` (`gemma4_assistant`, and `gemma4_unified_assistant` for Gemma 4
//! 12B): a Gemma 4 text config whose every layer reads its target's keys, the target's hidden
//! size, and the optional ordered (centroid-masked) lm_head.

use crate::config::{invalid, Architecture, GemmaConfig, KvSource};
use crate::hf_config::{resolve, HfConfig};
use crate::ModelError;
use serde::Deserialize;

/// The lm_head over the tokens of a few clusters only (HF's `Gemma4AssistantMaskedEmbedder`):
/// the vocabulary in `num_centroids` equal clusters, scored against their centroids, and the
/// tokens of the best `centroid_intermediate_top_k` clusters scored against the embedding table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OrderedEmbeddings {
    pub num_centroids: usize,
    pub centroid_intermediate_top_k: usize,
}

impl OrderedEmbeddings {
    /// Tokens per cluster.
    pub fn tokens_per_centroid(&self, vocab: usize) -> usize {
        vocab / self.num_centroids.max(1)
    }
}

/// A resolved Gemma 4 assistant configuration.
#[derive(Debug, Clone, PartialEq)]
pub struct AssistantConfig {
    /// The assistant's own stack (`text_config`): `num_kv_shared_layers == num_hidden_layers`.
    pub text: GemmaConfig,
    /// Hidden size of the target it drafts for (its embeddings and final hidden states).
    pub backbone_hidden_size: usize,
    /// `use_ordered_embeddings`: the masked lm_head, or `None` for the whole vocabulary.
    pub ordered_embeddings: Option<OrderedEmbeddings>,
}

/// The top-level keys of an assistant's `config.json`.
#[derive(Deserialize)]
#[serde(default)]
struct HfAssistantRoot {
    model_type: Option<String>,
    backbone_hidden_size: usize,
    use_ordered_embeddings: bool,
    num_centroids: usize,
    centroid_intermediate_top_k: usize,
    tie_word_embeddings: bool,
}

impl Default for HfAssistantRoot {
    /// HF's defaults.
    fn default() -> Self {
        Self {
            model_type: None,
            backbone_hidden_size: 1536,
            use_ordered_embeddings: false,
            num_centroids: 2048,
            centroid_intermediate_top_k: 32,
            tie_word_embeddings: true,
        }
    }
}

/// `model_type`s of assistant configs.
pub const ASSISTANT_MODEL_TYPES: [&str; 2] = ["gemma4_assistant", "gemma4_unified_assistant"];

impl AssistantConfig {
    /// Parses an assistant's `config.json`.
    pub fn from_hf_json(json: &str) -> Result<Self, ModelError> {
        let root: HfAssistantRoot = serde_json::from_str(json)?;
        let model_type = root.model_type.as_deref().unwrap_or("");
        if !ASSISTANT_MODEL_TYPES.contains(&model_type) {
            return Err(ModelError::UnsupportedConfig {
                field: "model_type",
                value: format!("{model_type:?} (a Gemma 4 assistant is one of {ASSISTANT_MODEL_TYPES:?})"),
            });
        }
        if !root.tie_word_embeddings {
            return Err(ModelError::UnsupportedConfig { field: "tie_word_embeddings", value: "false".into() });
        }
        let mut hf = HfConfig::from_json(json)?;
        if !hf.nested {
            return Err(invalid("text_config", "is missing (an assistant's stack is described there)"));
        }
        if hf.text.model_type.is_none() {
            let text = if model_type == "gemma4_unified_assistant" { "gemma4_unified_text" } else { "gemma4_text" };
            hf.text.model_type = Some(text.to_string());
        }
        // HF's `Gemma4AssistantConfig` makes every layer share its target's keys.
        let layers = hf.text.num_hidden_layers;
        if hf.text.num_kv_shared_layers.is_none_or(|n| n == 0) {
            hf.text.num_kv_shared_layers = layers;
        }
        let config = Self {
            text: resolve(hf)?,
            backbone_hidden_size: root.backbone_hidden_size,
            ordered_embeddings: root.use_ordered_embeddings.then_some(OrderedEmbeddings {
                num_centroids: root.num_centroids,
                centroid_intermediate_top_k: root.centroid_intermediate_top_k,
            }),
        };
        config.validate()?;
        Ok(config)
    }

    /// Checks the stack as HF's `validate_architecture` does (Gemma 4, every layer reading the
    /// target's keys, no per-layer inputs, experts or double-wide MLPs) and the lm_head.
    pub fn validate(&self) -> Result<(), ModelError> {
        let t = &self.text;
        if t.model_type != Architecture::Gemma4 {
            return Err(ModelError::UnsupportedConfig {
                field: "text_config.model_type",
                value: format!("{:?} (assistants are Gemma 4)", t.model_type),
            });
        }
        t.validate_for(KvSource::Target)?;
        for (field, present) in [
            ("hidden_size_per_layer_input", t.hidden_size_per_layer_input > 0),
            ("enable_moe_block", t.moe.is_some()),
            ("use_double_wide_mlp", t.use_double_wide_mlp),
        ] {
            if present {
                return Err(invalid(field, "must be off in an assistant (HF's Gemma4AssistantConfig)"));
            }
        }
        if self.backbone_hidden_size == 0 || self.backbone_hidden_size > 1 << 20 {
            return Err(invalid("backbone_hidden_size", format!("is out of range ({})", self.backbone_hidden_size)));
        }
        if let Some(o) = self.ordered_embeddings {
            if o.num_centroids == 0 || !t.vocab_size.is_multiple_of(o.num_centroids) {
                return Err(invalid(
                    "num_centroids",
                    format!("({}) must divide vocab_size ({})", o.num_centroids, t.vocab_size),
                ));
            }
            if o.centroid_intermediate_top_k == 0 || o.centroid_intermediate_top_k > o.num_centroids {
                return Err(invalid(
                    "centroid_intermediate_top_k",
                    format!("({}) must be in 1..=num_centroids ({})", o.centroid_intermediate_top_k, o.num_centroids),
                ));
            }
        }
        Ok(())
    }
}
