//! Gemma 4's assistant drafters (HF's `Gemma4AssistantForCausalLM`, `gemma-4-*-it-assistant`):
//! a small Gemma 4 stack that drafts tokens for its target from the target's own state. Each
//! drafting round runs at one position `p`, the position of the last token the target was given
//! but has not run: the input is the target's (scaled) embedding of that token beside the
//! target's final hidden state at `p - 1` (then the assistant's own projected state, step after
//! step), projected to the assistant's width; every layer attends, at position `p`, over the
//! target's keys and values of positions `0..p` (those of the target's last layer of the same
//! type with keys of its own; a sliding layer over the target's window); the lm_head is the
//! tied table, whole or masked to a few clusters of tokens ([`MaskedEmbedder`]).
//!
//! As HF's drafting loop (`SinglePositionMultiTokenCandidateGenerator`) runs it, with one
//! choice of ours where HF's pipeline has none that holds: a sliding layer attends over the
//! last `sliding_window` positions before `p`, what the target's ring holds (HF's inclusive
//! bidirectional window would admit one more, which a windowed target cache no longer has).

pub mod config;
pub mod masked;

pub use config::{AssistantConfig, OrderedEmbeddings};
pub use masked::MaskedEmbedder;

use crate::{
    attention::{KvCache, LayerKv},
    decoder_layer::DecoderLayer,
    embedding::Embedding,
    norm::{ResidualStream, RmsNorm},
    projection::{Projection, WeightSettings},
    rope::RotaryEmbeddings,
    weights::WeightSource,
    Architecture, Gemma, ModelError, ModelOptions,
};
use burn::{
    module::Module,
    tensor::{DType, Int, Tensor},
};
use burn_gemma_kernels::{GemmaBackend, StepPosition};

/// A Gemma 4 assistant.
#[derive(Module, Debug)]
pub struct Gemma4Assistant<B: GemmaBackend> {
    /// `model.embed_tokens`: only the tied lm_head (the stack's inputs are projections).
    pub(crate) embed_tokens: Embedding<B>,
    pub(crate) layers: Vec<DecoderLayer<B>>,
    pub(crate) norm: RmsNorm<B>,
    /// `[hidden, 2 * backbone]`: the target's embedding and hidden state to the stack's width.
    pub(crate) pre_projection: Projection<B>,
    /// `[backbone, hidden]`: the stack's final state back to the target's width, for the next step.
    pub(crate) post_projection: Projection<B>,
    pub(crate) masked_embedding: Option<MaskedEmbedder<B>>,
    #[module(skip)]
    pub(crate) rotary_emb: RotaryEmbeddings,
    #[module(skip)]
    pub(crate) config: AssistantConfig,
    #[module(skip)]
    pub(crate) dtype: DType,
}

/// What one drafting step starts from.
#[derive(Debug, Clone)]
pub struct DraftInput<B: GemmaBackend> {
    /// `[batch, 1]`: the last token of each sequence (the target's pending one, then the
    /// assistant's own drafts).
    pub ids: Tensor<B, 2, Int>,
    /// `[batch, backbone_hidden_size]`: the target's final hidden state (after its norm) at the
    /// position before, or the previous step's [`DraftOutput::hidden`].
    pub hidden: Tensor<B, 2>,
}

/// What one drafting step gives.
#[derive(Debug, Clone)]
pub struct DraftOutput<B: GemmaBackend> {
    /// `[batch, vocab]` (f32): the draft's logits (no final softcap, as HF's assistant).
    pub logits: Tensor<B, 2>,
    /// `[batch, backbone_hidden_size]`: the projected state the next step starts from.
    pub hidden: Tensor<B, 2>,
}

impl<B: GemmaBackend> Gemma4Assistant<B> {
    /// Builds the assistant from a weight source (HF names: `model.*`, `pre_projection`,
    /// `post_projection`, `masked_embedding.*`), its matrices as `options` say (its KV options
    /// are unused: it has no cache).
    pub fn load(
        config: AssistantConfig,
        source: &mut (impl WeightSource<B> + Send),
        options: &ModelOptions,
        device: &B::Device,
    ) -> Result<Self, ModelError> {
        config.validate()?;
        let dtype = options.dtype;
        if !matches!(dtype, DType::F32 | DType::F16 | DType::BF16) || !B::supports_dtype(device, dtype) {
            return Err(ModelError::BackendDtype { backend: B::name(device), dtype });
        }
        let settings = WeightSettings { dtype, format: options.weights };
        let text = &config.text;
        let (hidden, backbone) = (text.hidden_size, config.backbone_hidden_size);
        let model = B::memory_persistent_allocations(device, source, |source| {
            Ok(Self {
                embed_tokens: Embedding::load(source, text, settings, device)?,
                layers: (0..text.num_hidden_layers)
                    .map(|i| DecoderLayer::load(source, i, text, settings, device))
                    .collect::<Result<_, _>>()?,
                norm: RmsNorm::load(
                    source,
                    "model.norm",
                    hidden,
                    text.rms_norm_eps,
                    text.model_type.norm_scale(),
                    device,
                )?,
                pre_projection: Projection::load(
                    source,
                    &[("pre_projection", hidden)],
                    2 * backbone,
                    settings,
                    device,
                )?,
                post_projection: Projection::load(source, &[("post_projection", backbone)], hidden, settings, device)?,
                masked_embedding: match config.ordered_embeddings {
                    Some(o) => Some(MaskedEmbedder::load(source, o, (text.vocab_size, hidden), settings, device)?),
                    None => None,
                },
                rotary_emb: RotaryEmbeddings::new(text),
                config: config.clone(),
                dtype,
            })
        });
        B::memory_cleanup(device);
        model
    }

