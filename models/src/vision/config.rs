//! The vision parts of HF's `Gemma3Config`: `vision_config` (`SiglipVisionConfig`) and the
//! projector's and prompt's values (`mm_tokens_per_image`, the image token ids).

use crate::config::invalid;
use crate::ModelError;
use serde::Deserialize;

/// HF's `SiglipVisionConfig` (the keys Gemma 3's tower uses; HF's defaults).
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(default)]
pub struct SiglipConfig {
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_channels: usize,
    pub image_size: usize,
    pub patch_size: usize,
    pub layer_norm_eps: f64,
    pub hidden_act: String,
    pub vision_use_head: bool,
}

impl Default for SiglipConfig {
    fn default() -> Self {
        Self {
            hidden_size: 768,
            intermediate_size: 3072,
            num_hidden_layers: 12,
            num_attention_heads: 12,
            num_channels: 3,
            image_size: 224,
            patch_size: 16,
            layer_norm_eps: 1e-6,
            hidden_act: "gelu_pytorch_tanh".into(),
            vision_use_head: false,
        }
    }
}

impl SiglipConfig {
    /// Patches along each side of the image.
    pub fn patches_per_side(&self) -> usize {
        self.image_size / self.patch_size.max(1)
    }

    /// Size of each attention head.
    pub fn head_dim(&self) -> usize {
        self.hidden_size / self.num_attention_heads.max(1)
    }
}

/// Gemma 3's image input: the SigLIP tower, the projector's pooling, and the ids of the tokens
/// an image takes in the prompt.
#[derive(Debug, Clone, PartialEq)]
pub struct Gemma3VisionConfig {
    pub vision: SiglipConfig,
    /// Soft tokens per image (a square number: the pooled grid).
    pub mm_tokens_per_image: usize,
    /// `<image_soft_token>`: the placeholders the image's features replace.
    pub image_token_index: u32,
    /// `<start_of_image>` and `<end_of_image>` around them.
    pub boi_token_index: u32,
    pub eoi_token_index: u32,
    /// The text model's hidden size (the projector's output).
    pub text_hidden_size: usize,
}

/// Every size of a vision config positive and at most 2^20, else the field named.
pub(crate) fn check_sizes(sizes: &[(&'static str, usize)]) -> Result<(), ModelError> {
    match sizes.iter().find(|&&(_, value)| value == 0 || value > 1 << 20) {
        Some(&(field, value)) => Err(invalid(field, format!("is out of range ({value})"))),
        None => Ok(()),
    }
}

#[derive(Deserialize)]
#[serde(default)]
struct HfRoot {
    model_type: Option<String>,
    vision_config: Option<SiglipConfig>,
    mm_tokens_per_image: usize,
    #[serde(alias = "image_token_id")]
    image_token_index: u32,
    #[serde(alias = "boi_token_id")]
    boi_token_index: u32,
    #[serde(alias = "eoi_token_id")]
    eoi_token_index: u32,
}

impl Default for HfRoot {
    /// HF's `Gemma3Config` defaults.
    fn default() -> Self {
        Self {
            model_type: None,
            vision_config: None,
            mm_tokens_per_image: 256,
            image_token_index: 262_144,
            boi_token_index: 255_999,
            eoi_token_index: 256_000,
        }
    }
}

impl Gemma3VisionConfig {
    /// The vision config of a multimodal Gemma 3 `config.json` (`model_type` `gemma3` with a
    /// `vision_config`), `None` for a text-only config; `text_hidden_size` from its text config.
    pub fn from_hf_json(json: &str, text_hidden_size: usize) -> Result<Option<Self>, ModelError> {
        let root: HfRoot = serde_json::from_str(json)?;
        // Gemma 4's vision config is another (`Gemma4ImageConfig`).
        if root.model_type.as_deref() == Some("gemma4") {
            return Ok(None);
        }
        let Some(vision) = root.vision_config else { return Ok(None) };
        if root.model_type.as_deref() != Some("gemma3") {
            return Err(ModelError::UnsupportedConfig {
                field: "vision_config",
                value: format!("in a {:?} config (images are read for Gemma 3)", root.model_type.unwrap_or_default()),
            });
        }
        let config = Self {
            vision,
            mm_tokens_per_image: root.mm_tokens_per_image,
            image_token_index: root.image_token_index,
            boi_token_index: root.boi_token_index,
            eoi_token_index: root.eoi_token_index,
            text_hidden_size,
        };
        config.validate()?;
        Ok(Some(config))
    }

    /// Soft tokens along each side of the pooled grid.
    pub fn tokens_per_side(&self) -> usize {
        (self.mm_tokens_per_image as f64).sqrt().round() as usize
    }

    /// Checks every value before anything is allocated.
    pub fn validate(&self) -> Result<(), ModelError> {
        let v = &self.vision;
        check_sizes(&[
            ("vision_config.hidden_size", v.hidden_size),
            ("vision_config.intermediate_size", v.intermediate_size),
            ("vision_config.num_hidden_layers", v.num_hidden_layers),
            ("vision_config.num_attention_heads", v.num_attention_heads),
            ("vision_config.image_size", v.image_size),
            ("vision_config.patch_size", v.patch_size),
            ("mm_tokens_per_image", self.mm_tokens_per_image),
        ])?;
        if v.num_channels != 3 {
            return Err(invalid("vision_config.num_channels", format!("must be 3 (RGB), found {}", v.num_channels)));
        }
        if !matches!(v.hidden_act.as_str(), "gelu_pytorch_tanh" | "gelu_tanh") {
            return Err(ModelError::UnsupportedConfig {
                field: "vision_config.hidden_act",
                value: v.hidden_act.clone(),
            });
        }
        if v.vision_use_head {
            return Err(ModelError::UnsupportedConfig { field: "vision_config.vision_use_head", value: "true".into() });
        }
        if !v.image_size.is_multiple_of(v.patch_size) {
            return Err(invalid(
                "vision_config.image_size",
                format!("({}) must be a multiple of patch_size ({})", v.image_size, v.patch_size),
            ));
        }
        if !v.hidden_size.is_multiple_of(v.num_attention_heads) {
            return Err(invalid("vision_config.num_attention_heads", "must divide hidden_size"));
        }
        burn_gemma_kernels::attention::check_head_dim(v.head_dim())
            .map_err(|r| invalid("vision_config.hidden_size", r))?;
        let side = self.tokens_per_side();
        if side * side != self.mm_tokens_per_image || !v.patches_per_side().is_multiple_of(side) {
            return Err(invalid(
                "mm_tokens_per_image",
                format!(
                    "({}) must be the square of a divisor of the {} patches per side",
                    self.mm_tokens_per_image,
                    v.patches_per_side()
                ),
            ));
        }
        Ok(())
    }
}
