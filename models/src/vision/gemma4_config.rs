//! The vision parts of HF's `Gemma4Config`: `vision_config` (`Gemma4VisionConfig`) and the ids
//! of the tokens an image takes in the prompt.

use crate::config::invalid;
use crate::ModelError;
use serde::Deserialize;

/// HF's `rope_parameters` of the vision tower (axial 2-D RoPE).
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(default)]
pub struct VisionRope {
    pub rope_type: String,
    pub rope_theta: f64,
}

impl Default for VisionRope {
    /// HF's defaults (`Gemma4VisionConfig.default_theta`, `default_rope_type`).
    fn default() -> Self {
        Self { rope_type: "axial".into(), rope_theta: 100.0 }
    }
}

/// HF 5.23's `Gemma4VisionConfig` (its defaults).
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(default)]
pub struct Gemma4VisionConfig {
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub head_dim: usize,
    pub hidden_activation: String,
    pub rms_norm_eps: f64,
    /// `None` in a config means HF's default (axial, theta 100).
    #[serde(deserialize_with = "rope_or_default")]
    pub rope_parameters: VisionRope,
    /// Patches pooled along each side into one soft token.
    pub pooling_kernel_size: usize,
    pub patch_size: usize,
    /// Rows of each axis' position table (largest patch index + 1).
    pub position_embedding_size: usize,
    /// Linear layers clamp their inputs and outputs to stored bounds.
    pub use_clipped_linears: bool,
    /// Pooled features are standardized by stored `std_bias` and `std_scale`.
    pub standardize: bool,
}

fn rope_or_default<'de, D: serde::Deserializer<'de>>(d: D) -> Result<VisionRope, D::Error> {
    Ok(Option::<VisionRope>::deserialize(d)?.unwrap_or_default())
}

impl Default for Gemma4VisionConfig {
    fn default() -> Self {
        Self {
            hidden_size: 768,
            intermediate_size: 3072,
            num_hidden_layers: 16,
            num_attention_heads: 12,
            num_key_value_heads: 12,
            head_dim: 64,
            hidden_activation: "gelu_pytorch_tanh".into(),
            rms_norm_eps: 1e-6,
            rope_parameters: VisionRope::default(),
            pooling_kernel_size: 3,
            patch_size: 16,
            position_embedding_size: 10 * 1024,
            use_clipped_linears: false,
            standardize: false,
        }
    }
}

/// Gemma 4's image input: the vision tower, the embedder into the text model's width, and the
/// ids of the tokens an image takes in the prompt.
#[derive(Debug, Clone, PartialEq)]
pub struct Gemma4ImageConfig {
    pub vision: Gemma4VisionConfig,
    /// The placeholders the image's soft tokens replace.
    pub image_token_id: u32,
    /// `<|image>` and `<image|>` around them.
    pub boi_token_id: u32,
    pub eoi_token_id: u32,
    /// The text model's hidden size (the embedder's output).
    pub text_hidden_size: usize,
}

#[derive(Deserialize)]
#[serde(default)]
struct HfRoot {
    model_type: Option<String>,
    vision_config: Option<Gemma4VisionConfig>,
    image_token_id: u32,
    boi_token_id: u32,
    eoi_token_id: u32,
}

impl Default for HfRoot {
    /// HF's `Gemma4Config` defaults.
    fn default() -> Self {
        Self {
            model_type: None,
            vision_config: None,
            image_token_id: 258_880,
            boi_token_id: 255_999,
            eoi_token_id: 258_882,
        }
    }
}

