//! RMSNorm with Gemma's `1 + w` scale, and its fusion with the residual add.

use burn::tensor::{backend::Backend, DType, Tensor};

/// Reference RMSNorm: f32 accumulation, result in `x`'s dtype.
pub fn reference<B: Backend, const D: usize>(x: Tensor<B, D>, weight: Tensor<B, 1>, eps: f64) -> Tensor<B, D> {
    let dtype = x.dtype();
    normalize(x.cast(DType::F32), weight, eps).cast(dtype)
}

/// Reference fused residual add + RMSNorm. `residual` is f32; the sum is computed in f32.
/// With `norms.post`, `x` is first normalized by it (rounded to `x`'s dtype as the unfused model
/// does).
pub fn add_reference<B: Backend>(
    residual: Tensor<B, 3>,
    x: Tensor<B, 3>,
    norms: &AddNorm<B>,
) -> (Tensor<B, 3>, Tensor<B, 3>) {
    let x = match &norms.post {
        Some(w) => reference(x, w.clone(), norms.eps),
        None => x,
    };
    let sum = (residual.cast(DType::F32) + x.cast(DType::F32)).mul_scalar(norms.scale);
    let normed = normalize(sum.clone(), norms.weight.clone(), norms.eps).cast(norms.out_dtype);
    (sum, normed)
}

/// The norms of a residual add ([`crate::GemmaBackend::add_rms_norm`]).
#[derive(Debug, Clone)]
pub struct AddNorm<B: Backend> {
    /// A norm applied to the added value first (Gemma 2/3's post-attention and post-MLP norms),
    /// its output rounded to the value's dtype.
    pub post: Option<Tensor<B, 1>>,
    /// The norm of the sum (`[hidden]`, f32).
    pub weight: Tensor<B, 1>,
    /// Epsilon of both norms.
    pub eps: f64,
    /// The sum is multiplied by this before it is kept and normalized (Gemma 4's per-layer
    /// `layer_scalar` at the end of a layer; 1 otherwise).
    pub scale: f64,
    /// Dtype of the normalized sum.
    pub out_dtype: DType,
}

/// `x` is f32; returns f32.
fn normalize<B: Backend, const D: usize>(x: Tensor<B, D>, weight: Tensor<B, 1>, eps: f64) -> Tensor<B, D> {
    let inv_rms = x.clone().square().mean_dim(D - 1).add_scalar(eps).sqrt().recip();
    let mut scale_shape = [1usize; D];
    scale_shape[D - 1] = weight.dims()[0];
    let scale = weight.cast(DType::F32).add_scalar(1.0).reshape(scale_shape);
    x * inv_rms * scale
}

/// RMSNorm over host rows, for the Candle backend: one pass over a row where Burn's operations
/// on Candle take seven, each allocating its result (the norms were 5% of a 128-token prompt of
/// the real 270M on two cores). Sums of squares in eight f32 lanes (so that they vectorize),
/// rows in parallel.
#[cfg(feature = "candle")]
pub(crate) mod host {
    use rayon::prelude::*;

    /// `x * (1 / sqrt(mean(x^2) + eps)) * (1 + weight)` of one row into `out`.
    pub(crate) fn normalize_row(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
        let mut lanes = [0.0f32; 8];
        let chunks = x.chunks_exact(8);
        let tail: f32 = chunks.remainder().iter().map(|v| v * v).sum();
        for chunk in chunks {
            for (lane, v) in lanes.iter_mut().zip(chunk) {
                *lane += v * v;
            }
        }
        let squares = lanes.iter().sum::<f32>() + tail;
        let inv = 1.0 / (squares / x.len() as f32 + eps).sqrt();
        for ((o, &v), &w) in out.iter_mut().zip(x).zip(weight) {
            *o = v * inv * (1.0 + w);
        }
    }

    /// [`super::reference`] of row-major rows of `weight.len()` values, in f32.
    pub fn rms_norm(x: &[f32], weight: &[f32], eps: f32) -> Vec<f32> {
        let n = weight.len().max(1);
        let mut out = vec![0.0f32; x.len()];
        out.par_chunks_mut(n).zip(x.par_chunks(n)).for_each(|(out, x)| normalize_row(x, weight, eps, out));
        out
    }

