//! Gemma 4's routed expert block (26B-A4B), beside each layer's dense MLP (HF's
//! `Gemma4TextRouter` and `Gemma4TextExperts`).
//!
//! The router picks `top_k_experts` of `num_experts` per token; each chosen expert is a gated MLP
//! of its own. The choice is read back to the host and only the chosen experts' matrices are
//! multiplied: at decode (one token) that reads `top_k` experts' bytes, not all of them. Reading
//! the choice back makes a MoE layer's step unrecordable as a CUDA graph (decode of such models
//! runs eagerly, saying so once).

use crate::{
    config::NormScale,
    mlp::Mlp,
    norm::RmsNorm,
    projection::{Projection, WeightSettings},
    weights::{host_values, quantize, WeightKind, WeightSource},
    GemmaConfig, ModelError, MoeConfig, WeightFormat,
};
use burn::{
    module::{Module, Param},
    tensor::{activation::softmax, DType, IndexingUpdateOp, Int, Tensor, TensorData},
};
use burn_gemma_kernels::{GemmaBackend, HostMatrix, QuantFormat};

/// Scores every expert for each token and keeps the best `top_k`, their weights renormalized and
/// scaled per expert.
#[derive(Module, Debug)]
pub struct Router<B: GemmaBackend> {
    /// `proj`: `[num_experts, hidden]`.
    pub proj: Projection<B>,
    /// `scale`: `[hidden]` (f32), applied to the normalized input.
    pub scale: Param<Tensor<B, 1>>,
    /// The weightless input norm.
    pub norm: RmsNorm<B>,
    /// `per_expert_scale`, on the host: it multiplies the chosen weights there.
    #[module(skip)]
    pub per_expert_scale: Vec<f32>,
    #[module(skip)]
    pub top_k: usize,
}

/// For each token, the chosen experts and their weights.
#[derive(Debug, Clone, PartialEq)]
pub struct Routes {
    /// `[tokens][top_k]` (expert, weight), best first.
    pub tokens: Vec<Vec<(usize, f32)>>,
}

impl<B: GemmaBackend> Router<B> {
    fn load(
        source: &mut impl WeightSource<B>,
        prefix: &str,
        c: &GemmaConfig,
        moe: MoeConfig,
        settings: WeightSettings,
        device: &B::Device,
    ) -> Result<Self, ModelError> {
        let experts = moe.num_experts;
        let dense = WeightSettings { format: WeightFormat::Dense, ..settings };
        let per_expert_scale: Tensor<B, 1> =
            source.load(&format!("{prefix}.per_expert_scale"), [experts], WeightKind::Scale, DType::F32, device)?;
        let per_expert_scale = host_values(per_expert_scale, prefix)?;
        Ok(Self {
            proj: Projection::load(source, &[(&format!("{prefix}.proj"), experts)], c.hidden_size, dense, device)?,
            scale: Param::from_tensor(source.load(
                &format!("{prefix}.scale"),
                [c.hidden_size],
                WeightKind::Scale,
                DType::F32,
                device,
            )?),
            norm: RmsNorm::unit(c.hidden_size, c.rms_norm_eps, device),
            per_expert_scale,
            top_k: moe.top_k_experts,
        })
    }

    /// Routes `x` (`[tokens, hidden]`, the residual stream before the MLP) in `dtype`.
    pub fn route(&self, x: Tensor<B, 2>, dtype: DType) -> Result<Routes, ModelError> {
        let [_, hidden] = x.dims();
        let h = self.norm.forward(x.cast(dtype));
        let h = (h.cast(DType::F32) * self.scale.val().unsqueeze::<2>()).mul_scalar((hidden as f64).powf(-0.5));
        let scores = self.proj.forward(h.cast(dtype).unsqueeze::<3>());
        let [_, tokens, experts] = scores.dims();
        let probabilities = softmax(scores.reshape([tokens, experts]).cast(DType::F32), 1);
        burn_gemma_kernels::graph::unsupported(|| "a mixture-of-experts layer (its routes are read back)".into());
        let values = burn_gemma_kernels::read_back(probabilities, "expert routes")?;
        let tokens = values.chunks(experts.max(1)).map(|row| self.pick(row)).collect();
        Ok(Routes { tokens })
    }

    /// The `top_k` largest of one token's probabilities (ties to the lower expert, as
    /// `torch.topk` returns them), renormalized, times their `per_expert_scale`.
    fn pick(&self, probabilities: &[f32]) -> Vec<(usize, f32)> {
        let mut order: Vec<usize> = (0..probabilities.len()).collect();
        order.sort_by(|&a, &b| probabilities[b].total_cmp(&probabilities[a]).then(a.cmp(&b)));
        order.truncate(self.top_k);
        let total: f32 = order.iter().map(|&e| probabilities[e]).sum();
        order
            .into_iter()
            .map(|e| {
                let scale = self.per_expert_scale.get(e).copied().unwrap_or(1.0);
                (e, probabilities[e] / total * scale)
            })
            .collect()
    }
}

