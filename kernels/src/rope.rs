//! Rotary position embedding (rotate-half layout), optionally fused with QK-norm.

use burn::tensor::{backend::Backend, DType, Tensor, TensorData};

/// The cos and sin tables of one rotary embedding, `[positions, head_dim / 2]` (f32) each, theta
/// and position scaling applied.
#[derive(Debug, Clone)]
pub struct RopeTables<B: Backend> {
    pub cos: Tensor<B, 2>,
    pub sin: Tensor<B, 2>,
}

/// The rotary frequencies of one layer type.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Frequencies {
    /// Head size (the rotate-half layout pairs `i` with `i + head_dim / 2`).
    pub head_dim: usize,
    /// Base of the frequencies.
    pub theta: f64,
    /// Linear position scaling: positions are divided by it.
    pub factor: f64,
    /// Share of the pairs that rotate (Gemma 4's `proportional` RoPE): pair `i` rotates with
    /// frequency `theta^(-2i / head_dim)` for `i < partial_rotary_factor * head_dim / 2`, the
    /// others keep frequency 0 (cos 1, sin 0: left as they are). 1 for every pair.
    pub partial_rotary_factor: f64,
}

impl Frequencies {
    /// Every pair rotating, no scaling.
    pub fn plain(head_dim: usize, theta: f64) -> Self {
        Self { head_dim, theta, factor: 1.0, partial_rotary_factor: 1.0 }
    }

    /// Pairs that rotate (HF: `int(partial_rotary_factor * head_dim // 2)`).
    pub fn rotated_pairs(&self) -> usize {
        ((self.partial_rotary_factor * self.head_dim as f64) as usize / 2).min(self.head_dim / 2)
    }

    /// The `head_dim / 2` inverse frequencies in f32, as transformers computes them.
    pub fn inv_freq(&self) -> Vec<f32> {
        let rotated = self.rotated_pairs();
        (0..self.head_dim / 2)
            .map(|i| {
                if i < rotated {
                    (1.0 / self.theta.powf((2 * i) as f64 / self.head_dim as f64)) as f32 / self.factor as f32
                } else {
                    0.0
                }
            })
            .collect()
    }
}

impl<B: Backend> RopeTables<B> {
    /// The tables of positions `0..positions` ([`tables`]).
    pub fn new(positions: usize, frequencies: &Frequencies, device: &B::Device) -> Self {
        let (cos, sin) = tables(positions, frequencies);
        let shape = [positions, frequencies.head_dim / 2];
        Self {
            cos: Tensor::from_data(TensorData::new(cos, shape), (device, DType::F32)),
            sin: Tensor::from_data(TensorData::new(sin, shape), (device, DType::F32)),
        }
    }

    /// Positions the tables cover.
    pub fn positions(&self) -> usize {
        self.cos.dims()[0]
    }
}

/// Reference RoPE. See [`crate::GemmaBackend::qk_norm_rope`] for the shapes.
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
    let table =
        |t: Tensor<B, 2>| -> Tensor<B, 4> { t.slice([offset..offset + seq, 0..half]).cast(dtype).unsqueeze::<4>() };
    let (cos, sin) = (table(cos), table(sin));
    let x1 = x.clone().slice_dim(3, 0..half);
    let x2 = x.slice_dim(3, half..head_dim);
    let out1 = x1.clone() * cos.clone() - x2.clone() * sin.clone();
    let out2 = x2 * cos + x1 * sin;
    Tensor::cat(vec![out1, out2], 3)
}

/// [`reference`] on host rows, for the Candle backend: each `head_dim` row normalized (QK-norm,
/// [`crate::rms_norm::host`]) and rotated in one pass, where Burn's operations on Candle take
/// a dozen allocating passes (QK-norm and RoPE were 7% of a 128-token prompt of the real 270M on
/// two cores). `x`: `[rows, head_dim]` f32 row-major whose row `r` is at position `r % seq` of
/// the tables `cos`, `sin` (`[seq, head_dim / 2]`, already at the step's first position).
#[cfg(feature = "candle")]
pub(crate) mod host {
    use rayon::prelude::*;

