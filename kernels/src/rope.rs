//! Rotary position embedding (rotate-half layout), optionally fused with QK-norm.

use burn::tensor::{backend::Backend, Tensor};

/// Reference RoPE. See [`crate::GemmaBackend::rope`] for the shapes.
///
/// As in Hugging Face transformers, the f32 tables are cast to `x`'s dtype and the rotation is
/// computed in that dtype.
pub fn reference<B: Backend>(
    x: Tensor<B, 4>,
    cos: Tensor<B, 2>,
    sin: Tensor<B, 2>,
    offset: usize,
    norm: Option<(Tensor<B, 1>, f64)>,
) -> Tensor<B, 4> {
    let x = match norm {
        Some((weight, eps)) => crate::rms_norm::reference(x, weight, eps),
        None => x,
    };
    let dtype = x.dtype();
    let [_, _, seq, head_dim] = x.dims();
    let half = head_dim / 2;
    let table = |t: Tensor<B, 2>| -> Tensor<B, 4> {
        t.slice([offset..offset + seq, 0..half]).cast(dtype).unsqueeze::<4>()
    };
    let (cos, sin) = (table(cos), table(sin));
    let x1 = x.clone().slice_dim(3, 0..half);
    let x2 = x.slice_dim(3, half..head_dim);
    let out1 = x1.clone() * cos.clone() - x2.clone() * sin.clone();
    let out2 = x2 * cos + x1 * sin;
    Tensor::cat(vec![out1, out2], 3)
}

/// The `[max_positions, head_dim / 2]` cos and sin tables (f32 values) for `theta`, with linear
/// position scaling `factor` (positions are divided by it).
pub fn tables(max_positions: usize, head_dim: usize, theta: f64, factor: f64) -> (Vec<f32>, Vec<f32>) {
    let half = head_dim / 2;
    // Inverse frequencies in f32, as transformers computes them.
    let inv_freq: Vec<f32> = (0..half)
        .map(|i| (1.0 / theta.powf((2 * i) as f64 / head_dim as f64)) as f32 / factor as f32)
        .collect();
    let mut cos = Vec::with_capacity(max_positions * half);
    let mut sin = Vec::with_capacity(max_positions * half);
    for pos in 0..max_positions {
        for f in &inv_freq {
            let angle = pos as f32 * f;
            cos.push(angle.cos());
            sin.push(angle.sin());
        }
    }
    (cos, sin)
}
