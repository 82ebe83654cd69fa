//! Gemma 4 E models' per-layer embeddings (HF's `get_per_layer_inputs`,
//! `project_per_layer_inputs`, and the per-layer block of `Gemma4TextDecoderLayer`).
//!
//! Each token gets a `[layers, hidden_size_per_layer_input]` input: a row of its own table
//! (`embed_tokens_per_layer`, scaled by `sqrt(hidden_size_per_layer_input)`) plus a normed
//! projection of its embedding, over `sqrt(2)`. Layer `i` gates its slice with its hidden state
//! and adds the projected, normed result to the residual.
//!
//! Where the table lives: on the device, in the format of the main embedding table (Q8 when
//! the weights are quantized: E2B's 262,144 x 35 x 256 table is 2.4 GB in Q8 against 4.7 GB in
//! bf16), gathered by the same embedding kernel. A step reads one row per token (8.9 KB in
//! Q8), so the table costs memory, not bandwidth; keeping it on the device keeps the gather
//! keyed by the token id the previous step sampled there, with nothing copied from the host.

use crate::{
    config::NormScale,
    embedding::Embedding,
    norm::RmsNorm,
    projection::{Projection, WeightSettings},
    weights::WeightSource,
    GemmaConfig, ModelError,
};
use burn::{
    module::Module,
    tensor::{DType, Int, Tensor},
};
use burn_gemma_kernels::{AddNorm, GemmaBackend};

/// The model-level half: the table, the projection of the embeddings and its norm.
#[derive(Module, Debug)]
pub struct PerLayerEmbeddings<B: GemmaBackend> {
    /// `[vocab_size_per_layer_input, layers * width]`.
    pub embed_tokens_per_layer: Embedding<B>,
    /// `[layers * width, hidden]`.
    pub per_layer_model_projection: Projection<B>,
    /// Over each `[width]` slice.
    pub per_layer_projection_norm: RmsNorm<B>,
    #[module(skip)]
    pub layers: usize,
    #[module(skip)]
    pub width: usize,
    #[module(skip)]
    pub hidden: usize,
}

impl<B: GemmaBackend> PerLayerEmbeddings<B> {
    pub(crate) fn load(
        source: &mut impl WeightSource<B>,
        c: &GemmaConfig,
        settings: WeightSettings,
        device: &B::Device,
    ) -> Result<Option<Self>, ModelError> {
        let width = c.hidden_size_per_layer_input;
        if width == 0 {
            return Ok(None);
        }
        let (layers, hidden) = (c.num_hidden_layers, c.hidden_size);
        let table = [c.vocab_size_per_layer_input, layers * width];
        Ok(Some(Self {
            embed_tokens_per_layer: Embedding::load_table(
                source,
                "model.embed_tokens_per_layer.weight",
                table,
                settings,
                device,
            )?,
            per_layer_model_projection: Projection::load(
                source,
                &[("model.per_layer_model_projection", layers * width)],
                hidden,
                settings,
                device,
            )?,
            per_layer_projection_norm: RmsNorm::load(
                source,
                "model.per_layer_projection_norm",
                width,
                c.rms_norm_eps,
                NormScale::Weight,
                device,
            )?,
            layers,
            width,
            hidden,
        }))
    }

    /// Every layer's input, `[batch, seq, layers, width]` (f32), from the token ids and their
    /// scaled embeddings `embedded` (`[batch, seq, hidden]`): `(norm(projection(embedded) /
    /// sqrt(hidden)) + table[ids] * sqrt(width)) / sqrt(2)`, in two kernels (the gather, the
    /// projection) and one add + RMSNorm whose pre-norm is the projection's norm and whose scale
    /// is `1 / sqrt(2)`. RMSNorm of `x / c` with epsilon `e` is RMSNorm of `x` with `e * c^2`:
    /// the projection's scale goes into the epsilon.
    pub fn inputs(&self, ids: Tensor<B, 2, Int>, embedded: Tensor<B, 3>, dtype: DType) -> Tensor<B, 4> {
        let [batch, seq] = ids.dims();
        let (layers, width, rows) = (self.layers, self.width, batch * seq * self.layers);
        let scale = crate::embedding::embed_scale(self.width, dtype);
        let own = self.embed_tokens_per_layer.embed(ids, scale, dtype).reshape([1, rows, width]);
        let projected = self.per_layer_model_projection.forward(embedded).reshape([1, rows, width]);
        let norm = &self.per_layer_projection_norm;
        let norms = AddNorm {
            post: Some(norm.weight.val()),
            // The normalized sum is not used; any weight of the width serves.
            weight: norm.weight.val(),
            eps: norm.eps * self.hidden as f64,
            scale: 0.5f64.sqrt(),
            out_dtype: dtype,
        };
        let (sum, _) = B::add_rms_norm(own, projected, &norms);
        sum.reshape([batch, seq, layers, width])
    }

    /// Bytes on the device.
    pub fn device_bytes(&self) -> usize {
        self.embed_tokens_per_layer.device_bytes() + self.per_layer_model_projection.device_bytes()
    }
}

/// The layer-level half: gate, projection and norm of one layer's input.
#[derive(Module, Debug)]
pub struct PerLayerInput<B: GemmaBackend> {
    /// `[width, hidden]`.
    pub per_layer_input_gate: Projection<B>,
    /// `[hidden, width]`.
    pub per_layer_projection: Projection<B>,
    pub post_per_layer_input_norm: RmsNorm<B>,
}

impl<B: GemmaBackend> PerLayerInput<B> {
    pub(crate) fn load(
        source: &mut impl WeightSource<B>,
        prefix: &str,
        c: &GemmaConfig,
        settings: WeightSettings,
        device: &B::Device,
    ) -> Result<Option<Self>, ModelError> {
        let (width, hidden) = (c.hidden_size_per_layer_input, c.hidden_size);
        if width == 0 {
            return Ok(None);
        }
        let name = |n: &str| format!("{prefix}.{n}");
        Ok(Some(Self {
            per_layer_input_gate: Projection::load(
                source,
                &[(&name("per_layer_input_gate"), width)],
                hidden,
                settings,
                device,
            )?,
            per_layer_projection: Projection::load(
                source,
                &[(&name("per_layer_projection"), hidden)],
                width,
                settings,
                device,
            )?,
            post_per_layer_input_norm: RmsNorm::load(
                source,
                &name("post_per_layer_input_norm"),
                hidden,
                c.rms_norm_eps,
                NormScale::Weight,
                device,
            )?,
        }))
    }

    /// `projection(gelu_tanh(gate(h)) * inputs[:, :, layer])` for the residual `h` (`[batch,
    /// seq, hidden]`) and every layer's inputs (`[batch, seq, layers, width]`, read in place: a
    /// sliced copy made by Burn would not be part of a recorded decode step); the post-norm is
    /// applied by the residual add.
    pub fn forward(&self, h: Tensor<B, 3>, inputs: Tensor<B, 4>, layer: usize) -> Tensor<B, 3> {
        let gate = self.per_layer_input_gate.forward(h);
        self.per_layer_projection.forward(B::gelu_gate(gate, inputs, layer))
    }

    /// Bytes on the device.
    pub fn device_bytes(&self) -> usize {
        self.per_layer_input_gate.device_bytes() + self.per_layer_projection.device_bytes()
    }
}
