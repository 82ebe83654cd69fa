//! Logit softcapping (Gemma 2).

use burn::tensor::{backend::Backend, Tensor};

/// Reference: `tanh(x / cap) * cap`.
pub fn reference<B: Backend, const D: usize>(x: Tensor<B, D>, cap: f64) -> Tensor<B, D> {
    x.div_scalar(cap).tanh().mul_scalar(cap)
}