impl Gemma4ImageConfig {
    /// The vision config of a multimodal Gemma 4 `config.json` (`model_type` `gemma4` with a
    /// `vision_config`), `None` for a config without one; `text_hidden_size` from its text config.
    pub fn from_hf_json(json: &str, text_hidden_size: usize) -> Result<Option<Self>, ModelError> {
        let root: HfRoot = serde_json::from_str(json)?;
        let Some(vision) = root.vision_config else { return Ok(None) };
        if root.model_type.as_deref() != Some("gemma4") {
            return Err(ModelError::UnsupportedConfig {
                field: "vision_config",
                value: format!("in a {:?} config (Gemma 4 images are read from `gemma4` configs)", root.model_type),
            });
        }
        let config = Self {
            vision,
            image_token_id: root.image_token_id,
            boi_token_id: root.boi_token_id,
            eoi_token_id: root.eoi_token_id,
            text_hidden_size,
        };
        config.validate()?;
        Ok(Some(config))
    }

    /// Checks every value before anything is allocated.
    pub fn validate(&self) -> Result<(), ModelError> {
        let v = &self.vision;
        super::config::check_sizes(&[
            ("vision_config.hidden_size", v.hidden_size),
            ("vision_config.intermediate_size", v.intermediate_size),
            ("vision_config.num_hidden_layers", v.num_hidden_layers),
            ("vision_config.num_attention_heads", v.num_attention_heads),
            ("vision_config.num_key_value_heads", v.num_key_value_heads),
            ("vision_config.head_dim", v.head_dim),
            ("vision_config.pooling_kernel_size", v.pooling_kernel_size),
            ("vision_config.patch_size", v.patch_size),
            ("vision_config.position_embedding_size", v.position_embedding_size),
            ("text hidden size", self.text_hidden_size),
        ])?;
        if !matches!(v.hidden_activation.as_str(), "gelu_pytorch_tanh" | "gelu_tanh") {
            return Err(ModelError::UnsupportedConfig {
                field: "vision_config.hidden_activation",
                value: v.hidden_activation.clone(),
            });
        }
        if v.rope_parameters.rope_type != "axial" {
            return Err(ModelError::UnsupportedConfig {
                field: "vision_config.rope_parameters.rope_type",
                value: v.rope_parameters.rope_type.clone(),
            });
        }
        if !(v.rope_parameters.rope_theta.is_finite() && v.rope_parameters.rope_theta > 0.0) {
            return Err(invalid("vision_config.rope_parameters.rope_theta", "must be a positive number"));
        }
        if !v.num_attention_heads.is_multiple_of(v.num_key_value_heads) {
            return Err(invalid("vision_config.num_key_value_heads", "must divide num_attention_heads"));
        }
        // Axial RoPE: each half of a head turns by one axis, in pairs.
        if !v.head_dim.is_multiple_of(4) {
            return Err(invalid(
                "vision_config.head_dim",
                format!("must be a multiple of 4 (axial RoPE), found {}", v.head_dim),
            ));
        }
        burn_gemma_kernels::attention::check_head_dim(v.head_dim).map_err(|r| invalid("vision_config.head_dim", r))?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_and_refusals() {
        let json = r#"{"model_type": "gemma4", "vision_config": {"hidden_size": 32, "num_attention_heads": 2,
            "num_key_value_heads": 2, "head_dim": 16, "rope_parameters": null}}"#;
        let c = Gemma4ImageConfig::from_hf_json(json, 64).unwrap().unwrap();
        assert_eq!(c.vision.rope_parameters, VisionRope::default());
        assert_eq!((c.vision.pooling_kernel_size, c.vision.patch_size), (3, 16));
        assert_eq!(Gemma4ImageConfig::from_hf_json(r#"{"model_type": "gemma4"}"#, 64).unwrap(), None);
        let bad = json.replace("\"head_dim\": 16", "\"head_dim\": 18");
        assert!(matches!(Gemma4ImageConfig::from_hf_json(&bad, 64), Err(ModelError::InvalidConfig { .. })));
        let bad = json.replace("gemma4", "gemma3");
        assert!(matches!(Gemma4ImageConfig::from_hf_json(&bad, 64), Err(ModelError::UnsupportedConfig { .. })));
    }
}