    pub fn qk_norm_rope(x: &[f32], cos: &[f32], sin: &[f32], seq: usize, norm: Option<(&[f32], f32)>) -> Vec<f32> {
        let half = cos.len() / seq.max(1);
        let dim = 2 * half;
        let mut out = vec![0.0f32; x.len()];
        out.par_chunks_mut(dim.max(1)).zip(x.par_chunks(dim.max(1))).enumerate().for_each(|(r, (out, x))| {
            match norm {
                Some((weight, eps)) => crate::rms_norm::host::normalize_row(x, weight, eps, out),
                None => out.copy_from_slice(x),
            }
            let at = (r % seq) * half;
            let (cos, sin) = (&cos[at..at + half], &sin[at..at + half]);
            let (x1, x2) = out.split_at_mut(half);
            for (((a, b), &c), &s) in x1.iter_mut().zip(x2.iter_mut()).zip(cos).zip(sin) {
                let (u, v) = (*a, *b);
                *a = u * c - v * s;
                *b = v * c + u * s;
            }
        });
        out
    }
}

/// The `[max_positions, head_dim / 2]` cos and sin tables (f32 values) of `frequencies`.
pub fn tables(max_positions: usize, frequencies: &Frequencies) -> (Vec<f32>, Vec<f32>) {
    let half = frequencies.head_dim / 2;
    let inv_freq = frequencies.inv_freq();
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

/// CubeCL kernel: one cube per `(batch, head, position)` row, one unit per rotated pair. Reads
/// `x` through its strides (so the `[batch, seq, heads, dim] -> [batch, heads, seq, dim]` swap
/// of the projections costs nothing) and writes a contiguous result. QK-norm and the rotation
/// are computed in f32 and rounded once.
pub(crate) mod kernel {
    use crate::cube::{cube_index, cube_sum, empty, grid, pow2_ceil};
    use crate::graph::{launch, tensor_arg};
    use burn_cubecl::{tensor::CubeTensor, CubeRuntime};
    use cubecl::prelude::*;

    #[cube(launch)]
    fn rope_kernel<F: Float, W: Float>(
        x: &Tensor<F>,
        cos: &Tensor<f32>,
        sin: &Tensor<f32>,
        weight: &Tensor<W>,
        out: &mut Tensor<F>,
        offset: u32,
        eps: f32,
        #[comptime] norm: bool,
        #[define(F, W)] _dtypes: [StorageType; 2],
    ) {
        let heads = x.shape(1);
        let seq = x.shape(2);
        let dim = x.shape(3);
        let half = dim / 2;
        let row = cube_index();
        if row >= x.shape(0) * heads * seq {
            terminate!();
        }
        let s = row % seq;
        let h = (row / seq) % heads;
        let b = row / (seq * heads);
        let base = b * x.stride(0) + h * x.stride(1) + s * x.stride(2);
        let step = x.stride(3);
        let mut inv_rms = 1.0f32;
        if norm {
            let mut scratch = SharedMemory::<f32>::new(256usize);
            let mut partial = 0.0f32;
            let mut p = UNIT_POS_X as usize;
            while p < dim {
                let v = f32::cast_from(x[base + p * step]);
                partial += v * v;
                p += CUBE_DIM_X as usize;
            }
            let total = cube_sum(partial, &mut scratch);
            inv_rms = 1.0f32 / f32::sqrt(total / f32::cast_from(dim as u32) + eps);
        }
        let table = (offset as usize + s) * half;
        let out_base = row * dim;
        let mut p = UNIT_POS_X as usize;
        while p < half {
            let mut x1 = f32::cast_from(x[base + p * step]) * inv_rms;
            let mut x2 = f32::cast_from(x[base + (p + half) * step]) * inv_rms;
            if norm {
                x1 *= 1.0f32 + f32::cast_from(weight[p]);
                x2 *= 1.0f32 + f32::cast_from(weight[p + half]);
            }
            let c = cos[table + p];
            let sn = sin[table + p];
            out[out_base + p] = F::cast_from(x1 * c - x2 * sn);
            out[out_base + p + half] = F::cast_from(x2 * c + x1 * sn);
            p += CUBE_DIM_X as usize;
        }
    }

    /// `x`: `[batch, heads, seq, head_dim]`, any strides; `cos`/`sin`: contiguous f32 tables;
    /// `norm`: QK-norm weight `[head_dim]` and epsilon.
    pub fn rope<R: CubeRuntime>(
        x: CubeTensor<R>,
        cos: CubeTensor<R>,
        sin: CubeTensor<R>,
        offset: usize,
        norm: Option<(CubeTensor<R>, f64)>,
    ) -> CubeTensor<R> {
        let shape = x.meta.shape().clone();
        let out = empty(&x, shape.clone(), x.dtype);
        let rows = shape[0] * shape[1] * shape[2];
        if rows == 0 || shape[3] == 0 {
            return out;
        }
        let threads = pow2_ceil(shape[3] / 2).min(256);
        let has_norm = norm.is_some();
        // Without QK-norm the weight is never read; the cos table stands in for it.
        let (weight, eps) = norm.unwrap_or_else(|| (cos.clone(), 0.0));
        let dtypes = [x.dtype.into(), weight.dtype.into()];
        launch!(rope_kernel(
            &x.client,
            grid(rows),
            CubeDim::new_1d(threads as u32),
            tensor_arg(&x),
            tensor_arg(&cos),
            tensor_arg(&sin),
            tensor_arg(&weight),
            tensor_arg(&out),
            offset as u32,
            eps as f32,
            has_norm,
            dtypes,
        ));
        out
    }
}

#[cfg(test)]
mod gpu {
    use crate::gpu_test::{assert_close, seed, tolerance};
    use crate::GemmaBackend;
    use burn::tensor::{DType, Distribution, Tensor, TensorData};

    /// Head dims 64 to 256, 1 to 8 heads, position offsets, strided (swapped) inputs, with and
    /// without QK-norm.
    pub fn rope<B: GemmaBackend>(device: &B::Device, dtype: DType) {
        seed::<B>(device, "rope");
        // (batch, heads, seq, head size, offset, share of the pairs rotating)
        for (batch, heads, seq, dim, offset, partial) in [
            (1, 4, 7, 256, 0, 1.0),
            (2, 1, 1, 64, 300, 1.0),
            (1, 8, 5, 128, 17, 1.0),
            (3, 3, 2, 16, 9, 1.0),
            (1, 3, 9, 512, 40, 0.25),
            (2, 2, 3, 32, 5, 0.25),
        ] {
            let frequencies =
                super::Frequencies { head_dim: dim, theta: 1_000_000.0, factor: 1.0, partial_rotary_factor: partial };
            let (cos, sin) = super::tables(offset + seq + 3, &frequencies);
            let table = |v: Vec<f32>| {
                Tensor::<B, 2>::from_data(TensorData::new(v, [offset + seq + 3, dim / 2]), (device, DType::F32))
            };
            let (cos, sin) = (table(cos), table(sin));
            // As the model produces them: [batch, seq, heads, dim] swapped to [batch, heads, seq, dim].
            let x = Tensor::<B, 4>::random([batch, seq, heads, dim], Distribution::Normal(0.0, 2.0), device)
                .cast(dtype)
                .swap_dims(1, 2);
            let w = Tensor::<B, 1>::random([dim], Distribution::Normal(0.0, 0.5), device);
            for norm in [None, Some((w.clone(), 1e-6))] {
                let tables = super::RopeTables { cos: cos.clone(), sin: sin.clone() };
                let got = B::qk_norm_rope(x.clone(), &tables, offset, norm.clone());
                assert_eq!(got.dtype(), dtype);
                let expected =
                    super::reference(x.clone().cast(DType::F32), cos.clone(), sin.clone(), offset, norm.clone());
                let what = format!(
                    "rope b{batch} h{heads} s{seq} d{dim} offset {offset} partial {partial} norm {}",
                    norm.is_some()
                );
                if norm.is_none() && partial < 1.0 {
                    // Pairs past the rotated share come out as they went in.
                    let rotated = frequencies.rotated_pairs();
                    let kept = |t: Tensor<B, 4>| {
                        Tensor::cat(
                            vec![t.clone().slice_dim(3, rotated..dim / 2), t.slice_dim(3, dim / 2 + rotated..dim)],
                            3,
                        )
                        .cast(DType::F32)
                    };
                    assert_close(kept(got.clone()), kept(x.clone()), tolerance(dtype), &format!("{what}: unrotated"));
                }
                assert_close(got, expected, tolerance(dtype), &what);
            }
        }
    }

    /// The Candle backend's host rows against the same reference.
    #[cfg(feature = "candle")]
    #[allow(deprecated)]
    #[test]
    fn candle_host_rope_matches_reference() {
        rope::<burn::backend::Candle>(&Default::default(), DType::F32);
    }

    gpu_tests!(rope_matches_reference => rope);
}