    /// [`super::add_reference`] in f32: `(sum, normed)` with `sum = (residual + x') * scale`,
    /// `x'` being `x` normalized by `post` where given.
    pub fn add_rms_norm(
        residual: &[f32],
        x: &[f32],
        post: Option<&[f32]>,
        weight: &[f32],
        eps: f32,
        scale: f32,
    ) -> (Vec<f32>, Vec<f32>) {
        let n = weight.len().max(1);
        let mut sum = vec![0.0f32; x.len()];
        let mut normed = vec![0.0f32; x.len()];
        sum.par_chunks_mut(n).zip(normed.par_chunks_mut(n)).zip(residual.par_chunks(n).zip(x.par_chunks(n))).for_each(
            |((sum, normed), (residual, x))| {
                match post {
                    Some(post) => normalize_row(x, post, eps, sum),
                    None => sum.copy_from_slice(x),
                }
                for (s, &r) in sum.iter_mut().zip(residual) {
                    *s = (r + *s) * scale;
                }
                normalize_row(sum, weight, eps, normed);
            },
        );
        (sum, normed)
    }
}

/// CubeCL kernels: one cube per row, up to [`kernel::ROW_UNITS`] units; each unit loads its
/// vectors of the row once (16-byte loads, all issued before the sum needs them) and keeps them
/// in registers for the output pass; sums by `plane_sum` and one barrier where planes are 32
/// wide; f32 accumulation.
pub(crate) mod kernel {
    use crate::cube::{cube_index, empty, grid, planes_of_32, planes_reduce};
    use crate::graph::{arg, launch};
    use burn::tensor::DType;
    use burn_cubecl::{tensor::CubeTensor, CubeRuntime};
    use cubecl::prelude::*;

    /// `1 / sqrt(mean(x^2) + eps)` of a row from each unit's partial sum of squares.
    /// Sums within planes first where they are 32 wide (`plane`, see
    /// [`crate::cube::planes_reduce`]).
    #[cube]
    fn inv_rms(partial: f32, scratch: &mut SharedMemory<f32>, n: usize, eps: f32, #[comptime] plane: bool) -> f32 {
        let total = planes_reduce(partial, scratch, plane, false);
        1.0f32 / f32::sqrt(total / f32::cast_from(n as u32) + eps)
    }

    /// [`inv_rms`] of `x[base..base + n]`, the cube's units striding over the row.
    #[cube]
    pub(crate) fn row_inv_rms<F: Float>(
        x: &Array<F>,
        base: usize,
        n: usize,
        scratch: &mut SharedMemory<f32>,
        eps: f32,
    ) -> f32 {
        let mut partial = 0.0f32;
        let mut c = UNIT_POS_X as usize;
        while c < n {
            let v = f32::cast_from(x[base + c]);
            partial += v * v;
            c += CUBE_DIM_X as usize;
        }
        inv_rms(partial, scratch, n, eps, false)
    }

    /// `(rows, n)` of a `[..., n]` shape.
    fn rows_and_width(shape: &burn::tensor::Shape) -> (usize, usize) {
        let n = shape[shape.num_dims() - 1];
        (shape.num_elements() / n.max(1), n)
    }

    /// Units per row and row vectors each unit holds in registers (`held`): a row is read
    /// once, in vectors of `width` elements, and normalized from registers.
    fn row_split<R: CubeRuntime>(client: &ComputeClient<R>, vectors: usize) -> (usize, usize) {
        let limit = (client.properties().hardware.max_units_per_cube as usize).min(ROW_UNITS);
        let units = crate::cube::pow2_floor(vectors.div_ceil(HELD).clamp(32, limit.max(32)));
        (units, vectors.div_ceil(units).max(1))
    }

    /// Units per row at most, and the row vectors each unit aims to hold.
    pub(crate) const ROW_UNITS: usize = 256;
    const HELD: usize = 2;

    /// The widest vector (at most 16 bytes of the widest of `sizes`) dividing `n`.
    fn row_vector<R: CubeRuntime>(client: &ComputeClient<R>, sizes: &[usize], n: usize) -> usize {
        let widest = sizes.iter().copied().max().unwrap_or(4);
        crate::cube::load_vector_size(client, widest, n, 16 / widest)
    }

