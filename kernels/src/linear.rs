//! Bias-free linear layer with the weight stored `[out, in]` as in checkpoints, and its
//! matrix-vector kernel for decode.

use burn::tensor::{backend::Backend, Tensor};

/// Reference: `x [n, in] @ weight[out, in]^T -> [n, out]`, computed as `(weight @ x^T)^T` so
/// that the large weight is read in its stored row-major layout and only the small activation is
/// transposed (a transposed view of the weight makes CPU backends copy it on every call).
pub fn reference<B: Backend>(x: Tensor<B, 2>, weight: Tensor<B, 2>) -> Tensor<B, 2> {
    weight.matmul(x.transpose()).transpose()
}

/// Most activation rows the matrix-vector kernel takes; larger inputs use the backend's matmul.
pub const GEMV_MAX_ROWS: usize = 8;

/// CubeCL matrix-vector kernel for `n <= GEMV_MAX_ROWS` activation rows (decode): each cube
/// owns `ROWS` output features, `32` units per feature stride over the input dimension reading
/// the weight row once, coalesced, in vectors of up to 16 bytes (the widest load the runtime
/// offers that divides the row), and accumulate all activation rows in f32; the 32 partial sums
/// are added by `plane_sum` where a row's units form one 32-wide plane (CUDA), else by a
/// shared-memory tree.
#[allow(clippy::manual_div_ceil)]
pub(crate) mod kernel {
    use crate::cube::{cube_index, grid, load_vector_size, planes_of_32};
    use crate::gelu::kernel::gelu_mul_f32;
    use crate::graph::{arg, launch_unchecked};
    use crate::Epilogue;
    use burn_cubecl::{tensor::CubeTensor, CubeRuntime};
    use cubecl::prelude::*;

    /// Output features per cube, and units per output feature; the quantized GEMV shares both
    /// (and [`reduce_and_store`], which assumes them).
    pub(crate) const ROWS: usize = 8;
    pub(crate) const LANES: usize = 32;
    // A cube's rows hold the gate and up halves of whole pair blocks (the GELU epilogue).
    const _: () = assert!(ROWS == 2 * crate::gelu::PAIR_BLOCK);

    /// Adds the 32 partial sums of each (activation row, output feature) pair and writes the
    /// totals from lane 0. A plane (32 units) owns `per_plane` consecutive output features
    /// starting at `first`; `acc[t * per_plane + r]` is the unit's partial sum of activation row
    /// `t` for feature `first + r`. Sums by `plane_sum` when `plane` (32-wide planes), else
    /// through a shared-memory tree; features past `n_out` are not written.
    ///
    /// With `pairs`, the cube's `ROWS` features are the gate and up rows of `PAIR_BLOCK` output
    /// features ([`crate::gelu::interleave_pairs`]; `n_out` a multiple of `ROWS`): the totals,
    /// rounded to `F` as a separate product would store them, meet in shared memory and
    /// `gelu_tanh(gate) * up` is written to `out` (`[m, n_out / 2]`).
    #[allow(clippy::too_many_arguments, clippy::collapsible_else_if)]
    #[cube]
    pub(crate) fn reduce_and_store<F: Float>(
        acc: &Array<f32>,
        out: &mut Array<F>,
        place: OutPlace,
        first: usize,
        n_out: usize,
        #[comptime] m: usize,
        #[comptime] per_plane: usize,
        #[comptime] plane: bool,
        #[comptime] pairs: bool,
    ) {
        let unit = UNIT_POS_X as usize;
        let lane = unit % LANES;
        // This plane's first feature within the cube's `ROWS`.
        let local = first - cube_index() * ROWS;
        let mut totals = SharedMemory::<F>::new(comptime!(if pairs { m * ROWS } else { 1usize }));
        if plane {
            #[unroll]
            for t in 0..m {
                #[unroll]
                for r in 0..per_plane {
                    let total = plane_sum(acc[t * per_plane + r]);
                    if pairs {
                        if lane == 0 {
                            totals[t * ROWS + local + r] = F::cast_from(total);
                        }
                    } else {
                        if lane == 0 && first + r < n_out {
                            out[t * place.stride as usize + place.offset as usize + first + r] = F::cast_from(total);
                        }
                    }
                }
            }
        } else {
            let threads = comptime!(ROWS / per_plane * LANES);
            let mut partial = SharedMemory::<f32>::new(comptime!(ROWS * LANES * m));
            tree_sum(acc, &mut partial, m, per_plane);
            if lane == 0 {
                #[unroll]
                for t in 0..m {
                    #[unroll]
                    for r in 0..per_plane {
                        let total = partial[(t * per_plane + r) * threads + unit];
                        if pairs {
                            totals[t * ROWS + local + r] = F::cast_from(total);
                        } else {
                            if first + r < n_out {
                                out[t * place.stride as usize + place.offset as usize + first + r] =
                                    F::cast_from(total);
                            }
                        }
                    }
                }
            }
        }
        if pairs {
            sync_cube();
            let half = comptime!(ROWS / 2);
            if unit < m * half {
                let (t, c) = (unit / half, unit % half);
                let gate = f32::cast_from(totals[t * ROWS + c]);
                let up = f32::cast_from(totals[t * ROWS + half + c]);
                out[t * place.stride as usize + place.offset as usize + cube_index() * half + c] =
                    F::cast_from(gelu_mul_f32(gate, up));
            }
        }
    }

