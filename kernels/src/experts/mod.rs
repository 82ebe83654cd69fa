//! Routed experts (Gemma 4's 26B-A4B): the router's choice and the experts' products, on the
//! device.
//!
//! A layer's experts are `count` matrices of the same `[rows, cols]` shape. The CubeCL backends
//! keep them as one matrix of `count * rows` rows, in the block format the checkpoint stores
//! them in (expert `e` is rows `e * rows..(e + 1) * rows`, [`ExpertWeights::Stacked`]); the
//! router's kernel ([`route`]) writes each token's chosen experts and weights to device
//! buffers ([`Routes`]), and the routed matrix-vector kernels ([`gemv`]) read those ids on the
//! device and stream only the chosen experts' rows. Nothing goes back to the host, so a decode
//! step with experts records as one CUDA graph like a dense one.
//!
//! Prompts group the tokens by expert: on the device by the grouped matrix-vector kernels, or,
//! where the experts get enough rows each and the device has matrix units, gathered into one
//! padded batch per group of experts and multiplied there ([`gemm`]; [`ExpertPath`] chooses).
//! The host backends read the routes back and multiply each chosen expert's rows in one
//! product ([`project_reference`]).
//!
//! Here: the types and the references; [`route`]: the router kernel; [`gemv`]: the routed and
//! grouped matrix-vector products; [`gemm`]: the batched products on the matrix units.

pub mod gemm;
pub mod gemv;
pub mod route;

pub use gemm::ExpertPath;

use crate::{
    cube::{self, Cb},
    quant::QuantError,
    read_back, Epilogue, GateUpLayout, GemmaBackend, HostMatrix, Matrix, QuantizedMatrix, ReadBackError,
};
use burn::{
    module::{Module, Param},
    tensor::{backend::Backend, DType, IndexingUpdateOp, Int, Tensor, TensorData},
};
use burn_cubecl::{BoolElement, CubeRuntime, FloatElement, IntElement};
use std::ops::Range;

/// The CubeCL launchers, for the backends.
pub(crate) mod kernel {
    pub use super::route::kernel::route;
}

/// One projection of the routed experts on a CubeCL backend by `path`: what
/// [`GemmaBackend::project_experts`] does with the path [`ExpertPath::choose`] picks, open to
/// tests and benchmarks that compare the paths. Experts held one matrix each, dense experts in
/// another dtype than `dtype`, and products CubeCL refuses on the matrix units take the
/// matrix-vector kernels whatever `path` says; experts the backend keeps on the host take
/// [`project_reference`].
///
/// Fails only where the routes or the slot counts must be read back and the read fails.
pub fn project_on<R, F, I, BT>(
    x: Tensor<Cb<R, F, I, BT>, 2>,
    experts: &Experts<Cb<R, F, I, BT>>,
    routes: &Routes<Cb<R, F, I, BT>>,
    product: ExpertProduct,
    dtype: DType,
    path: ExpertPath,
) -> Result<Tensor<Cb<R, F, I, BT>, 2>, ReadBackError>
where
    R: CubeRuntime,
    F: FloatElement,
    I: IntElement,
    BT: BoolElement,
{
    use crate::quant::device::packed;
    use gemm::kernel::{expert_gemm, GroupedError, Stack};
    use gemv::kernel::{expert_gemv, expert_qgemv};
    let ExpertWeights::Stacked(stacked) = &experts.weights else {
        return project_reference(x, experts, routes, product, dtype);
    };
    let shape = (experts.count, experts.rows);
    // The router kernel writes `U32` ids; others (routes built on the host) are cast.
    let ids = || {
        let ids = routes.ids.clone();
        if ids.dtype() == DType::U32 {
            return cube::int(ids);
        }
        crate::graph::unsupported(|| "expert ids cast by Burn".into());
        cube::int(ids.cast(burn::tensor::IntDType::U32))
    };
    let weights = cube::float(routes.weights.clone());
    // The batched path, where the path asks for it and the stack is one it multiplies.
    let batched = match (path, stacked) {
        _ if x.dims()[1] == 0 || experts.count == 0 => None,
        (ExpertPath::Gemm { group_bytes }, Matrix::Dense(w)) if w.val().dtype() == dtype => {
            Some((Stack::Dense(cube::float(w.val())), group_bytes))
        }
        (ExpertPath::Gemm { group_bytes }, Matrix::Quantized(w)) => Some((Stack::Quantized(packed(w)), group_bytes)),
        _ => None,
    };
    let x = cube::float(x);
    if let Some((stack, group_bytes)) = batched {
        crate::graph::unsupported(|| "experts grouped with their slot counts read back".into());
        match expert_gemm(x.clone(), stack, shape, ids(), weights.clone(), product, dtype, group_bytes) {
            Ok(out) => return Ok(cube::tensor(out)),
            Err(GroupedError::ReadBack(e)) => return Err(e),
            // CubeCL refused the batched product: the matrix-vector kernels below.
            Err(GroupedError::Gemm) => {}
        }
    }
    Ok(cube::tensor(match stacked {
        Matrix::Dense(w) => expert_gemv(x, cube::float(w.val()), shape, ids(), weights, product, dtype),
        Matrix::Quantized(w) => expert_qgemv(x, &packed(w), shape, ids(), weights, product, dtype),
        // `upload_experts` stacks only dense and quantized matrices.
        Matrix::Ggml(_) | Matrix::KQuant(_) | Matrix::Stacked(_) => {
            return project_reference(cube::tensor(x), experts, routes, product, dtype)
        }
    }))
}

