//! Weight matrices as the kernels read them: dense or block-quantized, one type for both, and
//! what a product does with its result (its epilogue).

use crate::{
    gelu, linear,
    quant::{self, GgmlBlocks, GgmlMatrix, KQuantMatrix, QuantError},
    GemmaBackend, HostQuantized, QuantizedMatrix,
};
use burn::{
    module::{Module, Param},
    tensor::{backend::Backend, DType, Tensor},
};

/// A weight matrix `[out, in]` (checkpoint layout) on the device.
#[derive(Module, Debug)]
#[allow(clippy::large_enum_variant)] // One per weight, held for the model's life: no boxing.
pub enum Matrix<B: Backend> {
    /// Dense in the model dtype, packed (no row padding).
    Dense(Param<Tensor<B, 2>>),
    /// Block-quantized codes in the backend's layout.
    Quantized(QuantizedMatrix<B>),
    /// Blocks in a GGUF block type, in host memory, multiplied by candle's quantized CPU kernels
    /// (the Candle backend's form of every block-quantized matrix; see [`quant::ggml`]).
    Ggml(GgmlMatrix<B>),
    /// GGUF's Q4_K, Q5_K or Q6_K super-blocks on the device with the file's bits (the GPU
    /// backends' form of those types; see [`quant::kquant`]).
    KQuant(KQuantMatrix<B>),
    /// Consecutive row blocks stored differently (a GGUF's `q` and `k` in Q4_K and `v` in
    /// Q6_K, say): one product, whose output is the blocks' outputs side by side.
    Stacked(Vec<Block<B>>),
}

/// One row block of a [`Matrix::Stacked`].
#[derive(Module, Debug)]
#[allow(clippy::large_enum_variant)]
pub enum Block<B: Backend> {
    Dense(Param<Tensor<B, 2>>),
    Quantized(QuantizedMatrix<B>),
    Ggml(GgmlMatrix<B>),
    KQuant(KQuantMatrix<B>),
}

impl<B: Backend> Block<B> {
    /// The block as a matrix of its own.
    pub fn matrix(&self) -> Matrix<B> {
        match self {
            Self::Dense(w) => Matrix::Dense(w.clone()),
            Self::Quantized(w) => Matrix::Quantized(w.clone()),
            Self::Ggml(w) => Matrix::Ggml(w.clone()),
            Self::KQuant(w) => Matrix::KQuant(w.clone()),
        }
    }
}

impl<B: Backend> Matrix<B> {
    /// `[out, in]`.
    pub fn dims(&self) -> [usize; 2] {
        match self {
            Self::Dense(w) => w.val().dims(),
            Self::Quantized(w) => w.shape,
            Self::Ggml(w) => w.shape,
            Self::KQuant(w) => w.shape,
            Self::Stacked(parts) => {
                let dims: Vec<[usize; 2]> = parts.iter().map(|p| p.matrix().dims()).collect();
                [dims.iter().map(|d| d[0]).sum(), dims.first().map_or(0, |d| d[1])]
            }
        }
    }

    /// The dtype a product with it takes its input in: a dense matrix's own, f32 for the
    /// others (their kernels convert as they read).
    pub fn input_dtype(&self) -> DType {
        match self {
            Self::Dense(w) => w.val().dtype(),
            _ => DType::F32,
        }
    }

    /// Bytes on the device (for [`Matrix::Ggml`], in host memory).
    pub fn device_bytes(&self) -> usize {
        match self {
            Self::Dense(w) => w.val().shape().num_elements() * w.val().dtype().size(),
            Self::Quantized(w) => w.device_bytes(),
            Self::Ggml(w) => w.host_bytes(),
            Self::KQuant(w) => w.device_bytes(),
            Self::Stacked(parts) => parts.iter().map(|p| p.matrix().device_bytes()).sum(),
        }
    }

    /// One matrix of `parts` (consecutive row blocks): the part itself when there is one,
    /// else [`Matrix::Stacked`] (stacked parts flattened).
    pub fn stacked(mut parts: Vec<Matrix<B>>) -> Self {
        if parts.len() == 1 {
            return parts.remove(0);
        }
        let mut blocks = Vec::new();
        for part in parts {
            match part {
                Self::Dense(w) => blocks.push(Block::Dense(w)),
                Self::Quantized(w) => blocks.push(Block::Quantized(w)),
                Self::Ggml(w) => blocks.push(Block::Ggml(w)),
                Self::KQuant(w) => blocks.push(Block::KQuant(w)),
                Self::Stacked(inner) => blocks.extend(inner),
            }
        }
        Self::Stacked(blocks)
    }