    /// The shared-memory tree of [`reduce_and_store`] (planes not 32 wide): each unit's
    /// `acc[s]` goes to `partial[s * threads + unit]` (`threads`: the cube's `ROWS / per_plane *
    /// LANES` units; `partial` holds `ROWS * LANES * m`), and the 32 partial sums of each
    /// (activation row, feature) pair of a plane are added into its lane 0's entries:
    /// `partial[s * threads + unit]` for that unit.
    #[cube]
    pub(crate) fn tree_sum(
        acc: &Array<f32>,
        partial: &mut SharedMemory<f32>,
        #[comptime] m: usize,
        #[comptime] per_plane: usize,
    ) {
        let unit = UNIT_POS_X as usize;
        let lane = unit % LANES;
        let slots = comptime!(m * per_plane);
        let threads = comptime!(ROWS / per_plane * LANES);
        #[unroll]
        for s in 0..slots {
            partial[s * threads + unit] = acc[s];
        }
        sync_cube();
        // From a builtin so the loop variable is a runtime value (CUBE_DIM_X = planes * LANES).
        let mut stride = CUBE_DIM_X as usize / comptime!(2 * ROWS / per_plane);
        while stride > 0 {
            if lane < stride {
                #[unroll]
                for s in 0..slots {
                    partial[s * threads + unit] = partial[s * threads + unit] + partial[s * threads + unit + stride];
                }
            }
            sync_cube();
            stride /= 2;
        }
    }

    /// Where a product's rows go in `out`: row `t` of the product starts at `t * stride +
    /// offset` (a product written into its columns of a wider output).
    #[derive(CubeLaunch, CubeType, Clone, Copy)]
    pub(crate) struct OutPlace {
        pub stride: u32,
        pub offset: u32,
    }

    /// `k`: vectors per weight row; `n_out`: weight rows.
    #[cube(launch_unchecked)]
    fn gemv_kernel<F: Float, N: Size>(
        x: &Array<Vector<F, N>>,
        w: &Array<Vector<F, N>>,
        out: &mut Array<F>,
        place: OutPlace,
        k: u32,
        n_out: u32,
        #[comptime] m: usize,
        #[comptime] plane: bool,
        #[comptime] pairs: bool,
        #[define(F)] _dtype: StorageType,
    ) {
        let width = w.vector_size();
        let k = k as usize;
        let n_out = n_out as usize;
        let unit = UNIT_POS_X as usize;
        let local = unit / LANES;
        let lane = unit % LANES;
        let row = cube_index() * ROWS + local;
        let mut acc = Array::<f32>::new(m);
        #[unroll]
        for t in 0..m {
            acc[t] = 0.0f32;
        }
        if row < n_out {
            let base = row * k;
            let mut c = lane;
            while c < k {
                let wv = w[base + c];
                #[unroll]
                for t in 0..m {
                    let xv = x[t * k + c];
                    #[unroll]
                    for i in 0..width {
                        acc[t] += f32::cast_from(wv[i]) * f32::cast_from(xv[i]);
                    }
                }
                c += LANES;
            }
        }
        reduce_and_store::<F>(&acc, out, place, row, n_out, m, 1usize, plane, pairs);
    }