    /// Writes this unit's `held` vectors of a row (`values`, at `base` of `out`) normalized:
    /// `value * inv * (1 + weight)`.
    #[cube]
    fn store_normed<V: Float, W: Float, O: Float, N: Size>(
        values: &Array<Vector<V, N>>,
        weight: &Array<Vector<W, N>>,
        out: &mut Array<Vector<O, N>>,
        base: usize,
        vectors: usize,
        inv: f32,
        #[comptime] held: usize,
    ) {
        #[unroll]
        for h in 0..held {
            let c = UNIT_POS_X as usize + h * CUBE_DIM_X as usize;
            if c < vectors {
                let w = weight[c];
                let mut o = Vector::<O, N>::empty();
                #[unroll]
                for i in 0..out.vector_size() {
                    o[i] = O::cast_from(f32::cast_from(values[h][i]) * inv * (1.0f32 + f32::cast_from(w[i])));
                }
                out[base + c] = o;
            }
        }
    }

    #[cube(launch)]
    pub(crate) fn rms_norm_kernel<F: Float, W: Float, N: Size>(
        x: &Array<Vector<F, N>>,
        weight: &Array<Vector<W, N>>,
        out: &mut Array<Vector<F, N>>,
        len: u32,
        eps: f32,
        #[comptime] held: usize,
        #[comptime] plane: bool,
        #[define(F, W)] _dtypes: [StorageType; 2],
    ) {
        let width = x.vector_size();
        let vectors = len as usize / width;
        let row = cube_index();
        if row * vectors >= x.len() {
            terminate!();
        }
        let base = row * vectors;
        let mut scratch = SharedMemory::<f32>::new(comptime!(if plane { 32usize } else { ROW_UNITS }));
        let mut values = Array::<Vector<F, N>>::new(held);
        let mut partial = 0.0f32;
        #[unroll]
        for h in 0..held {
            let c = UNIT_POS_X as usize + h * CUBE_DIM_X as usize;
            if c < vectors {
                let v = x[base + c];
                values[h] = v;
                #[unroll]
                for i in 0..width {
                    let f = f32::cast_from(v[i]);
                    partial += f * f;
                }
            }
        }
        let inv = inv_rms(partial, &mut scratch, len as usize, eps, plane);
        store_normed::<F, W, F, N>(&values, weight, out, base, vectors, inv, held);
    }

    #[cube(launch)]
    fn add_rms_norm_kernel<F: Float, W: Float, O: Float, S: Float, N: Size>(
        residual: &Array<Vector<S, N>>,
        x: &Array<Vector<F, N>>,
        x_weight: &Array<Vector<W, N>>,
        weight: &Array<Vector<W, N>>,
        sum: &mut Array<Vector<f32, N>>,
        out: &mut Array<Vector<O, N>>,
        len: u32,
        eps: f32,
        scale: f32,
        #[comptime] held: usize,
        #[comptime] plane: bool,
        #[comptime] pre_norm: bool,
        #[define(F, W, O, S)] _dtypes: [StorageType; 4],
    ) {
        let width = x.vector_size();
        let vectors = len as usize / width;
        let row = cube_index();
        if row * vectors >= x.len() {
            terminate!();
        }
        let base = row * vectors;
        let mut scratch = SharedMemory::<f32>::new(comptime!(if plane { 32usize } else { ROW_UNITS }));
        // Every load of the row is issued before the first reduction: a decode step's row is
        // one cube, whose time is the latency of its dependent phases (H200, ncu: 7.8 us per
        // call with the residual and weights loaded after each reduction, 12% of a 12B token).
        // The row's `x` (then the sums) in registers, f32, with its residual and weights.
        let mut values = Array::<Vector<f32, N>>::new(held);
        let mut res = Array::<Vector<f32, N>>::new(held);
        let mut x_w = Array::<Vector<W, N>>::new(held);
        let mut w = Array::<Vector<W, N>>::new(held);
        let mut partial = 0.0f32;
        #[unroll]
        for h in 0..held {
            let c = UNIT_POS_X as usize + h * CUBE_DIM_X as usize;
            if c < vectors {
                let v = Vector::<f32, N>::cast_from(x[base + c]);
                values[h] = v;
                res[h] = Vector::<f32, N>::cast_from(residual[base + c]);
                w[h] = weight[c];
                if pre_norm {
                    x_w[h] = x_weight[c];
                    #[unroll]
                    for i in 0..width {
                        partial += v[i] * v[i];
                    }
                }
            }
        }
        let mut x_inv = 1.0f32;
        if pre_norm {
            x_inv = inv_rms(partial, &mut scratch, len as usize, eps, plane);
        }
        let mut partial = 0.0f32;
        #[unroll]
        for h in 0..held {
            let c = UNIT_POS_X as usize + h * CUBE_DIM_X as usize;
            if c < vectors {
                let mut xv = values[h];
                if pre_norm {
                    #[unroll]
                    for i in 0..width {
                        // Rounded to the activation dtype, as the unfused model stores it.
                        xv[i] =
                            f32::cast_from(F::cast_from(values[h][i] * x_inv * (1.0f32 + f32::cast_from(x_w[h][i]))));
                    }
                }
                let v = (res[h] + xv) * Vector::new(scale);
                sum[base + c] = v;
                values[h] = v;
                #[unroll]
                for i in 0..width {
                    partial += v[i] * v[i];
                }
            }
        }
        let inv = inv_rms(partial, &mut scratch, len as usize, eps, plane);
        #[unroll]
        for h in 0..held {
            let c = UNIT_POS_X as usize + h * CUBE_DIM_X as usize;
            if c < vectors {
                let mut o = Vector::<O, N>::empty();
                #[unroll]
                for i in 0..width {
                    o[i] = O::cast_from(values[h][i] * inv * (1.0f32 + f32::cast_from(w[h][i])));
                }
                out[base + c] = o;
            }
        }
    }

