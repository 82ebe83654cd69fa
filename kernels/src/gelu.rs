//! GELU (tanh approximation) of the gate times the up projection.

use burn::tensor::{activation::gelu_approximate, backend::Backend, Tensor};

/// Reference: `gelu_tanh(gate) * up` in the input dtype.
pub fn reference<B: Backend>(gate: Tensor<B, 3>, up: Tensor<B, 3>) -> Tensor<B, 3> {
    gelu_approximate(gate) * up
}
