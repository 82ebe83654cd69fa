//! Scaled embedding gather.

use burn::tensor::{backend::Backend, Int, Tensor};

/// Reference: `table[ids] * scale`.
pub fn reference<B: Backend>(table: Tensor<B, 2>, ids: Tensor<B, 2, Int>, scale: f64) -> Tensor<B, 3> {
    let [batch, seq] = ids.dims();
    let hidden = table.dims()[1];
    table.select(0, ids.reshape([batch * seq])).reshape([batch, seq, hidden]).mul_scalar(scale)
}