    pub fn rms_norm<R: CubeRuntime>(x: CubeTensor<R>, weight: CubeTensor<R>, eps: f64) -> CubeTensor<R> {
        let shape = x.meta.shape().clone();
        let (rows, n) = rows_and_width(&shape);
        let out = empty(&x, shape, x.dtype);
        if rows == 0 || n == 0 {
            return out;
        }
        let dtypes = [x.dtype.into(), weight.dtype.into()];
        let width = row_vector(&x.client, &[x.dtype.size(), weight.dtype.size()], n);
        let (units, held) = row_split(&x.client, n / width);
        launch!(rms_norm_kernel(
            &x.client,
            grid(rows),
            CubeDim::new_1d(units as u32),
            width,
            arg(&x),
            arg(&weight),
            arg(&out),
            n as u32,
            eps as f32,
            held,
            planes_of_32(&x.client),
            dtypes,
        ));
        out
    }

    /// The device tensors of a [`super::AddNorm`].
    pub struct AddNorm<T> {
        pub post: Option<T>,
        pub weight: T,
        pub eps: f64,
        pub scale: f64,
        pub out_dtype: DType,
    }

    /// `residual` (any float dtype; f32 after the first add) and `x`: contiguous `[..., n]`.
    /// Returns `(residual + x'` in f32`, normed)`.
    pub fn add_rms_norm<R: CubeRuntime>(
        residual: CubeTensor<R>,
        x: CubeTensor<R>,
        norms: AddNorm<CubeTensor<R>>,
    ) -> (CubeTensor<R>, CubeTensor<R>) {
        let AddNorm { post: x_weight, weight, eps, scale, out_dtype } = norms;
        let shape = x.meta.shape().clone();
        let (rows, n) = rows_and_width(&shape);
        let sum = empty(&x, shape.clone(), DType::F32);
        let out = empty(&x, shape, out_dtype);
        if rows == 0 || n == 0 {
            return (sum, out);
        }
        let pre_norm = x_weight.is_some();
        // Without a pre-norm its weight is never read; the main weight stands in.
        let x_weight = x_weight.unwrap_or_else(|| weight.clone());
        let dtypes = [x.dtype.into(), weight.dtype.into(), out_dtype.into(), residual.dtype.into()];
        let sizes = [x.dtype.size(), weight.dtype.size(), out_dtype.size(), residual.dtype.size(), 4];
        let width = row_vector(&x.client, &sizes, n);
        let (units, held) = row_split(&x.client, n / width);
        launch!(add_rms_norm_kernel(
            &x.client,
            grid(rows),
            CubeDim::new_1d(units as u32),
            width,
            arg(&residual),
            arg(&x),
            arg(&x_weight),
            arg(&weight),
            arg(&sum),
            arg(&out),
            n as u32,
            eps as f32,
            scale as f32,
            held,
            planes_of_32(&x.client),
            pre_norm,
            dtypes,
        ));
        (sum, out)
    }
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

#[cfg(test)]
mod gpu {
    use crate::gpu_test::{assert_close, seed, tolerance};
    use crate::GemmaBackend;
    use burn::tensor::{DType, Distribution, Tensor};

    const NORMAL: Distribution = Distribution::Normal(0.0, 1.0);