/// One projection of every expert of a layer: `count` matrices of `[rows, cols]`, built by
/// [`crate::GemmaBackend::upload_experts`] only, so that a stack holds only what its rows can
/// be cut from (dense or quantized matrices).
#[derive(Module, Debug)]
pub struct Experts<B: Backend> {
    pub(crate) weights: ExpertWeights<B>,
    #[module(skip)]
    pub(crate) count: usize,
    /// Rows of one expert's matrix.
    #[module(skip)]
    pub(crate) rows: usize,
}

/// How the experts' matrices are held.
#[derive(Module, Debug)]
#[allow(clippy::large_enum_variant)] // One per layer, held for the model's life.
pub enum ExpertWeights<B: Backend> {
    /// One matrix of `count * rows` rows, expert `e` at rows `e * rows..`: what the routed
    /// kernels read.
    Stacked(Matrix<B>),
    /// One matrix per expert (the host backends, and GPUs whose buffers cannot hold the stack).
    Each(Vec<Matrix<B>>),
}

impl<B: Backend> Experts<B> {
    /// Expert `e`'s `[rows, cols]` matrix (a view of the stack where it is stacked); `None`
    /// past the last expert.
    pub fn expert(&self, e: usize) -> Option<Matrix<B>> {
        match &self.weights {
            ExpertWeights::Each(matrices) => matrices.get(e).cloned(),
            ExpertWeights::Stacked(matrix) => {
                (e < self.count).then(|| matrix_rows(matrix, e * self.rows..(e + 1) * self.rows)).flatten()
            }
        }
    }

    /// Experts in the stack.
    pub fn count(&self) -> usize {
        self.count
    }

    /// How the matrices are held.
    pub fn weights(&self) -> &ExpertWeights<B> {
        &self.weights
    }

    /// Bytes on the device (host memory for GGUF blocks kept on the host).
    pub fn device_bytes(&self) -> usize {
        match &self.weights {
            ExpertWeights::Stacked(m) => m.device_bytes(),
            ExpertWeights::Each(ms) => ms.iter().map(Matrix::device_bytes).sum(),
        }
    }
}

/// Rows `range` of a dense or quantized matrix, as a view where the backend slices without a
/// copy; `None` for the other kinds, which no stack holds (see [`Experts`]).
fn matrix_rows<B: Backend>(matrix: &Matrix<B>, range: Range<usize>) -> Option<Matrix<B>> {
    match matrix {
        Matrix::Dense(w) => {
            let cols = w.val().dims()[1];
            Some(Matrix::Dense(Param::from_tensor(w.val().slice([range, 0..cols]))))
        }
        Matrix::Quantized(q) => Some(Matrix::Quantized(q.rows(range))),
        Matrix::Ggml(_) | Matrix::KQuant(_) | Matrix::Stacked(_) => None,
    }
}

impl<B: Backend> QuantizedMatrix<B> {
    /// Rows `range` (codes, scales and offsets sliced alike).
    pub fn rows(&self, range: Range<usize>) -> Self {
        let slice = |t: Tensor<B, 2>| {
            let cols = t.dims()[1];
            Param::from_tensor(t.slice([range.clone(), 0..cols]))
        };
        let codes = self.codes.val();
        let code_cols = codes.dims()[1];
        Self {
            codes: crate::quant::device::int_param(codes.slice([range.clone(), 0..code_cols])),
            scales: slice(self.scales.val()),
            offsets: self.offsets.as_ref().map(|o| slice(o.val())),
            format: self.format,
            shape: [range.len(), self.shape[1]],
        }
    }
}

