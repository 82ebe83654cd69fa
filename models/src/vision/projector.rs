//! HF's `Gemma3MultiModalProjector`: the tower's patches averaged over square windows down to
//! `mm_tokens_per_image` (`AvgPool2d`), Gemma's RMSNorm (`mm_soft_emb_norm`, scaling by
//! `1 + weight`), and the projection to the text model's width.

use super::config::Gemma3VisionConfig;
use crate::{
    norm::RmsNorm,
    weights::{WeightKind, WeightSource},
    ModelError, NormScale,
};
use burn::{
    module::Module,
    tensor::{DType, Tensor},
};
use burn_gemma_kernels::GemmaBackend;

#[derive(Module, Debug)]
pub struct Gemma3MultiModalProjector<B: GemmaBackend> {
    /// `mm_input_projection_weight`: `[vision_hidden, text_hidden]` (input rows, as HF stores it).
    pub mm_input_projection_weight: Tensor<B, 2>,
    pub mm_soft_emb_norm: RmsNorm<B>,
    #[module(skip)]
    pub patches_per_side: usize,
    #[module(skip)]
    pub tokens_per_side: usize,
}

impl<B: GemmaBackend> Gemma3MultiModalProjector<B> {
    pub(crate) fn load(
        source: &mut impl WeightSource<B>,
        prefix: &str,
        c: &Gemma3VisionConfig,
        dtype: DType,
        device: &B::Device,
    ) -> Result<Self, ModelError> {
        let v = c.vision.hidden_size;
        Ok(Self {
            mm_input_projection_weight: source.load(
                &format!("{prefix}.mm_input_projection_weight"),
                [v, c.text_hidden_size],
                WeightKind::Matrix,
                dtype,
                device,
            )?,
            mm_soft_emb_norm: RmsNorm::load(
                source,
                &format!("{prefix}.mm_soft_emb_norm"),
                v,
                c.vision.layer_norm_eps,
                NormScale::OnePlusWeight,
                device,
            )?,
            patches_per_side: c.vision.patches_per_side(),
            tokens_per_side: c.tokens_per_side(),
        })
    }

    /// `[images, patches, vision_hidden]` -> `[images, mm_tokens_per_image, text_hidden]`.
    pub fn forward(&self, patches: Tensor<B, 3>) -> Tensor<B, 3> {
        let [n, _, hidden] = patches.dims();
        let (side, tokens) = (self.patches_per_side, self.tokens_per_side);
        let k = side / tokens;
        // `[n, (tr, kr, tc, kc), h]`: average over each token's `k x k` window.
        let pooled = patches
            .cast(DType::F32)
            .reshape([n * tokens, k, tokens, k * hidden])
            .mean_dim(1)
            .reshape([n * tokens * tokens, k, hidden])
            .mean_dim(1)
            .reshape([n, tokens * tokens, hidden]);
        let normed = self.mm_soft_emb_norm.forward(pooled).cast(self.mm_input_projection_weight.dtype());
        normed.matmul(self.mm_input_projection_weight.clone().unsqueeze::<3>())
    }
}
