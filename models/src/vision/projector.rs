//! HF's `Gemma3MultiModalProjector`: the tower's patches averaged over square windows down to
//! `mm_tokens_per_image` (`AvgPool2d`), Gemma's RMSNorm (`mm_soft_emb_norm`, scaling by
//! `1 + weight`), and the projection to the text model's width.

use super::config::Gemma3VisionConfig;
use crate::{
    norm::RmsNorm,
    projection::Projection,
    weights::{WeightKind, WeightSource},
    ModelError, NormScale,
};
use burn::{
    module::Module,
    tensor::{DType, Tensor},
};
use burn_gemma_kernels::{GemmaBackend, HostMatrix};

#[derive(Module, Debug)]
pub struct Gemma3MultiModalProjector<B: GemmaBackend> {
    /// `mm_input_projection_weight` (HF stores it `[vision_hidden, text_hidden]`) as a projection
    /// `[text_hidden, vision_hidden]`, multiplied by the crate's products (CUDA's f32 matmul in
    /// Burn rounds through TF32).
    pub mm_input_projection_weight: Projection<B>,
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
        let name = format!("{prefix}.mm_input_projection_weight");
        let weight: Tensor<B, 2> = source.load(&name, [v, c.text_hidden_size], WeightKind::Matrix, dtype, device)?;
        // Rows of the output, contiguous.
        let weight = Tensor::from_data(weight.transpose().into_data(), (device, dtype));
        let weight = B::upload_matrix(HostMatrix::Dense(weight), device)
            .map_err(|source| ModelError::Upload { name, source })?;
        Ok(Self {
            mm_input_projection_weight: Projection { weight },
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
        let dtype = self.mm_input_projection_weight.weight.input_dtype();
        self.mm_input_projection_weight.forward(self.mm_soft_emb_norm.forward(pooled).cast(dtype))
    }
}
