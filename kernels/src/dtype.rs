//! Numbers as an activation dtype holds them.

use burn::tensor::DType;

/// `scale` rounded to `dtype` (bf16, f16; f32 and wider keep it), as the dense gather applies it
/// in the activation dtype: the quantized gathers scale by the same number.
pub(crate) fn scale_in(scale: f64, dtype: DType) -> f64 {
    match dtype {
        DType::BF16 => half::bf16::from_f64(scale).to_f64(),
        DType::F16 => half::f16::from_f64(scale).to_f64(),
        _ => scale,
    }
}
