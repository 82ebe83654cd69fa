//! Model configuration: parsed from Hugging Face `config.json` (both the newer `rope_parameters`
//! and `layer_types` layout and the older `rope_theta` / `rope_local_base_freq` / `rope_scaling` /
//! `sliding_window_pattern` keys) or built from GGUF metadata by the loader, and validated before
//! anything is allocated.

use crate::ModelError;
use serde::{Deserialize, Serialize};

/// Which Gemma generation a checkpoint belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Architecture {
    /// Gemma 1 (`model_type: gemma`).
    Gemma,
    /// Gemma 2 (`gemma2`): sandwich norms, softcapping, alternating sliding windows.
    Gemma2,
    /// Gemma 3 (`gemma3_text`, or the language model of `gemma3`): QK-norm, 5:1 local/global.
    Gemma3,
    /// Gemma 4 (`gemma4_text`, `gemma4_unified_text`, or the language model of `gemma4` /
    /// `gemma4_unified`): norms that scale by `w`, a
    /// second attention shape on full layers, value norms, and optionally shared KV layers,
    /// per-layer embeddings and a routed expert block.
    Gemma4,
}

impl Architecture {
    /// Parses an HF `model_type` or a GGUF `general.architecture`.
    pub fn from_name(name: &str) -> Result<Self, ModelError> {
        match name {
            "gemma" => Ok(Self::Gemma),
            "gemma2" => Ok(Self::Gemma2),
            "gemma3" | "gemma3_text" => Ok(Self::Gemma3),
            // Gemma 4 12B (`gemma4_unified`): Gemma 4's text decoder without per-layer inputs
            // or experts.
            "gemma4" | "gemma4_text" | "gemma4_unified" | "gemma4_unified_text" => Ok(Self::Gemma4),
            other => Err(ModelError::NotGemma(other.to_string())),
        }
    }

    /// Gemma 2 and 3 normalize after attention and after the MLP as well as before.
    pub fn has_sandwich_norms(self) -> bool {
        !matches!(self, Self::Gemma)
    }

    /// Gemma 3 and 4 normalize queries and keys per head.
    pub fn has_qk_norm(self) -> bool {
        matches!(self, Self::Gemma3 | Self::Gemma4)
    }

    /// How the checkpoint's RMSNorm weights scale.
    pub fn norm_scale(self) -> NormScale {
        match self {
            Self::Gemma4 => NormScale::Weight,
            _ => NormScale::OnePlusWeight,
        }
    }

    /// The `model_type` of the text model, as HF writes it.
    pub fn name(self) -> &'static str {
        match self {
            Self::Gemma => "gemma",
            Self::Gemma2 => "gemma2",
            Self::Gemma3 => "gemma3_text",
            Self::Gemma4 => "gemma4_text",
        }
    }
}

/// What an RMSNorm weight `w` of a checkpoint means.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NormScale {
    /// Gemma 1-3: the norm scales by `1 + w`.
    OnePlusWeight,
    /// Gemma 4: the norm scales by `w`.
    Weight,
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

/// Rotary embedding of one layer type: `rope_theta`, linear position scaling `factor` (1 for
/// none), and the share of the head that rotates.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct RopeConfig {
    /// Base of the rotary frequencies.
    pub rope_theta: f64,
    /// Linear scaling: positions are divided by this factor.
    pub factor: f64,
    /// Gemma 4's `proportional` RoPE: the first `partial_rotary_factor * head_dim / 2` pairs
    /// rotate with frequencies over the full head size, the remaining pairs are left as they are
    /// (1: every pair rotates, the default RoPE).
    pub partial_rotary_factor: f64,
}

/// The routed expert block of a mixture-of-experts layer (Gemma 4 26B-A4B), beside the dense MLP.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct MoeConfig {
    pub num_experts: usize,
    /// Experts each token is routed to.
    pub top_k_experts: usize,
    /// Width of each expert's MLP.
    pub moe_intermediate_size: usize,
}