    /// Odd widths and row counts, Gemma's hidden sizes, a 4-D input (QK-norm's shape).
    pub fn rms_norm<B: GemmaBackend>(device: &B::Device, dtype: DType) {
        seed::<B>(device, "rms_norm");
        for (rows, n) in [(1, 640), (7, 1152), (3, 2560), (5, 37), (2, 3840), (300, 13)] {
            let x = Tensor::<B, 2>::random([rows, n], Distribution::Normal(0.5, 2.0), device).cast(dtype);
            let w = Tensor::<B, 1>::random([n], NORMAL, device);
            let got = B::rms_norm(x.clone(), w.clone(), 1e-6);
            assert_eq!(got.dtype(), dtype);
            let expected = super::reference(x.cast(DType::F32), w, 1e-6);
            assert_close(got, expected, tolerance(dtype), &format!("rms_norm {rows}x{n}"));
        }
        let x = Tensor::<B, 4>::random([2, 3, 5, 256], NORMAL, device).cast(dtype);
        let w = Tensor::<B, 1>::random([256], NORMAL, device);
        let expected = super::reference(x.clone().cast(DType::F32), w.clone(), 1e-6);
        assert_close(B::rms_norm(x, w, 1e-6), expected, tolerance(dtype), "rms_norm 4-D");
    }

    pub fn add_rms_norm<B: GemmaBackend>(device: &B::Device, dtype: DType) {
        seed::<B>(device, "add_rms_norm");
        // The residual in f32, and in the activation dtype (the embeddings before the first add).
        let cases = [(1, 1, 640, DType::F32), (2, 9, 1152, DType::F32), (1, 3, 2560, dtype), (3, 5, 33, dtype)];
        for (batch, seq, n, residual_dtype) in cases {
            let residual =
                Tensor::<B, 3>::random([batch, seq, n], Distribution::Normal(0.0, 3.0), device).cast(residual_dtype);
            let x = Tensor::<B, 3>::random([batch, seq, n], NORMAL, device).cast(dtype);
            let w = Tensor::<B, 1>::random([n], NORMAL, device);
            let x_w = Tensor::<B, 1>::random([n], NORMAL, device);
            // The last adds a layer's sum scaled as Gemma 4's `layer_scalar` does.
            for (out_dtype, x_weight, scale) in
                [(DType::F32, None, 1.0), (dtype, None, 1.0), (dtype, Some(x_w.clone()), 1.0), (dtype, Some(x_w), 0.37)]
            {
                let pre = x_weight.is_some();
                let norms = super::AddNorm { post: x_weight.clone(), weight: w.clone(), eps: 1e-6, scale, out_dtype };
                let (sum, normed) = B::add_rms_norm(residual.clone(), x.clone(), &norms);
                assert_eq!((sum.dtype(), normed.dtype()), (DType::F32, out_dtype));
                // The pre-norm's output is rounded to the activation dtype, as the model's own.
                let x_ref = match x_weight {
                    Some(xw) => super::reference(x.clone(), xw, 1e-6),
                    None => x.clone(),
                };
                let plain = super::AddNorm { post: None, weight: w.clone(), eps: 1e-6, scale, out_dtype: DType::F32 };
                let (e_sum, e_normed) = super::add_reference(residual.clone(), x_ref.cast(DType::F32), &plain);
                let what = format!(
                    "add_rms_norm {batch}x{seq}x{n}, residual {residual_dtype:?} -> {out_dtype:?} (pre-norm {pre}, scale {scale})"
                );
                // The sum is f32, but with a pre-norm it adds a value rounded to the activation
                // dtype, where the kernel's and the reference's roundings may differ by one ulp.
                let sum_tol = tolerance(if pre { dtype } else { DType::F32 });
                assert_close(sum, e_sum, sum_tol, &format!("{what} (sum)"));
                assert_close(normed, e_normed, tolerance(out_dtype), &what);
            }
        }
    }

    gpu_tests!(rms_norm_matches_reference => rms_norm, add_rms_norm_matches_reference => add_rms_norm);

    /// The Candle backend's host rows against the same reference.
    #[cfg(feature = "candle")]
    #[allow(deprecated)]
    mod candle_host {
        use burn::tensor::DType;
        #[test]
        fn rms_norm_matches_reference() {
            super::rms_norm::<burn::backend::Candle>(&Default::default(), DType::F32);
        }
        #[test]
        fn add_rms_norm_matches_reference() {
            super::add_rms_norm::<burn::backend::Candle>(&Default::default(), DType::F32);
        }
    }
}
