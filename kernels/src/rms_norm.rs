//! RMSNorm with Gemma's `1 + w` scale, and its fusion with the residual add.

use burn::tensor::{backend::Backend, DType, Tensor};

/// Reference RMSNorm: f32 accumulation, result in `x`'s dtype.
pub fn reference<B: Backend, const D: usize>(x: Tensor<B, D>, weight: Tensor<B, 1>, eps: f64) -> Tensor<B, D> {
    let dtype = x.dtype();
    normalize(x.cast(DType::F32), weight, eps).cast(dtype)
}

/// Reference fused residual add + RMSNorm. `residual` is f32; the sum is computed in f32.
pub fn add_reference<B: Backend>(
    residual: Tensor<B, 3>,
    x: Tensor<B, 3>,
    weight: Tensor<B, 1>,
    eps: f64,
    out_dtype: DType,
) -> (Tensor<B, 3>, Tensor<B, 3>) {
    let sum = residual + x.cast(DType::F32);
    let normed = normalize(sum.clone(), weight, eps).cast(out_dtype);
    (sum, normed)
}

/// `x` is f32; returns f32.
fn normalize<B: Backend, const D: usize>(x: Tensor<B, D>, weight: Tensor<B, 1>, eps: f64) -> Tensor<B, D> {
    let inv_rms = x.clone().square().mean_dim(D - 1).add_scalar(eps).sqrt().recip();
    let mut scale_shape = [1usize; D];
    scale_shape[D - 1] = weight.dims()[0];
    let scale = weight.cast(DType::F32).add_scalar(1.0).reshape(scale_shape);
    x * inv_rms * scale
}

#[cfg(all(test, feature = "ndarray"))]
mod tests {
    use super::*;
    use crate::test_util::TestBackend;
    use burn::tensor::TensorData;

    #[test]
    fn matches_hand_computation() {
        let device = Default::default();
        let x = Tensor::<TestBackend, 2>::from_data([[1.0f32, 2.0, 3.0], [0.0, -4.0, 0.5]], &device);
        let w = Tensor::<TestBackend, 1>::from_data([0.0f32, 0.5, -1.0], &device);
        let out = reference(x, w, 1e-6).into_data();
        let mut expected = Vec::new();
        for row in [[1.0f32, 2.0, 3.0], [0.0, -4.0, 0.5]] {
            let ms = row.iter().map(|v| v * v).sum::<f32>() / 3.0;
            let r = 1.0 / (ms + 1e-6).sqrt();
            expected.extend([row[0] * r * 1.0, row[1] * r * 1.5, row[2] * r * 0.0]);
        }
        out.assert_approx_eq::<f32>(&TensorData::new(expected, [2, 3]), Default::default());
    }
}