/// Rows `range` of a matrix read from a checkpoint.
fn host_rows<B: Backend>(matrix: &HostMatrix<B>, range: Range<usize>) -> HostMatrix<B> {
    match matrix {
        HostMatrix::Dense(t) => {
            let cols = t.dims()[1];
            HostMatrix::Dense(t.clone().slice([range, 0..cols]))
        }
        HostMatrix::Quantized(q) => HostMatrix::Quantized(q.rows_slice(range)),
        HostMatrix::Ggml(q) => HostMatrix::Ggml(q.rows_slice(range)),
    }
}

/// Reference upload: `stacked` (`[count * rows, cols]`) cut into one matrix per expert, each
/// uploaded as [`GemmaBackend::upload_matrix`] does (GGUF blocks stay blocks where the backend
/// multiplies them, as Candle does).
pub fn upload_reference<B: GemmaBackend>(
    stacked: HostMatrix<B>,
    count: usize,
    device: &B::Device,
) -> Result<Experts<B>, QuantError> {
    let rows = stacked_rows(&stacked, count)?;
    let matrices = (0..count)
        .map(|e| B::upload_matrix(host_rows(&stacked, e * rows..(e + 1) * rows), device))
        .collect::<Result<_, _>>()?;
    Ok(Experts { weights: ExpertWeights::Each(matrices), count, rows })
}

/// Rows per expert of a stack of `count` experts.
pub(crate) fn stacked_rows<B: Backend>(stacked: &HostMatrix<B>, count: usize) -> Result<usize, QuantError> {
    let [total, cols] = match stacked {
        HostMatrix::Dense(t) => t.dims(),
        HostMatrix::Quantized(q) => [q.rows, q.cols],
        HostMatrix::Ggml(q) => q.shape(),
    };
    if count == 0 || !total.is_multiple_of(count) {
        return Err(QuantError::Experts { rows: total, cols, count });
    }
    Ok(total / count)
}

/// Each token's chosen experts, best first, and their weights, on the device.
#[derive(Debug, Clone)]
pub struct Routes<B: Backend> {
    /// `[tokens, top_k]` expert ids (`U32` from the CubeCL kernel).
    pub ids: Tensor<B, 2, Int>,
    /// `[tokens, top_k]` f32: the renormalized probabilities times `per_expert_scale`.
    pub weights: Tensor<B, 2>,
}

impl<B: Backend> Routes<B> {
    /// `(tokens, top_k)`.
    pub fn shape(&self) -> (usize, usize) {
        let [tokens, top_k] = self.ids.dims();
        (tokens, top_k)
    }

    /// The routes on the host: per token, `(expert, weight)` best first.
    pub fn to_host(&self) -> Result<Vec<Vec<(usize, f32)>>, ReadBackError> {
        let (_, top_k) = self.shape();
        let fail = |reason: String| ReadBackError { what: "expert routes", reason };
        let ids = self
            .ids
            .clone()
            .try_into_data()
            .map_err(|e| fail(format!("{e:?}")))?
            .convert::<i64>()
            .into_vec::<i64>()
            .map_err(|e| fail(format!("{e:?}")))?;
        let weights = read_back(self.weights.clone(), "expert weights")?;
        Ok(ids
            .chunks(top_k.max(1))
            .zip(weights.chunks(top_k.max(1)))
            .map(|(ids, ws)| ids.iter().zip(ws).map(|(&e, &w)| (e.max(0) as usize, w)).collect())
            .collect())
    }
}

/// Reference router: per row of `scores` (`[tokens, experts]`), the softmax in f32, its
/// `top_k` largest (ties to the lower expert, as `torch.topk` returns them) renormalized to sum
/// to 1, each times its expert's `per_expert_scale` (HF's `Gemma4TextRouter` after the
/// projection).
pub fn route_reference<B: Backend>(
    scores: Tensor<B, 2>,
    per_expert_scale: Tensor<B, 1>,
    top_k: usize,
) -> Result<Routes<B>, ReadBackError> {
    let [tokens, experts] = scores.dims();
    let device = scores.device();
    let scale = read_back(per_expert_scale, "per-expert scales")?;
    let values = read_back(scores, "router scores")?;
    let top_k = top_k.min(experts);
    let mut ids = Vec::with_capacity(tokens * top_k);
    let mut weights = Vec::with_capacity(tokens * top_k);
    for row in values.chunks(experts.max(1)) {
        let top = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let exps: Vec<f32> = row.iter().map(|&s| (s - top).exp()).collect();
        let sum: f32 = exps.iter().sum();
        let probabilities: Vec<f32> = exps.iter().map(|&e| e / sum).collect();
        let mut order: Vec<usize> = (0..experts).collect();
        order.sort_by(|&a, &b| probabilities[b].total_cmp(&probabilities[a]).then(a.cmp(&b)));
        order.truncate(top_k);
        let total: f32 = order.iter().map(|&e| probabilities[e]).sum();
        for e in order {
            ids.push(e as i64);
            weights.push(probabilities[e] / total * scale.get(e).copied().unwrap_or(1.0));
        }
    }
    Ok(Routes {
        ids: Tensor::from_data(TensorData::new(ids, [tokens, top_k]), &device),
        weights: Tensor::from_data(TensorData::new(weights, [tokens, top_k]), (&device, DType::F32)),
    })
}

