//! Weight matrices as the kernels read them: dense or block-quantized, one type for both, and
//! what a product does with its result (its epilogue).

use crate::{gelu, linear, quant, HostQuantized, QuantizedMatrix};
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
}

impl<B: Backend> Matrix<B> {
    /// `[out, in]`.
    pub fn dims(&self) -> [usize; 2] {
        match self {
            Self::Dense(w) => w.val().dims(),
            Self::Quantized(w) => w.shape,
        }
    }

    /// Bytes on the device.
    pub fn device_bytes(&self) -> usize {
        match self {
            Self::Dense(w) => w.val().shape().num_elements() * w.val().dtype().size(),
            Self::Quantized(w) => w.device_bytes(),
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

/// Reference: `x [n, in] @ w^T -> [n, out]` in `x`'s dtype (a quantized matrix dequantized
/// first; the reference code layout), then `epilogue`.
pub fn reference<B: Backend>(x: Tensor<B, 2>, w: &Matrix<B>, epilogue: Epilogue) -> Tensor<B, 2> {
    let y = match w {
        Matrix::Dense(w) => linear::reference(x, w.val()),
        Matrix::Quantized(w) => quant::project_reference(x, w),
    };
    match epilogue {
        Epilogue::Identity => y,
        Epilogue::GeluPairs => gelu::pairs_reference(y),
    }
}

/// Reference upload: dense matrices as they are, quantized ones with one `U8` code per weight
/// and f32 scales.
pub fn upload_reference<B: Backend>(matrix: HostMatrix<B>, device: &B::Device) -> Matrix<B> {
    match matrix {
        HostMatrix::Dense(w) => Matrix::Dense(Param::from_tensor(w)),
        HostMatrix::Quantized(host) => {
            Matrix::Quantized(QuantizedMatrix::upload(&host, quant::CodeLayout::Bytes, DType::F32, device))
        }
    }
}
