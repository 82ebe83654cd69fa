//! Gemma 4's routed expert block (26B-A4B), beside each layer's dense MLP (HF's
//! `Gemma4TextRouter` and `Gemma4TextExperts`).
//!
//! The router picks `top_k_experts` of `num_experts` per token; each chosen expert is a gated MLP
//! of its own. The choice stays on the device ([`GemmaBackend::route_experts`]) and the
//! experts' products read it there ([`GemmaBackend::project_experts`]): at decode only the
//! chosen experts' bytes are read and nothing goes back to the host, so a decode step records
//! as one CUDA graph. The experts are kept as the checkpoint stores them (one `[experts, rows,
//! cols]` tensor per projection, GGUF blocks as they are).

use crate::{
    config::NormScale,
    norm::RmsNorm,
    projection::{load_matrix, WeightSettings},
    weights::{host_values, WeightKind, WeightSource},
    GemmaConfig, ModelError, MoeConfig,
};
use burn::{
    module::{Module, Param},
    tensor::{DType, Tensor, TensorData},
};
use burn_gemma_kernels::{
    graph, linear::GEMV_MAX_ROWS, AddNorm, Epilogue, ExpertProduct, Experts, GemmaBackend, HostMatrix, Matrix, Routes,
};

/// Scores every expert for each token and keeps the best `top_k`, their weights renormalized and
/// scaled per expert.
#[derive(Module, Debug)]
pub struct Router<B: GemmaBackend> {
    /// `proj` times `scale * hidden^-0.5` per input column (HF scales the normalized input by
    /// both before the projection; folded here once in f32), `[num_experts, hidden]` in the
    /// model dtype: HF multiplies in the checkpoint's dtype, and in bf16 a prompt's scores take
    /// the matrix units (in f32 they took a millisecond per 26B-A4B layer of a 512-token prompt,
    /// `docs/runs/gpu/2026-11-25-experts-gemm.md`).
    pub proj: Matrix<B>,
    /// The same folded matrix in f32 where `proj` is not (bf16 and f16 models), for decode
    /// steps (at most [`GEMV_MAX_ROWS`] tokens): their scores then take no cast, and Burn's
    /// casts are not recorded into CUDA graphs (a replayed step read the recording's router
    /// input: the bf16 expert fixture's logits 2.07 from eager on the H200).
    pub step_proj: Option<Matrix<B>>,
    /// The weightless input norm.
    pub norm: RmsNorm<B>,
    /// `per_expert_scale`: `[num_experts]`, f32.
    pub per_expert_scale: Param<Tensor<B, 1>>,
    #[module(skip)]
    pub top_k: usize,
}

impl<B: GemmaBackend> Router<B> {
    fn load(
        source: &mut impl WeightSource<B>,
        prefix: &str,
        c: &GemmaConfig,
        moe: MoeConfig,
        dtype: DType,
        device: &B::Device,
    ) -> Result<Self, ModelError> {
        let (experts, hidden) = (moe.num_experts, c.hidden_size);
        let proj: Tensor<B, 2> =
            source.load(&format!("{prefix}.proj.weight"), [experts, hidden], WeightKind::Matrix, DType::F32, device)?;
        let scale: Tensor<B, 1> =
            source.load(&format!("{prefix}.scale"), [hidden], WeightKind::Scale, DType::F32, device)?;
        // Folded on the host, so that every backend holds the same f32 values.
        let name = format!("{prefix}.proj.weight");
        let (proj, scale) = (host_values(proj, &name)?, host_values(scale, &format!("{prefix}.scale"))?);
        let root = (hidden as f64).powf(-0.5);
        let folded: Vec<f32> = proj
            .chunks(hidden.max(1))
            .flat_map(|row| row.iter().zip(&scale).map(|(&w, &s)| (w as f64 * s as f64 * root) as f32))
            .collect();
        let folded = Tensor::<B, 2>::from_data(TensorData::new(folded, [experts, hidden]), (device, DType::F32));
        let upload = |t: Tensor<B, 2>| {
            B::upload_matrix(HostMatrix::Dense(t), device)
                .map_err(|source| ModelError::Upload { name: name.clone(), source })
        };
        let step_proj = match dtype {
            DType::F32 => None,
            _ => Some(upload(folded.clone())?),
        };
        let proj = upload(folded.cast(dtype))?;
        Ok(Self {
            proj,
            step_proj,
            norm: RmsNorm::unit(hidden, c.rms_norm_eps, device),
            per_expert_scale: Param::from_tensor(source.load(
                &format!("{prefix}.per_expert_scale"),
                [experts],
                WeightKind::Scale,
                DType::F32,
                device,
            )?),
            top_k: moe.top_k_experts,
        })
    }