/// What an expert product computes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExpertProduct {
    /// The first projection of an expert MLP: `x` `[tokens, cols]`, each token's row through
    /// each of its experts' `[2 * m, cols]` matrices (gate rows, then up rows, as checkpoints
    /// store `gate_up_proj`), then `gelu_tanh(gate) * up`: `[tokens * top_k, m]`, row
    /// `t * top_k + k` for the token's `k`-th expert.
    GeluHalves,
    /// The last projection: `x` `[tokens * top_k, cols]` (as [`ExpertProduct::GeluHalves`]
    /// returns), each row through its expert, the `top_k` results of a token summed with the
    /// route weights: `[tokens, rows]`.
    WeightedSum,
}

/// Reference expert product (grouped by expert): the routes are read back, and each chosen
/// expert multiplies the rows routed to it in one [`GemmaBackend::project`] (inputs cast to
/// `dtype`, as HF multiplies in the model dtype); the weighted sum adds in f32. Returns `dtype`.
pub fn project_reference<B: GemmaBackend>(
    x: Tensor<B, 2>,
    experts: &Experts<B>,
    routes: &Routes<B>,
    product: ExpertProduct,
    dtype: DType,
) -> Result<Tensor<B, 2>, ReadBackError> {
    crate::graph::unsupported(|| "a mixture-of-experts product grouped on the host".into());
    let (tokens, top_k) = routes.shape();
    let picks = routes.to_host()?;
    let device = x.device();
    let x = x.cast(dtype);
    let rows = experts.rows;
    let width = match product {
        ExpertProduct::GeluHalves => rows / 2,
        ExpertProduct::WeightedSum => rows,
    };
    let (out_rows, out_dtype) = match product {
        ExpertProduct::GeluHalves => (tokens * top_k, dtype),
        ExpertProduct::WeightedSum => (tokens, DType::F32),
    };
    let mut out = Tensor::<B, 2>::zeros([out_rows, width], (&device, out_dtype));
    for e in 0..experts.count {
        // (input row, output row, weight) of every slot routed to `e`.
        let slots: Vec<(i64, i64, f32)> = picks
            .iter()
            .enumerate()
            .flat_map(|(t, p)| p.iter().enumerate().map(move |(k, &(id, w))| (t, k, id, w)))
            .filter(|&(_, _, id, _)| id == e)
            .map(|(t, k, _, w)| {
                let slot = (t * top_k + k) as i64;
                match product {
                    ExpertProduct::GeluHalves => (t as i64, slot, w),
                    ExpertProduct::WeightedSum => (slot, t as i64, w),
                }
            })
            .collect();
        if slots.is_empty() {
            continue;
        }
        let Some(matrix) = experts.expert(e) else { continue };
        let n = slots.len();
        let index = |v: Vec<i64>| Tensor::<B, 1, Int>::from_data(TensorData::new(v, [n]), &device);
        let inputs = index(slots.iter().map(|s| s.0).collect());
        let outputs = index(slots.iter().map(|s| s.1).collect());
        let y = B::project(x.clone().select(0, inputs), &matrix, Epilogue::Identity);
        let y = match product {
            ExpertProduct::GeluHalves => B::gelu_mul(y.unsqueeze::<3>(), GateUpLayout::Halves).reshape([n, width]),
            ExpertProduct::WeightedSum => {
                let w = slots.iter().map(|s| s.2).collect::<Vec<_>>();
                let w = Tensor::<B, 2>::from_data(TensorData::new(w, [n, 1]), (&device, DType::F32));
                y.cast(DType::F32) * w
            }
        };
        out = out.select_assign(0, outputs, y, IndexingUpdateOp::Add);
    }
    Ok(out.cast(dtype))
}