    /// `x`: contiguous `[n, in]` with `n <= GEMV_MAX_ROWS`; `w`: contiguous `[out, in]`, same
    /// dtype. Writes `[n, out]`, or for [`Epilogue::GeluPairs`] (gate and up rows interleaved,
    /// `out` a multiple of `ROWS`) `gelu_tanh(gate) * up`, `[n, out / 2]`, into columns
    /// `offset..` of `out` (`[n, wider]`, contiguous).
    pub fn gemv_into<R: CubeRuntime>(
        x: CubeTensor<R>,
        w: CubeTensor<R>,
        epilogue: Epilogue,
        out: &CubeTensor<R>,
        offset: usize,
    ) {
        let pairs = epilogue == Epilogue::GeluPairs;
        let [n, inp] = [x.meta.shape()[0], x.meta.shape()[1]];
        let out_features = w.meta.shape()[0];
        if n == 0 || out_features == 0 {
            return;
        }
        let dtype = x.dtype.into();
        let width = load_vector_size(&x.client, x.dtype.size(), inp, 16);
        let stride = out.meta.shape()[1] as u32;
        // Unchecked: rows past `n_out` skip the loop and are not stored, so every index is in
        // range (the bounds checks cost a compare and a select per loaded vector).
        launch_unchecked!(gemv_kernel(
            &x.client,
            grid(out_features.div_ceil(ROWS)),
            CubeDim::new_1d((ROWS * LANES) as u32),
            width,
            arg(&x),
            arg(&w),
            arg(out),
            OutPlaceLaunch::new(stride, offset as u32),
            (inp / width) as u32,
            out_features as u32,
            n,
            planes_of_32(&x.client),
            pairs,
            dtype,
        ));
    }
}

#[cfg(test)]
mod gpu {
    use crate::gpu_test::{assert_close, seed, tolerance};
    use crate::{Epilogue, GemmaBackend, HostMatrix};
    use burn::tensor::{DType, Distribution, Tensor, TensorData};

    /// 1 to 8 activation rows (the GEMV kernel) and more (the prefill GEMM, [`crate::gemm`]),
    /// odd and Gemma sizes.
    pub fn linear<B: GemmaBackend>(device: &B::Device, dtype: DType) {
        seed::<B>(device, "linear");
        for (n, inp, out) in [
            (1, 640, 1024),
            (1, 1152, 6912),
            (3, 2560, 37),
            (8, 333, 1001),
            (5, 17, 3),
            (9, 640, 256),
            (1, 640, 52_428),
            // Prefill products (the GEMM): odd sizes, and a Gemma 3 1B projection's shape.
            (37, 333, 1001),
            (130, 72, 200),
            (257, 1152, 1536),
        ] {
            let x = Tensor::<B, 2>::random([n, inp], Distribution::Normal(0.0, 1.0), device).cast(dtype);
            let w = Tensor::<B, 2>::random([out, inp], Distribution::Normal(0.0, 0.05), device).cast(dtype);
            let matrix = B::upload_matrix(HostMatrix::Dense(w.clone()), device).expect("dense upload");
            let got = B::project(x.clone(), &matrix, Epilogue::Identity);
            assert_eq!(got.dtype(), dtype);
            let expected = host_product(x, host(w), device);
            // Sums of hundreds of products: scale the tolerance with the input width.
            let tol =
                tolerance(dtype) * if dtype == DType::F32 && n > crate::linear::GEMV_MAX_ROWS { 20.0 } else { 2.0 };
            assert_close(got, expected, tol, &format!("linear {n}x{inp} -> {out}"));
        }
    }

    fn host<B: GemmaBackend>(t: Tensor<B, 2>) -> Vec<f32> {
        t.cast(DType::F32).into_data().to_vec::<f32>().expect("f32")
    }

    /// `x @ w^T` in f64 on the host (`w`: `[out, in]` row-major), so that a check does not
    /// inherit the backend matmul's precision (CUDA's f32 matmul may round through TF32).
    fn host_product<B: GemmaBackend>(x: Tensor<B, 2>, ws: Vec<f32>, device: &B::Device) -> Tensor<B, 2> {
        let [n, inp] = x.dims();
        let out = ws.len() / inp;
        let xs = host(x);
        let expected: Vec<f32> = (0..n)
            .flat_map(|r| {
                let (xs, ws) = (&xs, &ws);
                (0..out)
                    .map(move |o| (0..inp).map(|c| xs[r * inp + c] as f64 * ws[o * inp + c] as f64).sum::<f64>() as f32)
            })
            .collect();
        Tensor::<B, 2>::from_data(TensorData::new(expected, [n, out]), (device, DType::F32))
    }

    gpu_tests!(linear_matches_reference => linear);
}
