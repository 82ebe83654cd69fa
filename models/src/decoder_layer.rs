//! One decoder layer (HF's `Gemma3DecoderLayer` / `Gemma4TextDecoderLayer`): attention and the
//! MLP between their norms, Gemma 4's expert block and per-layer input, the layer scalar.

use crate::{
    attention::{Attention, LayerKv},
    mlp::Mlp,
    moe::MoeBlock,
    norm::{ResidualStream, RmsNorm},
    per_layer::PerLayerInput,
    projection::WeightSettings,
    tensor_parallel::TensorParallel,
    weights::{host_values, WeightKind, WeightSource},
    Architecture, GemmaConfig, ModelError,
};
use burn::{
    module::Module,
    tensor::{DType, Tensor},
};
use burn_gemma_kernels::{GemmaBackend, RopeTables, StepPosition};

/// One decoder layer. Gemma 1 has a norm before attention and one before the MLP; Gemma 2, 3
/// and 4 also normalize the outputs of both. Gemma 4 may add a routed expert block beside the
/// MLP, a per-layer input after it, and scales the layer's output.
#[derive(Module, Debug)]
pub struct DecoderLayer<B: GemmaBackend> {
    pub self_attn: Attention<B>,
    pub mlp: Mlp<B>,
    pub input_layernorm: RmsNorm<B>,
    pub post_attention_layernorm: Option<RmsNorm<B>>,
    pub pre_feedforward_layernorm: RmsNorm<B>,
    pub post_feedforward_layernorm: Option<RmsNorm<B>>,
    /// Gemma 4 26B-A4B.
    pub moe: Option<MoeBlock<B>>,
    /// Gemma 4 E models.
    pub per_layer_input: Option<PerLayerInput<B>>,
    /// Gemma 4's `layer_scalar` (1 before), read once at load: it multiplies the residual in
    /// the kernel of the next add.
    #[module(skip)]
    pub layer_scalar: f64,
}

impl<B: GemmaBackend> DecoderLayer<B> {
    pub(crate) fn load(
        source: &mut impl WeightSource<B>,
        index: usize,
        c: &GemmaConfig,
        settings: WeightSettings,
        device: &B::Device,
    ) -> Result<Self, ModelError> {
        let prefix = format!("model.layers.{index}");
        let scale = c.model_type.norm_scale();
        let norm = |source: &mut _, name: &str| {
            RmsNorm::load(source, &format!("{prefix}.{name}"), c.hidden_size, c.rms_norm_eps, scale, device)
        };
        let self_attn = Attention::load(source, &format!("{prefix}.self_attn"), index, c, settings, device)?;
        let mlp = Mlp::load(source, &format!("{prefix}.mlp"), index, c, settings, device)?;
        let input_layernorm = norm(source, "input_layernorm")?;
        if !c.model_type.has_sandwich_norms() {
            // Gemma 1 calls its pre-MLP norm `post_attention_layernorm`.
            return Ok(Self {
                self_attn,
                mlp,
                input_layernorm,
                post_attention_layernorm: None,
                pre_feedforward_layernorm: norm(source, "post_attention_layernorm")?,
                post_feedforward_layernorm: None,
                moe: None,
                per_layer_input: None,
                layer_scalar: 1.0,
            });
        }
        let post_attention_layernorm = Some(norm(source, "post_attention_layernorm")?);
        let pre_feedforward_layernorm = norm(source, "pre_feedforward_layernorm")?;
        let post_feedforward_layernorm = Some(norm(source, "post_feedforward_layernorm")?);
        let moe = match c.moe {
            Some(moe) => Some(MoeBlock::load(source, &prefix, c, moe, settings, device)?),
            None => None,
        };
        let per_layer_input = PerLayerInput::load(source, &prefix, c, settings, device)?;
        let layer_scalar = if c.model_type == Architecture::Gemma4 {
            let name = format!("{prefix}.layer_scalar");
            let t: Tensor<B, 1> = source.load(&name, [1], WeightKind::Scale, DType::F32, device)?;
            match host_values(t, &name)?.first().copied() {
                Some(v) if v.is_finite() => v as f64,
                other => return Err(ModelError::Source(format!("{name} is not a finite number: {other:?}").into())),
            }
        } else {
            1.0
        };
        Ok(Self {
            self_attn,
            mlp,
            input_layernorm,
            post_attention_layernorm,
            pre_feedforward_layernorm,
            post_feedforward_layernorm,
            moe,
            per_layer_input,
            layer_scalar,
        })
    }

    /// The block at `position` (HF's `Gemma3DecoderLayer.forward`); each `residual + h` is
    /// added by the next norm, in one kernel ([`ResidualStream`]).
    /// `per_layer_input`: the per-layer inputs (`[batch, seq, layers, width]`) and this layer's
    /// index among them (Gemma 4 E models); `parallel`: the shard this layer is part of, whose
    /// attention and MLP outputs are summed over the shards.
    pub(crate) fn forward<'a>(
        &'a self,
        stream: ResidualStream<'a, B>,
        rope: &RopeTables<B>,
        kv: LayerKv<'_, B>,
        position: &StepPosition<B>,
        per_layer_input: Option<(Tensor<B, 4>, usize)>,
        parallel: Option<&TensorParallel<B>>,
    ) -> Result<ResidualStream<'a, B>, ModelError> {
        // A tensor-parallel shard's attention and MLP outputs are its part of a sum.
        let summed = |h: Tensor<B, 3>| match parallel {
            Some(parallel) => parallel.sum(h),
            None => Ok(h),
        };
        let (stream, h) = stream.norm(&self.input_layernorm);
        let h = summed(self.self_attn.forward(h, rope, kv, position)?)?;
        let stream = stream.add(h, self.post_attention_layernorm.as_ref());
        let (stream, h) = stream.norm(&self.pre_feedforward_layernorm);
        let h = summed(self.mlp.forward(h))?;
        let mut stream = match &self.moe {
            // The expert block applies the post-MLP norm itself (fused with its sum); the
            // loader builds one only beside that norm.
            Some(moe) => {
                let post_norm = self.post_feedforward_layernorm.as_ref().ok_or_else(|| {
                    ModelError::InvalidInput("an expert block needs the layer's post-feedforward norm".into())
                })?;
                let (stream, residual) = stream.residual();
                let h = moe.forward(residual, h, post_norm)?;
                stream.add(h, None)
            }
            None => stream.add(h, self.post_feedforward_layernorm.as_ref()),
        };
        if let (Some(block), Some((inputs, layer))) = (&self.per_layer_input, per_layer_input) {
            // The gate reads the residual itself, which the pending add writes.
            let (settled, residual) = stream.settled(&block.post_per_layer_input_norm);
            let h = block.forward(residual, inputs, layer);
            stream = settled.add(h, Some(&block.post_per_layer_input_norm));
        }
        Ok(stream.scaled(self.layer_scalar))
    }
}