/// A resolved Gemma configuration. Field names follow HF `config.json`.
///
/// [`GemmaConfig::from_hf_json`], [`GemmaConfig::preset`] and the GGUF loader validate what they
/// make ([`GemmaConfig::validate`]), and [`crate::Gemma::load`] validates whatever it is given,
/// so no config reaches a model unchecked. It serializes (for reports) but has no deserializer
/// of its own: `config.json` goes through [`GemmaConfig::from_hf_json`].
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct GemmaConfig {
    /// Model generation (HF `model_type`).
    pub model_type: Architecture,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    /// KV heads of sliding layers (of every layer before Gemma 4).
    pub num_key_value_heads: usize,
    /// Head size of sliding layers (of every layer before Gemma 4).
    pub head_dim: usize,
    /// Head size of full-attention layers (Gemma 4: HF's `global_head_dim`, or the
    /// `per_layer_config` of the full layers; otherwise `head_dim`).
    pub global_head_dim: usize,
    /// KV heads of full-attention layers (Gemma 4: `num_global_key_value_heads` or
    /// `per_layer_config`; otherwise `num_key_value_heads`).
    pub num_global_key_value_heads: usize,
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
    /// Gemma 4: full layers have no `v_proj`; their values are the key projection.
    pub attention_k_eq_v: bool,
    /// Gemma 4: the last this many layers have no keys and values of their own; they attend over
    /// the cache of the last earlier layer of the same type.
    pub num_kv_shared_layers: usize,
    /// Gemma 4: the MLPs of the KV-sharing layers are twice `intermediate_size` wide.
    pub use_double_wide_mlp: bool,
    /// Gemma 4 E models: width of each layer's slice of the per-layer embeddings (0: none).
    pub hidden_size_per_layer_input: usize,
    /// Rows of the per-layer embedding table.
    pub vocab_size_per_layer_input: usize,
    /// Gemma 4 26B-A4B: the routed expert block of every layer.
    pub moe: Option<MoeConfig>,
    /// How an image's soft tokens attend to each other in the text model.
    pub image_attention: ImageAttention,
    /// HF `pad_token_id`: the token whose per-layer inputs a Gemma 4 E model reads at image
    /// positions.
    pub pad_token_id: u32,
}

/// How an image's soft tokens attend to each other in the text model (HF: Gemma 3's
/// `token_type_ids` mask; Gemma 4's `create_masks_for_vision_model`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum ImageAttention {
    /// Causally, as text (Gemma 4 unless its config says `use_bidirectional_attention: "vision"`).
    Causal,
    /// Both ways on every layer (Gemma 3).
    BothWays,
    /// Both ways on sliding-window layers, causally on full-attention layers (Gemma 4 with
    /// `use_bidirectional_attention: "vision"`).
    BothWaysOnSlidingLayers,
}

/// Where a model's layers get their keys and values.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KvSource {
    /// From its own layers: the first compute them, the last `num_kv_shared_layers` attend over
    /// the cache of an earlier layer of their type.
    Layers,
    /// From another model: every layer attends over the cache of that model (a Gemma 4
    /// assistant over its target's, `num_kv_shared_layers == num_hidden_layers`).
    Target,
}

pub(crate) fn invalid(field: &'static str, reason: impl Into<String>) -> ModelError {
    ModelError::InvalidConfig { field, reason: reason.into() }
}

