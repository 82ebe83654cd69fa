//! Which implementation each backend gets.

use crate::GemmaBackend;
use burn_cubecl::{BoolElement, CubeBackend, CubeRuntime, FloatElement, IntElement};

/// Every CubeCL runtime (CUDA, ROCm/HIP, wgpu) shares one implementation.
impl<R, F, I, BT> GemmaBackend for CubeBackend<R, F, I, BT>
where
    R: CubeRuntime,
    F: FloatElement,
    I: IntElement,
    BT: BoolElement,
{
}

#[cfg(feature = "ndarray")]
impl<E, I, Q> GemmaBackend for burn::backend::NdArray<E, I, Q>
where
    E: burn::backend::ndarray::FloatNdArrayElement,
    I: burn::backend::ndarray::IntNdArrayElement,
    Q: burn::backend::ndarray::QuantElement,
    burn::backend::ndarray::NdArrayTensor: From<burn::backend::ndarray::SharedArray<E>>,
    burn::backend::ndarray::NdArrayTensor: From<burn::backend::ndarray::SharedArray<I>>,
{
}

// burn-candle is deprecated upstream in Burn 0.21 but still a supported CPU backend here.
#[cfg(feature = "candle")]
#[allow(deprecated)]
impl<F, I> GemmaBackend for burn::backend::Candle<F, I>
where
    F: burn::backend::candle::FloatCandleElement,
    I: burn::backend::candle::IntCandleElement,
{
}