    /// Random weights in the exact shapes of `config`.
    pub fn random(
        config: AssistantConfig,
        seed: u64,
        options: &ModelOptions,
        device: &B::Device,
    ) -> Result<Self, ModelError> {
        Self::load(config, &mut crate::RandomWeights::new(seed), options, device)
    }

    /// The validated config.
    pub fn config(&self) -> &AssistantConfig {
        &self.config
    }

    /// The activation dtype.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Bytes the weights occupy on the device.
    pub fn weight_bytes(&self) -> usize {
        let layers: usize = self
            .layers
            .iter()
            .map(|l| l.self_attn.qkv_proj.device_bytes() + l.self_attn.o_proj.device_bytes() + l.mlp.device_bytes())
            .sum();
        self.embed_tokens.device_bytes()
            + layers
            + self.pre_projection.device_bytes()
            + self.post_projection.device_bytes()
            + self.masked_embedding.as_ref().map_or(0, MaskedEmbedder::device_bytes)
    }

    /// Fails unless this assistant can draft for `target`: a Gemma 4 of its backbone width and
    /// vocabulary, in its activation dtype, with a layer of each of its layer types whose keys
    /// have its head size, KV heads and window.
    pub fn check_target(&self, target: &Gemma<B>) -> Result<(), ModelError> {
        let (a, t) = (&self.config.text, target.config());
        let mismatch = |what: &str, ours: String, theirs: String| {
            Err(ModelError::InvalidInput(format!(
                "the assistant cannot draft for this model: its {what} is {ours}, the model's {theirs}"
            )))
        };
        if t.model_type != Architecture::Gemma4 {
            return mismatch("target", "Gemma 4".into(), format!("{:?}", t.model_type));
        }
        if self.config.backbone_hidden_size != t.hidden_size {
            return mismatch(
                "backbone_hidden_size",
                self.config.backbone_hidden_size.to_string(),
                t.hidden_size.to_string(),
            );
        }
        if a.vocab_size != t.vocab_size {
            return mismatch("vocab_size", a.vocab_size.to_string(), t.vocab_size.to_string());
        }
        if self.dtype != target.dtype() {
            return mismatch("dtype", format!("{:?}", self.dtype), format!("{:?}", target.dtype()));
        }
        for kind in a.layer_types.iter().copied() {
            if !t.layer_types.contains(&kind) {
                return mismatch("layer types", format!("{kind:?}"), "none of that type".into());
            }
            for (what, ours, theirs) in [
                ("head size", a.head_dim_of(kind), t.head_dim_of(kind)),
                ("KV heads", a.kv_heads_of(kind), t.kv_heads_of(kind)),
                ("window", a.window(kind).unwrap_or(0), t.window(kind).unwrap_or(0)),
            ] {
                if ours != theirs {
                    return mismatch(&format!("{kind:?} {what}"), ours.to_string(), theirs.to_string());
                }
            }
        }
        Ok(())
    }

    /// One drafting step at the position after the last that `cache` (the target's) holds:
    /// HF's `Gemma4AssistantForCausalLM.forward` with the target's `shared_kv_states`.
    ///
    /// # Shapes
    /// - `input.ids`: `[batch, 1]`; `input.hidden`: `[batch, backbone_hidden_size]`
    /// - output logits `[batch, vocab]`, hidden `[batch, backbone_hidden_size]`
    pub fn step(
        &self,
        target: &Gemma<B>,
        cache: &KvCache<B>,
        input: DraftInput<B>,
    ) -> Result<DraftOutput<B>, ModelError> {
        let [batch, one] = input.ids.dims();
        let backbone = self.config.backbone_hidden_size;
        if one != 1 || input.hidden.dims() != [batch, backbone] || batch == 0 || batch > cache.batch() {
            return Err(ModelError::InvalidInput(format!(
                "a drafting step takes one token and a hidden state of {backbone} per sequence; got tokens {:?} and \
                 hidden states {:?}",
                input.ids.dims(),
                input.hidden.dims()
            )));
        }
        let position = cache.len();
        if position == 0 {
            return Err(ModelError::InvalidInput("the assistant drafts after the model has run a token".into()));
        }
        let t = target.config();
        let producers = self
            .layers
            .iter()
            .map(|layer| {
                let kind = layer.self_attn.settings.layer_type;
                t.layer_types.iter().rposition(|&k| k == kind).and_then(|i| cache.layer(i)).ok_or_else(|| {
                    ModelError::InvalidInput(format!("the model has no {kind:?} layer for the assistant to read"))
                })
            })
            .collect::<Result<Vec<_>, _>>()?;
        let device = self.norm.weight.val().device();
        let embedded = target.embed_scaled(input.ids).cast(self.dtype);
        let x = Tensor::cat(vec![embedded, input.hidden.cast(self.dtype).reshape([batch, 1, backbone])], 2);
        let x = self.pre_projection.forward(x);
        let rope = self.rotary_emb.tables::<B>(position + 1, &device);
        let at = StepPosition::Host(position);
        let mut stream = ResidualStream::new(x, self.dtype);
        for (layer, producer) in self.layers.iter().zip(producers) {
            let rope = rope.get(layer.self_attn.settings.layer_type);
            stream = layer.forward(stream, rope, LayerKv::Before(producer), &at, None, None)?;
        }
        let (_, hidden) = stream.norm(&self.norm);
        let hidden = hidden.reshape([batch, self.config.text.hidden_size]);
        let projected = self.post_projection.forward(hidden.clone().unsqueeze_dim(1)).reshape([batch, backbone]);
        let logits = match &self.masked_embedding {
            Some(masked) => masked.logits(hidden, &self.embed_tokens),
            None => self.embed_tokens.project(hidden).cast(DType::F32),
        };
        Ok(DraftOutput { logits, hidden: projected })
    }
}