impl GemmaConfig {
    /// Names accepted by [`GemmaConfig::preset`].
    pub const PRESETS: [&'static str; 8] =
        ["gemma3-270m", "gemma3-1b", "gemma3-4b", "gemma3-12b", "gemma3-27b", "gemma4-e2b", "gemma4-e4b", "gemma4-31b"];

    /// The published configuration of a Gemma 3 or 4 text model (the text part of its HF
    /// `config.json`, kept as values; a test checks each against its `config.json`), for
    /// synthetic (random-weight) models in tests and benchmarks: one of [`Self::PRESETS`].
    pub fn preset(name: &str) -> Result<Self, ModelError> {
        let config = match name {
            "gemma3-270m" => gemma3_preset(640, 2048, 18, (4, 1, 256), 256.0, 512, None, 32_768),
            "gemma3-1b" => gemma3_preset(1152, 6912, 26, (4, 1, 256), 256.0, 512, None, 32_768),
            "gemma3-4b" => gemma3_preset(2560, 10240, 34, (8, 4, 256), 256.0, 1024, Some(8.0), 131_072),
            "gemma3-12b" => gemma3_preset(3840, 15360, 48, (16, 8, 256), 256.0, 1024, Some(8.0), 131_072),
            "gemma3-27b" => gemma3_preset(5376, 21504, 62, (32, 16, 128), 168.0, 1024, Some(8.0), 131_072),
            "gemma4-e2b" => Gemma4Preset {
                layers: 35,
                hidden: 1536,
                intermediate: 6144,
                heads: (8, 1, 1),
                values_from_keys: false,
                window: 512,
                pattern: 5,
                shared_kv_layers: 20,
                double_wide_mlp: true,
                per_layer_width: 256,
                context: 131_072,
            }
            .config(),
            "gemma4-e4b" => Gemma4Preset {
                layers: 42,
                hidden: 2560,
                intermediate: 10240,
                heads: (8, 2, 2),
                values_from_keys: false,
                window: 512,
                pattern: 6,
                shared_kv_layers: 18,
                double_wide_mlp: false,
                per_layer_width: 256,
                context: 131_072,
            }
            .config(),
            "gemma4-31b" => Gemma4Preset {
                layers: 60,
                hidden: 5376,
                intermediate: 21504,
                heads: (32, 16, 4),
                values_from_keys: true,
                window: 1024,
                pattern: 6,
                shared_kv_layers: 0,
                double_wide_mlp: false,
                per_layer_width: 0,
                context: 262_144,
            }
            .config(),
            other => {
                return Err(ModelError::UnsupportedConfig {
                    field: "preset",
                    value: format!("{other} (known: {})", Self::PRESETS.join(", ")),
                })
            }
        };
        config.validate()?;
        Ok(config)
    }

    /// Checks every value before anything is allocated.
    pub fn validate(&self) -> Result<(), ModelError> {
        self.validate_for(KvSource::Layers)
    }

    /// [`GemmaConfig::validate`] for a model whose keys and values come from `kv`.
    pub fn validate_for(&self, kv: KvSource) -> Result<(), ModelError> {
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
        if self.hidden_size > MAX_DIM || self.intermediate_size > MAX_DIM || self.num_hidden_layers > MAX_LAYERS {
            return Err(invalid("hidden_size", "or intermediate_size / num_hidden_layers is implausibly large"));
        }
        for (field, dim) in [("head_dim", self.head_dim), ("global_head_dim", self.global_head_dim)] {
            burn_gemma_kernels::attention::check_head_dim(dim).map_err(|reason| invalid(field, reason))?;
        }
        for (field, kv) in [
            ("num_key_value_heads", self.num_key_value_heads),
            ("num_global_key_value_heads", self.num_global_key_value_heads),
        ] {
            if kv == 0 || !self.num_attention_heads.is_multiple_of(kv) {
                return Err(invalid(
                    field,
                    format!("({kv}) must divide num_attention_heads ({})", self.num_attention_heads),
                ));
            }
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
        if self.model_type == Architecture::Gemma4 && self.layer_types.last() != Some(&LayerType::FullAttention) {
            return Err(invalid(
                "layer_types",
                "must end with a full_attention layer (Gemma 4's last layer is global)",
            ));
        }
        self.check_gemma4_parts(kv)?;
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

    /// Checks KV sharing, per-layer embeddings and the expert block.
    fn check_gemma4_parts(&self, kv: KvSource) -> Result<(), ModelError> {
        let layers = self.num_hidden_layers;
        if kv == KvSource::Target && self.num_kv_shared_layers != layers {
            return Err(invalid(
                "num_kv_shared_layers",
                format!(
                    "({}) must be num_hidden_layers ({layers}): every layer of an assistant attends over its \
                     target's keys",
                    self.num_kv_shared_layers
                ),
            ));
        }
        if kv == KvSource::Layers && self.num_kv_shared_layers >= layers {
            return Err(invalid(
                "num_kv_shared_layers",
                format!("({}) leaves no layer of the {layers} to produce keys and values", self.num_kv_shared_layers),
            ));
        }
        for layer in self.first_kv_shared_layer()..layers {
            if kv == KvSource::Layers && self.kv_producer(layer).is_none() {
                let kind = self.layer_types[layer];
                return Err(invalid(
                    "num_kv_shared_layers",
                    format!(
                        "({}) leaves no earlier {kind:?} layer for layer {layer} to share",
                        self.num_kv_shared_layers
                    ),
                ));
            }
        }
        if self.hidden_size_per_layer_input > 0 {
            if self.vocab_size_per_layer_input == 0 {
                return Err(invalid("vocab_size_per_layer_input", "must be positive with per-layer inputs"));
            }
            let width = self.hidden_size_per_layer_input.checked_mul(layers);
            if width.and_then(|w| w.checked_mul(self.vocab_size_per_layer_input)).is_none_or(|n| n > 1 << 36) {
                return Err(invalid(
                    "hidden_size_per_layer_input",
                    "times the layers and vocabulary is implausibly large",
                ));
            }
        }
        if let Some(moe) = self.moe {
            if moe.num_experts == 0 || moe.num_experts > 4096 {
                return Err(invalid("num_experts", format!("must be in 1..=4096, found {}", moe.num_experts)));
            }
            if moe.top_k_experts == 0 || moe.top_k_experts > moe.num_experts {
                return Err(invalid(
                    "top_k_experts",
                    format!("({}) must be in 1..=num_experts ({})", moe.top_k_experts, moe.num_experts),
                ));
            }
            if moe.moe_intermediate_size == 0 || moe.moe_intermediate_size > 1 << 20 {
                return Err(invalid(
                    "moe_intermediate_size",
                    format!("is out of range ({})", moe.moe_intermediate_size),
                ));
            }
        }
        Ok(())
    }

    /// Head size of a layer type's attention.
    pub fn head_dim_of(&self, layer_type: LayerType) -> usize {
        match layer_type {
            LayerType::FullAttention => self.global_head_dim,
            LayerType::SlidingAttention => self.head_dim,
        }
    }

    /// KV heads of a layer type's attention.
    pub fn kv_heads_of(&self, layer_type: LayerType) -> usize {
        match layer_type {
            LayerType::FullAttention => self.num_global_key_value_heads,
            LayerType::SlidingAttention => self.num_key_value_heads,
        }
    }

    /// The first layer that shares another layer's keys and values (the layer count when none
    /// does).
    pub fn first_kv_shared_layer(&self) -> usize {
        self.num_hidden_layers - self.num_kv_shared_layers.min(self.num_hidden_layers)
    }

    /// Whether layer `layer` computes keys and values of its own (before
    /// [`Self::first_kv_shared_layer`]).
    pub fn owns_kv(&self, layer: usize) -> bool {
        layer < self.first_kv_shared_layer()
    }

    /// For a KV-sharing layer, the layer whose cache it attends over: the last layer of the same
    /// type before [`Self::first_kv_shared_layer`]. `None` for layers with their own keys.
    pub fn kv_producer(&self, layer: usize) -> Option<usize> {
        let first = self.first_kv_shared_layer();
        if layer < first {
            return None;
        }
        let kind = *self.layer_types.get(layer)?;
        (0..first).rev().find(|&i| self.layer_types[i] == kind)
    }

    /// Width of layer `layer`'s MLP (doubled on KV-sharing layers with `use_double_wide_mlp`).
    pub fn intermediate_size_of(&self, layer: usize) -> usize {
        if self.use_double_wide_mlp && layer >= self.first_kv_shared_layer() {
            2 * self.intermediate_size
        } else {
            self.intermediate_size
        }
    }

    /// Whether a layer type's values are its key projection (Gemma 4's `attention_k_eq_v`, full
    /// layers).
    pub fn values_from_keys(&self, layer_type: LayerType) -> bool {
        self.attention_k_eq_v && layer_type == LayerType::FullAttention
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

    /// Parameters of layer `layer` outside its experts: the attention projections (a KV-sharing
    /// layer has no key or value projection of its own), the MLP and the per-layer input's two.
    fn dense_layer_parameters(&self, layer: usize) -> usize {
        let (h, kind) = (self.hidden_size, self.layer_types[layer]);
        let (d, kv) = (self.head_dim_of(kind), self.kv_heads_of(kind));
        let kv_projections = match (self.kv_producer(layer), self.values_from_keys(kind)) {
            (Some(_), _) => 0,
            (None, true) => 1,
            (None, false) => 2,
        };
        let attn = h * d * (2 * self.num_attention_heads + kv_projections * kv);
        let mlp = 3 * h * self.intermediate_size_of(layer);
        attn + mlp + 2 * h * self.hidden_size_per_layer_input
    }

    /// Number of parameters of the text model (embeddings counted once: the lm_head is tied;
    /// the per-layer embedding table included).
    pub fn num_parameters(&self) -> usize {
        let h = self.hidden_size;
        let layers: usize = (0..self.num_hidden_layers)
            .map(|i| {
                let experts =
                    self.moe.map_or(0, |m| m.num_experts * (3 * h * m.moe_intermediate_size + 1) + h * m.num_experts);
                self.dense_layer_parameters(i) + experts
            })
            .sum();
        let per_layer_tables =
            self.hidden_size_per_layer_input * self.num_hidden_layers * (self.vocab_size_per_layer_input + h);
        self.vocab_size * h + layers + per_layer_tables
    }
}

impl GemmaConfig {
    /// Bytes of keys and values one sequence's decode step at `position` reads: every layer's
    /// attended positions (a sliding window's at most), a KV-sharing layer's reads counted too.
    pub fn kv_read_bytes(&self, kv: burn_gemma_kernels::KvFormat, position: usize) -> usize {
        self.layer_types
            .iter()
            .map(|&t| {
                let head_dim = self.head_dim_of(t);
                let per_position = match kv {
                    burn_gemma_kernels::KvFormat::Dense(dtype) => head_dim * dtype.size(),
                    // Codes plus one f32 scale per position and head.
                    burn_gemma_kernels::KvFormat::Int8 => head_dim + 4,
                };
                let attended = self.window(t).map_or(position, |w| w.min(position));
                2 * self.kv_heads_of(t) * per_position * attended
            })
            .sum()
    }

    /// Multiply-adds of one row's decode step at `position`: the projections a token passes
    /// through (its routed experts only, the lm_head included) and attention's scores and
    /// values over the positions it attends.
    pub fn decode_macs(&self, position: usize) -> usize {
        let h = self.hidden_size;
        let layers: usize = (0..self.num_hidden_layers)
            .map(|i| {
                let kind = self.layer_types[i];
                let experts =
                    self.moe.map_or(0, |m| m.top_k_experts * 3 * h * m.moe_intermediate_size + h * m.num_experts);
                let attended = self.window(kind).map_or(position, |w| w.min(position));
                let attention = 2 * self.num_attention_heads * self.head_dim_of(kind) * attended;
                self.dense_layer_parameters(i) + experts + attention
            })
            .sum();
        layers + self.vocab_size * h
    }
}

/// A published Gemma 3 text shape: `(heads, kv heads, head size)` in `heads`; the global layers'
/// RoPE scaled linearly by `factor` where given.
#[allow(clippy::too_many_arguments)]
fn gemma3_preset(
    hidden: usize,
    intermediate: usize,
    layers: usize,
    (heads, kv_heads, head_dim): (usize, usize, usize),
    query_pre_attn_scalar: f64,
    window: usize,
    factor: Option<f64>,
    context: usize,
) -> GemmaConfig {
    GemmaConfig {
        model_type: Architecture::Gemma3,
        image_attention: ImageAttention::BothWays,
        pad_token_id: 0,
        vocab_size: 262_144,
        hidden_size: hidden,
        intermediate_size: intermediate,
        num_hidden_layers: layers,
        num_attention_heads: heads,
        num_key_value_heads: kv_heads,
        head_dim,
        global_head_dim: head_dim,
        num_global_key_value_heads: kv_heads,
        rms_norm_eps: 1e-6,
        max_position_embeddings: context,
        query_pre_attn_scalar,
        attn_logit_softcapping: None,
        final_logit_softcapping: None,
        sliding_window: Some(window),
        layer_types: pattern_layers(layers, 6),
        rope_full_attention: RopeConfig {
            rope_theta: 1_000_000.0,
            factor: factor.unwrap_or(1.0),
            partial_rotary_factor: 1.0,
        },
        rope_sliding_attention: RopeConfig { rope_theta: 10_000.0, factor: 1.0, partial_rotary_factor: 1.0 },
        bos_token_id: 2,
        eos_token_id: vec![1, 106],
        attention_k_eq_v: false,
        num_kv_shared_layers: 0,
        use_double_wide_mlp: false,
        hidden_size_per_layer_input: 0,
        vocab_size_per_layer_input: 0,
        moe: None,
    }
}

/// A published Gemma 4 text shape (head sizes 256 sliding, 512 full).
struct Gemma4Preset {
    layers: usize,
    hidden: usize,
    intermediate: usize,
    /// Query heads, KV heads of sliding layers, KV heads of full layers.
    heads: (usize, usize, usize),
    /// Full layers' values are their keys.
    values_from_keys: bool,
    window: usize,
    /// Every `pattern`-th layer is a full one.
    pattern: usize,
    shared_kv_layers: usize,
    double_wide_mlp: bool,
    per_layer_width: usize,
    context: usize,
}

impl Gemma4Preset {
    fn config(&self) -> GemmaConfig {
        let (heads, kv_heads, global_kv_heads) = self.heads;
        GemmaConfig {
            model_type: Architecture::Gemma4,
            // As llama.cpp's mtmd (and the published configs, by that rule): images causal in
            // the E models, both ways on the sliding layers of the others.
            image_attention: if self.per_layer_width > 0 {
                ImageAttention::Causal
            } else {
                ImageAttention::BothWaysOnSlidingLayers
            },
            pad_token_id: 0,
            vocab_size: 262_144,
            hidden_size: self.hidden,
            intermediate_size: self.intermediate,
            num_hidden_layers: self.layers,
            num_attention_heads: heads,
            num_key_value_heads: kv_heads,
            head_dim: 256,
            global_head_dim: 512,
            num_global_key_value_heads: global_kv_heads,
            rms_norm_eps: 1e-6,
            max_position_embeddings: self.context,
            // Gemma 4 attends at scale 1 over QK-normed heads.
            query_pre_attn_scalar: 1.0,
            attn_logit_softcapping: None,
            final_logit_softcapping: Some(30.0),
            sliding_window: Some(self.window),
            layer_types: pattern_layers(self.layers, self.pattern),
            rope_full_attention: RopeConfig { rope_theta: 1_000_000.0, factor: 1.0, partial_rotary_factor: 0.25 },
            rope_sliding_attention: RopeConfig { rope_theta: 10_000.0, factor: 1.0, partial_rotary_factor: 1.0 },
            bos_token_id: 2,
            eos_token_id: vec![1, 106],
            attention_k_eq_v: self.values_from_keys,
            num_kv_shared_layers: self.shared_kv_layers,
            use_double_wide_mlp: self.double_wide_mlp,
            hidden_size_per_layer_input: self.per_layer_width,
            // The per-layer table's rows (none without per-layer inputs).
            vocab_size_per_layer_input: if self.per_layer_width > 0 { 262_144 } else { 0 },
            moe: None,
        }
    }
}

/// `layers` layer types, every `pattern`-th a full-attention layer.
fn pattern_layers(layers: usize, pattern: usize) -> Vec<LayerType> {
    (0..layers)
        .map(|i| if (i + 1) % pattern == 0 { LayerType::FullAttention } else { LayerType::SlidingAttention })
        .collect()
}

/// Layer types from a local:global pattern: with pattern `p`, layer `i` is global when
/// `(i + 1) % p == 0`; no pattern means every layer is global.
///
/// Fails for more than [`MAX_LAYERS`] layers, before anything is allocated for them.
pub fn default_layer_types(layers: usize, pattern: Option<usize>) -> Result<Vec<LayerType>, ModelError> {
    if layers > MAX_LAYERS {
        return Err(invalid("num_hidden_layers", format!("is implausibly large ({layers}; at most {MAX_LAYERS})")));
    }
    Ok((0..layers)
        .map(|i| match pattern {
            Some(p) if p > 0 && (i + 1) % p != 0 => LayerType::SlidingAttention,
            _ => LayerType::FullAttention,
        })
        .collect())
}

/// The most decoder layers a config may have.
pub const MAX_LAYERS: usize = 4096;

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::Value;

    const FIXTURES: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../tests/fixtures/tiny-gemma");

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
pub(crate) mod gemma4_tests {
    use super::*;
    use serde_json::Value;

    const FIXTURES: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../tests/fixtures/tiny-gemma");

    /// A tiny fixture's `config.json` as JSON, to edit.
    pub(crate) fn fixture(name: &str) -> Value {
        let text = std::fs::read_to_string(format!("{FIXTURES}/{name}/config.json")).expect("fixture config");
        serde_json::from_str(&text).expect("fixture JSON")
    }

    fn error(config: &Value) -> String {
        GemmaConfig::from_hf_json(&config.to_string()).expect_err("config must be refused").to_string()
    }

    #[test]
    fn fixtures_resolve_their_shapes() {
        let e = GemmaConfig::from_hf_json(&fixture("gemma4-e").to_string()).unwrap();
        assert_eq!((e.head_dim, e.global_head_dim, e.num_global_key_value_heads), (16, 32, 1));
        assert_eq!(
            (e.first_kv_shared_layer(), e.kv_producer(7), e.kv_producer(9), e.kv_producer(6)),
            (7, Some(6), Some(5), None)
        );
        assert_eq!((e.intermediate_size_of(6), e.intermediate_size_of(7)), (96, 192));
        assert_eq!(e.rope(LayerType::FullAttention).partial_rotary_factor, 0.25);
        assert_eq!(e.query_pre_attn_scalar, 1.0);
        let dense = GemmaConfig::from_hf_json(&fixture("gemma4-dense").to_string()).unwrap();
        assert!(
            dense.values_from_keys(LayerType::FullAttention) && !dense.values_from_keys(LayerType::SlidingAttention)
        );
        assert_eq!(
            (dense.kv_heads_of(LayerType::SlidingAttention), dense.kv_heads_of(LayerType::FullAttention)),
            (2, 1)
        );
        let moe = GemmaConfig::from_hf_json(&fixture("gemma4-moe").to_string()).unwrap();
        assert_eq!(moe.moe.map(|m| (m.num_experts, m.top_k_experts, m.moe_intermediate_size)), Some((4, 2, 24)));
        // The older keys, without per_layer_config.
        let mut legacy = fixture("gemma4-dense");
        legacy.as_object_mut().unwrap().remove("per_layer_config");
        legacy["global_head_dim"] = 32.into();
        legacy["num_global_key_value_heads"] = 1.into();
        let legacy = GemmaConfig::from_hf_json(&legacy.to_string()).unwrap();
        assert_eq!((legacy.global_head_dim, legacy.num_global_key_value_heads), (32, 1));
    }

    #[test]
    fn bad_gemma4_configs_name_the_field() {
        let mut c = fixture("gemma4-dense");
        c["per_layer_config"]["5"]["head_dim"] = 4100.into();
        c["per_layer_config"]["7"]["head_dim"] = 4100.into();
        let message = error(&c);
        assert!(message.contains("global_head_dim") && message.contains("4100"), "{message}");
        let mut c = fixture("gemma4-dense");
        c["per_layer_config"]["5"]["head_dim"] = 33.into();
        c["per_layer_config"]["7"]["head_dim"] = 33.into();
        assert!(error(&c).contains("global_head_dim"), "{}", error(&c));
        let mut c = fixture("gemma4-dense");
        c["per_layer_config"]["7"]["head_dim"] = 64.into();
        assert!(error(&c).contains("per_layer_config"), "{}", error(&c));
        // The last 3 layers share, but the 5 before them are all sliding: no full layer produces.
        let mut c = fixture("gemma4-e");
        c["num_kv_shared_layers"] = 5.into();
        let message = error(&c);
        assert!(message.contains("num_kv_shared_layers") && message.contains("FullAttention"), "{message}");
        let mut c = fixture("gemma4-e");
        c["num_kv_shared_layers"] = 10.into();
        assert!(error(&c).contains("num_kv_shared_layers"), "{}", error(&c));
        let mut c = fixture("gemma4-moe");
        c["top_k_experts"] = 5.into();
        let message = error(&c);
        assert!(message.contains("top_k_experts") && message.contains("num_experts (4)"), "{message}");
        let mut c = fixture("gemma4-moe");
        c.as_object_mut().unwrap().remove("moe_intermediate_size");
        assert!(error(&c).contains("moe_intermediate_size"), "{}", error(&c));
        let mut c = fixture("gemma4-e");
        c["layer_types"].as_array_mut().unwrap().pop();
        let message = error(&c);
        assert!(message.contains("layer_types") && message.contains("9 entries for 10 layers"), "{message}");
        let mut c = fixture("gemma4-e");
        c["layer_types"][9] = "sliding_attention".into();
        assert!(error(&c).contains("layer_types"), "{}", error(&c));
        let mut c = fixture("gemma4-e");
        c["use_bidirectional_attention"] = "all".into();
        assert!(error(&c).contains("use_bidirectional_attention"), "{}", error(&c));
    }
}

#[cfg(test)]
mod preset_tests {
    use super::*;

    /// The HF `config.json` of each preset, as published (their text configs).
    fn preset_json(name: &str) -> String {
        if let Some(json) = gemma4_preset_json(name) {
            return json;
        }
        // (hidden, intermediate, layers, heads, kv heads, head size, query_pre_attn_scalar,
        // sliding window, global RoPE factor, context)
        let (hidden, inter, layers, heads, kv, head_dim, scalar, window, factor, context) = match name {
            "gemma3-270m" => (640, 2048, 18, 4, 1, 256, 256, 512, None, 32_768),
            "gemma3-1b" => (1152, 6912, 26, 4, 1, 256, 256, 512, None, 32_768),
            "gemma3-4b" => (2560, 10240, 34, 8, 4, 256, 256, 1024, Some(8.0), 131_072),
            "gemma3-12b" => (3840, 15360, 48, 16, 8, 256, 256, 1024, Some(8.0), 131_072),
            "gemma3-27b" => (5376, 21504, 62, 32, 16, 128, 168, 1024, Some(8.0), 131_072),
            other => panic!("no config.json for {other}"),
        };
        let full_rope = match factor {
            Some(f) => format!(r#"{{"rope_theta": 1000000.0, "rope_type": "linear", "factor": {f}}}"#),
            None => r#"{"rope_theta": 1000000.0, "rope_type": "default"}"#.to_string(),
        };
        format!(
            r#"{{"model_type": "gemma3_text", "vocab_size": 262144, "hidden_size": {hidden},
            "intermediate_size": {inter}, "num_hidden_layers": {layers}, "num_attention_heads": {heads},
            "num_key_value_heads": {kv}, "head_dim": {head_dim}, "query_pre_attn_scalar": {scalar},
            "sliding_window": {window}, "_sliding_window_pattern": 6, "rms_norm_eps": 1e-6,
            "max_position_embeddings": {context}, "bos_token_id": 2, "eos_token_id": [1, 106],
            "rope_parameters": {{"full_attention": {full_rope},
                "sliding_attention": {{"rope_theta": 10000.0, "rope_type": "default"}}}}}}"#
        )
    }

    /// The text config of a published Gemma 4 model: (layers, hidden, intermediate, heads, KV heads
    /// of sliding / full layers, full layers' values from keys, sliding window, pattern, KV-sharing
    /// layers, double-wide MLPs, per-layer input width, context).
    fn gemma4_preset_json(name: &str) -> Option<String> {
        let (layers, hidden, inter, heads, kv, global_kv, k_eq_v, window, pattern, shared, wide, per_layer, context) =
            match name {
                "gemma4-e2b" => (35, 1536, 6144, 8, 1, 1, false, 512, 5, 20, true, 256, 131_072),
                "gemma4-e4b" => (42, 2560, 10240, 8, 2, 2, false, 512, 6, 18, false, 256, 131_072),
                "gemma4-31b" => (60, 5376, 21504, 32, 16, 4, true, 1024, 6, 0, false, 0, 262_144),
                _ => return None,
            };
        let layer_types: Vec<String> = (0..layers)
            .map(|i| if (i + 1) % pattern == 0 { "\"full_attention\"" } else { "\"sliding_attention\"" }.to_string())
            .collect();
        let images = if per_layer > 0 { "null" } else { "\"vision\"" };
        Some(format!(
            r#"{{"model_type": "gemma4_text", "vocab_size": 262144, "hidden_size": {hidden},
            "intermediate_size": {inter}, "num_hidden_layers": {layers}, "num_attention_heads": {heads},
            "num_key_value_heads": {kv}, "head_dim": 256, "global_head_dim": 512,
            "num_global_key_value_heads": {global_kv}, "attention_k_eq_v": {k_eq_v},
            "sliding_window": {window}, "layer_types": [{}], "num_kv_shared_layers": {shared},
            "use_double_wide_mlp": {wide}, "hidden_size_per_layer_input": {per_layer},
            "vocab_size_per_layer_input": 262144, "final_logit_softcapping": 30.0, "rms_norm_eps": 1e-6,
            "max_position_embeddings": {context}, "bos_token_id": 2, "eos_token_id": [1, 106],
            "use_bidirectional_attention": {images}}}"#,
            layer_types.join(", ")
        ))
    }

    #[test]
    fn presets_have_the_published_sizes() {
        // Parameter counts of the published models (text weights, tied embedding).
        for (name, approx) in [
            ("gemma3-270m", 268e6),
            ("gemma3-1b", 1.0e9),
            ("gemma3-4b", 3.88e9),
            ("gemma3-12b", 11.77e9),
            ("gemma3-27b", 27.0e9),
            // The E models' "effective" sizes: without the per-layer embedding tables (their
            // published 5.1B and 8B also count the vision and audio encoders).
            ("gemma4-e2b", 2.3e9),
            ("gemma4-e4b", 4.5e9),
            ("gemma4-31b", 30.7e9),
        ] {
            let c = GemmaConfig::preset(name).unwrap();
            c.validate().unwrap();
            let tables = c.hidden_size_per_layer_input * c.num_hidden_layers * c.vocab_size_per_layer_input;
            let n = (c.num_parameters() - tables) as f64;
            // Published sizes are rounded to 0.1B (E4B: 4.64B counted here against "4.5B").
            assert!((n / approx - 1.0).abs() < 0.04, "{name}: {n}");
        }
        let c = GemmaConfig::preset("gemma3-4b").unwrap();
        assert_eq!((c.rope(LayerType::FullAttention).factor, c.sliding_window), (8.0, Some(1024)));
        for name in GemmaConfig::PRESETS {
            let from_json = GemmaConfig::from_hf_json(&preset_json(name)).unwrap();
            assert_eq!(GemmaConfig::preset(name).unwrap(), from_json, "{name}: the value and its config.json differ");
        }
        assert!(GemmaConfig::preset("gemma3-2b").unwrap_err().to_string().contains("gemma3-1b"));
    }

    #[test]
    fn a_decode_step_reads_and_multiplies_what_the_shapes_say() {
        // Gemma 3 4B: 34 layers of 8 heads and 4 KV heads of 256; windows of 1,024 on 5 of 6.
        let c = GemmaConfig::preset("gemma3-4b").unwrap();
        let bf16 = burn_gemma_kernels::KvFormat::Dense(burn::tensor::DType::BF16);
        // Below the window every layer attends every position: K and V, 2 bytes each.
        assert_eq!(c.kv_read_bytes(bf16, 512), 34 * 2 * 4 * 256 * 2 * 512);
        // Past it, the 5 full layers of 34 (every sixth) read 4,096 positions, the 29 sliding 1,024.
        assert_eq!(c.kv_read_bytes(bf16, 4096), (5 * 4096 + 29 * 1024) * 2 * 4 * 256 * 2);
        assert_eq!(c.kv_read_bytes(burn_gemma_kernels::KvFormat::Int8, 512), 34 * 2 * 4 * (256 + 4) * 512);
        // With no position attended, a token multiplies each parameter once (the tied table as
        // the lm_head); each position attended adds its scores and values on every head.
        assert_eq!(c.decode_macs(0), c.num_parameters());
        assert_eq!(c.decode_macs(512) - c.decode_macs(0), 34 * 2 * 8 * 256 * 512);
    }
}