    /// The whole matrix dense in `dtype` (quantized blocks dequantized with the reference,
    /// blocks joined): `[out, in]`, on `device` where it is held on the host.
    pub fn dense_reference(&self, dtype: DType, device: &B::Device) -> Tensor<B, 2> {
        match self {
            Self::Dense(w) => w.val().cast(dtype),
            Self::Quantized(w) => quant::dequantize_reference(w, dtype),
            Self::Ggml(w) => w.dense(dtype, device),
            Self::KQuant(w) => w.dense_reference(dtype),
            Self::Stacked(parts) => {
                Tensor::cat(parts.iter().map(|p| p.matrix().dense_reference(dtype, device)).collect(), 0)
            }
        }
    }
}

/// A matrix as read from a checkpoint, before [`crate::GemmaBackend::upload_matrix`] puts it in
/// the layout the kernels read.
#[derive(Debug, Clone)]
pub enum HostMatrix<B: Backend> {
    /// Already on the device, dense.
    Dense(Tensor<B, 2>),
    /// Block-quantized on the host.
    Quantized(HostQuantized),
    /// Blocks of a GGUF block type as the file stores them.
    Ggml(GgmlBlocks),
}

/// What a product does with its result before storing it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Epilogue {
    /// The product itself, `[n, out]`.
    Identity,
    /// `gelu_tanh(gate) * up` of a matrix whose gate and up rows are interleaved in blocks of
    /// [`gelu::PAIR_BLOCK`] ([`gelu::interleave_pairs`], [`HostQuantized::interleave_pairs`]):
    /// `[n, out / 2]`.
    GeluPairs,
}

impl Epilogue {
    /// Columns of the output of a product by a matrix of `features` rows.
    pub fn out_width(self, features: usize) -> usize {
        match self {
            Self::Identity => features,
            Self::GeluPairs => features / 2,
        }
    }
}

/// Reference: `x [n, in] @ w^T -> [n, out]` in `x`'s dtype (a quantized matrix dequantized
/// first; the reference code layout; GGUF blocks by candle's quantized product), then
/// `epilogue`.
pub fn reference<B: Backend>(x: Tensor<B, 2>, w: &Matrix<B>, epilogue: Epilogue) -> Tensor<B, 2> {
    let y = match w {
        Matrix::Dense(w) => linear::reference(x, w.val()),
        Matrix::Quantized(w) => quant::project_reference(x, w),
        Matrix::Ggml(w) => return w.product(x, epilogue),
        Matrix::KQuant(w) => linear::reference(x.clone(), w.dense_reference(x.dtype())),
        Matrix::Stacked(parts) => {
            Tensor::cat(parts.iter().map(|p| reference(x.clone(), &p.matrix(), Epilogue::Identity)).collect(), 1)
        }
    };
    match epilogue {
        Epilogue::Identity => y,
        Epilogue::GeluPairs => gelu::pairs_reference(y),
    }
}

/// `x [n, in]` times a table stored as consecutive row blocks (`[rows, in]` together; GPU APIs
/// cap the size of one buffer): one [`GemmaBackend::project`] per block, side by side, `[n,
/// rows]` in `x`'s dtype; `[n, 0]` for no block.
pub fn project_table<B: GemmaBackend>(x: Tensor<B, 2>, table: &[Matrix<B>]) -> Tensor<B, 2> {
    let mut blocks: Vec<Tensor<B, 2>> = table.iter().map(|w| B::project(x.clone(), w, Epilogue::Identity)).collect();
    match blocks.len() {
        0 => {
            let [n, _] = x.dims();
            Tensor::empty([n, 0], (&x.device(), x.dtype()))
        }
        1 => blocks.pop().unwrap_or(x),
        _ => {
            crate::graph::unsupported(|| "an lm_head of several table blocks joined by Burn".into());
            Tensor::cat(blocks, 1)
        }
    }
}

/// Reference upload: dense matrices as they are, quantized ones with one `U8` code per weight
/// and f32 scales, GGUF blocks converted to the closest of this crate's formats first
/// ([`GgmlBlocks::to_quantized`]).
pub fn upload_reference<B: Backend>(matrix: HostMatrix<B>, device: &B::Device) -> Result<Matrix<B>, QuantError> {
    Ok(match matrix {
        HostMatrix::Dense(w) => Matrix::Dense(Param::from_tensor(w)),
        HostMatrix::Quantized(host) => {
            Matrix::Quantized(QuantizedMatrix::upload(&host, quant::CodeLayout::Bytes, DType::F32, device))
        }
        HostMatrix::Ggml(blocks) => return upload_reference(HostMatrix::Quantized(blocks.to_quantized()?), device),
    })
}