/// The expert block of one layer: router, experts and its three norms.
#[derive(Module, Debug)]
pub struct MoeBlock<B: GemmaBackend> {
    pub router: Router<B>,
    /// One gated MLP per expert (HF stores them as 3-D `gate_up_proj` / `down_proj`).
    pub experts: Vec<Mlp<B>>,
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
        let gate_up = expert_matrices(
            source,
            &format!("{prefix}.experts.gate_up_proj"),
            [experts, 2 * inter, hidden],
            settings,
            device,
        )?;
        let down = expert_matrices(
            source,
            &format!("{prefix}.experts.down_proj"),
            [experts, hidden, inter],
            settings,
            device,
        )?;
        let experts = gate_up
            .into_iter()
            .zip(down)
            .enumerate()
            .map(|(e, (gate_up, down))| {
                let (gate, up) = split_rows(gate_up, inter);
                Mlp::from_matrices(gate, up, down, inter, &format!("{prefix}.experts.{e}"), device)
            })
            .collect::<Result<_, _>>()?;
        let norm = |source: &mut _, name: &str| {
            RmsNorm::load(source, &format!("{prefix}.{name}"), hidden, c.rms_norm_eps, NormScale::Weight, device)
        };
        Ok(Self {
            router: Router::load(source, &format!("{prefix}.router"), c, moe, settings, device)?,
            experts,
            pre_feedforward_layernorm_2: norm(source, "pre_feedforward_layernorm_2")?,
            post_feedforward_layernorm_1: norm(source, "post_feedforward_layernorm_1")?,
            post_feedforward_layernorm_2: norm(source, "post_feedforward_layernorm_2")?,
        })
    }

    /// HF's expert branch of `Gemma4TextDecoderLayer.forward`: `post_1(mlp_out) +
    /// post_2(experts(pre_2(residual)))`, with `residual` `[batch, seq, hidden]` (f32, the stream
    /// before the MLP) and `mlp_out` the dense MLP's output in the activation dtype.
    /// Fails where the routes cannot be read back from the device.
    pub fn forward(&self, residual: Tensor<B, 3>, mlp_out: Tensor<B, 3>) -> Result<Tensor<B, 3>, ModelError> {
        let dtype = mlp_out.dtype();
        let [batch, seq, hidden] = residual.dims();
        let flat = residual.reshape([batch * seq, hidden]);
        let routes = self.router.route(flat.clone(), dtype)?;
        let x = self.pre_feedforward_layernorm_2.forward(flat.clone()).cast(dtype);
        let device = x.device();
        let mut out = Tensor::<B, 2>::zeros([batch * seq, hidden], (&device, DType::F32));
        for (e, expert) in self.experts.iter().enumerate() {
            let (rows, weights): (Vec<i64>, Vec<f32>) = routes
                .tokens
                .iter()
                .enumerate()
                .filter_map(|(t, picks)| picks.iter().find(|(pick, _)| *pick == e).map(|&(_, w)| (t as i64, w)))
                .unzip();
            if rows.is_empty() {
                continue;
            }
            let n = rows.len();
            let rows = Tensor::<B, 1, Int>::from_data(TensorData::new(rows, [n]), &device);
            let weights = Tensor::<B, 2>::from_data(TensorData::new(weights, [n, 1]), (&device, DType::F32));
            let y = expert.forward(x.clone().select(0, rows.clone()).unsqueeze::<3>());
            let y = y.reshape([n, hidden]).cast(DType::F32) * weights;
            out = out.select_assign(0, rows, y, IndexingUpdateOp::Add);
        }
        let experts_out = self.post_feedforward_layernorm_2.forward(out.cast(dtype).reshape([batch, seq, hidden]));
        Ok(self.post_feedforward_layernorm_1.forward(mlp_out) + experts_out)
    }

    /// Bytes on the device.
    pub fn device_bytes(&self) -> usize {
        self.router.proj.device_bytes() + self.experts.iter().map(Mlp::device_bytes).sum::<usize>()
    }
}

/// The `[experts, rows, cols]` tensor `name` as one `[rows, cols]` matrix per expert: dense in
/// the model dtype, or quantized on the host where `settings` asks for a block format (expert
/// tensors are read dense and quantized per expert: Q8 for `Native`, whatever the checkpoint's
/// own blocks).
fn expert_matrices<B: GemmaBackend>(
    source: &mut impl WeightSource<B>,
    name: &str,
    [experts, rows, cols]: [usize; 3],
    settings: WeightSettings,
    device: &B::Device,
) -> Result<Vec<HostMatrix<B>>, ModelError> {
    let all: Tensor<B, 3> = source.load(name, [experts, rows, cols], WeightKind::Matrix, DType::F32, device)?;
    let format = match settings.format {
        _ if !cols.is_multiple_of(burn_gemma_kernels::quant::BLOCK) => None,
        WeightFormat::Dense => None,
        WeightFormat::Native => Some(QuantFormat::Q8),
        WeightFormat::Quantized(q) | WeightFormat::Dequantized(q) => Some(q),
    };
    (0..experts)
        .map(|e| {
            let expert = all.clone().slice([e..e + 1, 0..rows, 0..cols]).reshape([rows, cols]);
            match format {
                None => Ok(HostMatrix::Dense(expert.cast(settings.dtype))),
                Some(q) => Ok(settings.keep(quantize(name, &host_values(expert, name)?, [rows, cols], q)?, device)),
            }
        })
        .collect()
}

/// Rows `..at` and `at..` of a matrix (an expert's gate and up halves).
fn split_rows<B: GemmaBackend>(matrix: HostMatrix<B>, at: usize) -> (HostMatrix<B>, HostMatrix<B>) {
    match matrix {
        HostMatrix::Dense(t) => {
            let [rows, cols] = t.dims();
            (HostMatrix::Dense(t.clone().slice([0..at, 0..cols])), HostMatrix::Dense(t.slice([at..rows, 0..cols])))
        }
        HostMatrix::Quantized(q) => {
            let rows = q.rows;
            (HostMatrix::Quantized(q.rows_slice(0..at)), HostMatrix::Quantized(q.rows_slice(at..rows)))
        }
        HostMatrix::Ggml(q) => {
            let [rows, _] = q.shape();
            (HostMatrix::Ggml(q.rows_slice(0..at)), HostMatrix::Ggml(q.rows_slice(at..rows)))
        }
    }
}