    /// Routes `x` (`[tokens, hidden]`, the f32 residual stream before the MLP): the norm in
    /// f32, the scores in the projection's dtype (f32 for decode steps), the softmax and top-k
    /// in f32.
    pub fn route(&self, x: Tensor<B, 2>) -> Result<Routes<B>, ModelError> {
        let h = self.norm.forward(x.cast(DType::F32));
        let scores = match &self.step_proj {
            None => B::project(h, &self.proj, Epilogue::Identity),
            Some(step) if h.dims()[0] <= GEMV_MAX_ROWS => B::project(h, step, Epilogue::Identity),
            Some(_) => {
                // A prompt's scores on the matrix units, through Burn's casts: a step of this
                // many rows is not replayable.
                graph::unsupported(|| "the expert router's casts of more than a decode step's rows".into());
                B::project(h.cast(self.proj.input_dtype()), &self.proj, Epilogue::Identity).cast(DType::F32)
            }
        };
        Ok(B::route_experts(scores, self.per_expert_scale.val(), self.top_k)?)
    }
}

/// The expert block of one layer: router, experts and its three norms.
#[derive(Module, Debug)]
pub struct MoeBlock<B: GemmaBackend> {
    pub router: Router<B>,
    /// Every expert's `gate_up_proj` (`[2 * moe_intermediate, hidden]`: gate rows, then up).
    pub gate_up_proj: Experts<B>,
    /// Every expert's `down_proj` (`[hidden, moe_intermediate]`).
    pub down_proj: Experts<B>,
    pub pre_feedforward_layernorm_2: RmsNorm<B>,
    pub post_feedforward_layernorm_1: RmsNorm<B>,
    pub post_feedforward_layernorm_2: RmsNorm<B>,
}

impl<B: GemmaBackend> MoeBlock<B> {
    pub(crate) fn load(
        source: &mut impl WeightSource<B>,
        prefix: &str,
        c: &GemmaConfig,
        moe: MoeConfig,
        settings: WeightSettings,
        device: &B::Device,
    ) -> Result<Self, ModelError> {
        let (hidden, inter, experts) = (c.hidden_size, moe.moe_intermediate_size, moe.num_experts);
        let mut load_experts = |name: &str, shape: [usize; 3]| {
            let name = format!("{prefix}.experts.{name}");
            let stacked = load_matrix(source, &name, &shape, settings, device)?;
            B::upload_experts(stacked, experts, device).map_err(|source| ModelError::Upload { name, source })
        };
        let gate_up_proj = load_experts("gate_up_proj", [experts, 2 * inter, hidden])?;
        let down_proj = load_experts("down_proj", [experts, hidden, inter])?;
        let norm = |source: &mut _, name: &str| {
            RmsNorm::load(source, &format!("{prefix}.{name}"), hidden, c.rms_norm_eps, NormScale::Weight, device)
        };
        Ok(Self {
            router: Router::load(source, &format!("{prefix}.router"), c, moe, settings.dtype, device)?,
            gate_up_proj,
            down_proj,
            pre_feedforward_layernorm_2: norm(source, "pre_feedforward_layernorm_2")?,
            post_feedforward_layernorm_1: norm(source, "post_feedforward_layernorm_1")?,
            post_feedforward_layernorm_2: norm(source, "post_feedforward_layernorm_2")?,
        })
    }

    /// HF's expert branch of `Gemma4TextDecoderLayer.forward` and the layer's post-MLP norm
    /// after it: `post_feedforward_layernorm(post_1(mlp_out) + post_2(experts(pre_2(residual))))`,
    /// the sum and the last norm in one add + RMSNorm kernel. `residual` is `[batch, seq,
    /// hidden]` (f32, the stream before the MLP), `mlp_out` the dense MLP's output in the
    /// activation dtype, which the result is in.
    ///
    /// Fails where the routes must be read back (prompts, host backends) and the read fails.
    pub fn forward(
        &self,
        residual: Tensor<B, 3>,
        mlp_out: Tensor<B, 3>,
        post_feedforward_layernorm: &RmsNorm<B>,
    ) -> Result<Tensor<B, 3>, ModelError> {
        let dtype = mlp_out.dtype();
        let [batch, seq, hidden] = residual.dims();
        let flat = residual.reshape([batch * seq, hidden]);
        let routes = self.router.route(flat.clone())?;
        let x = self.pre_feedforward_layernorm_2.forward(flat);
        let h = B::project_experts(x, &self.gate_up_proj, &routes, ExpertProduct::GeluHalves, dtype)?;
        let experts = B::project_experts(h, &self.down_proj, &routes, ExpertProduct::WeightedSum, dtype)?;
        let norms = AddNorm {
            post: Some(self.post_feedforward_layernorm_2.weight.val()),
            weight: post_feedforward_layernorm.weight.val(),
            eps: post_feedforward_layernorm.eps,
            scale: 1.0,
            out_dtype: dtype,
        };
        let dense = self.post_feedforward_layernorm_1.forward(mlp_out);
        let (_, normed) = B::add_rms_norm(dense, experts.reshape([batch, seq, hidden]), &norms);
        Ok(normed)
    }

    /// Bytes on the device.
    pub fn device_bytes(&self) -> usize {
        let step = self.router.step_proj.as_ref().map_or(0, Matrix::device_bytes);
        self.router.proj.device_bytes() + step + self.gate_up_proj.device_bytes() + self.down_proj.device_bytes()
    }
}
