//! Routed matrix-vector products: each token's row through the experts the router chose, the
//! expert ids read on the device ([`super::Routes`]), only the chosen experts' rows streamed.
//!
//! The grid is `(output features / ROWS, y)`: `y` is the slot (token and pick) for
//! [`ExpertProduct::GeluHalves`] and the token for [`ExpertProduct::WeightedSum`], which loops
//! over the token's `top_k` picks and adds their products times the route weights in its
//! accumulator (no per-pick output is written). Each plane of 32 units owns one output feature
//! and strides over the row as the dense and quantized GEMVs do ([`crate::linear`],
//! [`crate::quant::gemv`]: 16-byte loads, several in flight per unit, f32 sums). For
//! `GeluHalves` a cube's first four planes take four gate rows and the last four the up rows
//! at the same offset in the expert's second half, so that `gelu_tanh(gate) * up` is formed in
//! the cube from the checkpoint's own row order (no interleaving at load). Activations may be
//! in another dtype than the weights (the f32 normalized residual, say).
//!
//! [`ExpertProduct::GeluHalves`]: super::ExpertProduct::GeluHalves
//! [`ExpertProduct::WeightedSum`]: super::ExpertProduct::WeightedSum

#![allow(clippy::manual_div_ceil)]

pub(crate) mod kernel {
    use crate::cube::{empty, load_vector_size, planes_of_32};
    use crate::experts::ExpertProduct;
    use crate::gelu::kernel::gelu_mul_f32;
    use crate::graph::{arg, launch};
    use crate::linear::kernel::{LANES, ROWS};
    use crate::quant::gemv::unit_code;
    use crate::quant::kernel::Packed;
    use burn::tensor::DType;
    use burn_cubecl::{tensor::CubeTensor, CubeRuntime};
    use cubecl::prelude::*;

    /// Gate (and up) rows per cube for `GeluHalves`.
    const HALF: usize = ROWS / 2;
    /// Code vectors each unit loads per row before using any (the quantized kernel).
    const UNROLL: usize = 4;

    /// The stack's shape: rows per expert, and experts (ids past the last are clamped to it).
    #[derive(CubeLaunch, CubeType, Clone, Copy)]
    pub(crate) struct Routing {
        pub rows: u32,
        pub count: u32,
    }

    /// The expert-local row this plane computes (clamped into the expert, so every unit loads
    /// in range and reaches the reduction).
    #[cube]
    fn plane_row(rows: usize, #[comptime] halves: bool) -> usize {
        let local = UNIT_POS_X as usize / LANES;
        let cube = CUBE_POS_X as usize;
        if halves {
            let half = rows / 2;
            let j = min(cube * HALF + local % HALF, half - 1);
            j + (local / HALF) * half
        } else {
            min(cube * ROWS + local, rows - 1)
        }
    }

    /// Slot `pick` of this cube's `y`: `(input row, expert, route weight)`.
    #[cube]
    fn pick_of(
        ids: &Array<u32>,
        weights: &Array<f32>,
        pick: usize,
        count: usize,
        #[comptime] top_k: usize,
        #[comptime] halves: bool,
    ) -> (usize, usize, f32) {
        let y = CUBE_POS_Y as usize;
        let slot = if halves { y } else { y * top_k + pick };
        let input = if halves { y / top_k } else { slot };
        let mut weight = 1.0f32;
        if !halves {
            weight = weights[slot];
        }
        (input, min(ids[slot] as usize, count - 1), weight)
    }

    /// Sums each plane's 32 partial sums and stores them: the feature itself, or for `halves`
    /// the cube's four `gelu_tanh(gate) * up` (the totals rounded to `O` first, as a separate
    /// product would store them).
    #[cube]
    fn store_routed<O: Float>(
        acc: f32,
        out: &mut Array<O>,
        rows: usize,
        #[comptime] halves: bool,
        #[comptime] plane: bool,
    ) {
        let unit = UNIT_POS_X as usize;
        let lane = unit % LANES;
        let local = unit / LANES;
        let cube = CUBE_POS_X as usize;
        let y = CUBE_POS_Y as usize;
        let mut partial = SharedMemory::<f32>::new(comptime!(ROWS * LANES));
        let mut totals = SharedMemory::<f32>::new(ROWS);
        let total = if plane {
            plane_sum(acc)
        } else {
            partial[unit] = acc;
            sync_cube();
            // From a builtin so the loop variable is a runtime value (CUBE_DIM_X = ROWS * LANES).
            let mut stride = CUBE_DIM_X as usize / comptime!(2 * ROWS);
            while stride > 0 {
                if lane < stride {
                    partial[unit] = partial[unit] + partial[unit + stride];
                }
                sync_cube();
                stride /= 2;
            }
            partial[unit - lane]
        };
        if halves {
            if lane == 0 {
                totals[local] = f32::cast_from(O::cast_from(total));
            }
            sync_cube();
            let half = rows / 2;
            let j = cube * HALF + unit;
            if unit < HALF && j < half {
                out[y * half + j] = O::cast_from(gelu_mul_f32(totals[unit], totals[unit + HALF]));
            }
        } else {
            let row = cube * ROWS + local;
            if lane == 0 && row < rows {
                out[y * rows + row] = O::cast_from(total);
            }
        }
    }

    /// Dense experts `w` (`[count * rows, cols]` as vectors of `N`), activations `x` in any
    /// float dtype with the same vector width.
    #[allow(clippy::too_many_arguments)]
    #[cube(launch)]
    fn routed_gemv_kernel<X: Float, W: Float, O: Float, N: Size>(
        x: &Array<Vector<X, N>>,
        w: &Array<Vector<W, N>>,
        ids: &Array<u32>,
        weights: &Array<f32>,
        out: &mut Array<O>,
        routing: Routing,
        vectors: u32,
        #[comptime] top_k: usize,
        #[comptime] halves: bool,
        #[comptime] plane: bool,
        #[define(X, W, O)] _dtypes: [StorageType; 3],
    ) {
        let width = w.vector_size();
        let vectors = vectors as usize;
        let rows = routing.rows as usize;
        let lane = UNIT_POS_X as usize % LANES;
        let row = plane_row(rows, halves);
        let picks = comptime!(if halves { 1usize } else { top_k });
        let mut acc = 0.0f32;
        #[unroll]
        for p in 0..picks {
            let (input, expert, weight) = pick_of(ids, weights, p, routing.count as usize, top_k, halves);
            let base = (expert * rows + row) * vectors;
            let xbase = input * vectors;
            let mut part = 0.0f32;
            let mut c = lane;
            while c < vectors {
                let wv = w[base + c];
                let xv = x[xbase + c];
                #[unroll]
                for i in 0..width {
                    part += f32::cast_from(wv[i]) * f32::cast_from(xv[i]);
                }
                c += LANES;
            }
            acc += weight * part;
        }
        store_routed::<O>(acc, out, rows, halves, plane);
    }

    /// Quantized experts (codes `[count * rows, words]` in vectors of `NW` words, one scale,
    /// and for Q4 one offset, per block), activations in vectors of `NX`; see
    /// [`crate::quant::gemv`] for the arithmetic.
    #[allow(clippy::too_many_arguments)]
    #[cube(launch)]
    fn routed_qgemv_kernel<X: Float, O: Float, S: Float, NW: Size, NX: Size>(
        x: &Array<Vector<X, NX>>,
        codes: &Array<Vector<u32, NW>>,
        scales: &Array<S>,
        offsets: &Array<S>,
        ids: &Array<u32>,
        weights: &Array<f32>,
        out: &mut Array<O>,
        routing: Routing,
        words: u32,
        blocks: u32,
        #[comptime] top_k: usize,
        #[comptime] q4: bool,
        #[comptime] halves: bool,
        #[comptime] plane: bool,
        #[define(X, O, S)] _dtypes: [StorageType; 3],
    ) {
        let per_word = comptime!(if q4 { 8usize } else { 4usize });
        let words_per_block = comptime!(32usize / per_word);
        let unit_scale = comptime!(if q4 { 16.0f32 } else { 256.0f32 });
        let sum_scale = comptime!(if q4 { 16.0f32 } else { 384.0f32 });
        let nw = codes.vector_size();
        let nx = x.vector_size();
        let loads = comptime!(nw * per_word / nx);
        let vectors = words as usize / nw;
        let blocks = blocks as usize;
        let k = words as usize * per_word;
        let rows = routing.rows as usize;
        let lane = UNIT_POS_X as usize % LANES;
        let row = plane_row(rows, halves);
        let picks = comptime!(if halves { 1usize } else { top_k });
        let mut cw = Array::<Vector<u32, NW>>::new(UNROLL);
        let mut scale = Array::<f32>::new(UNROLL);
        let mut offset = Array::<f32>::new(UNROLL);
        let mut acc = 0.0f32;
        #[unroll]
        for p in 0..picks {
            let (input, expert, weight) = pick_of(ids, weights, p, routing.count as usize, top_k, halves);
            let grow = expert * rows + row;
            let mut part = 0.0f32;
            let mut v0 = lane;
            while v0 < vectors {
                #[unroll]
                for u in 0..UNROLL {
                    // Past the row's end a unit re-reads its last vector and discards it below.
                    let v = min(v0 + u * LANES, vectors - 1);
                    let block = (v * nw) / words_per_block;
                    cw[u] = codes[grow * vectors + v];
                    scale[u] = f32::cast_from(scales[grow * blocks + block]);
                    if q4 {
                        offset[u] = f32::cast_from(offsets[grow * blocks + block]);
                    }
                }
                #[unroll]
                for u in 0..UNROLL {
                    let v = v0 + u * LANES;
                    if v < vectors {
                        let mut dot = 0.0f32;
                        let mut sx = 0.0f32;
                        #[unroll]
                        for g in 0..loads {
                            let xv = x[(input * k + v * nw * per_word) / nx + g];
                            #[unroll]
                            for i in 0..nx {
                                let xi = f32::cast_from(xv[i]);
                                sx += xi;
                                let c = comptime!(g * nx + i);
                                dot += unit_code(cw[u][comptime!(c / per_word)], comptime!(c % per_word), q4) * xi;
                            }
                        }
                        // Q8: scale * sum(x * q); Q4: scale * sum(x * code) + offset * sum(x).
                        let mut shift = scale[u] * sum_scale;
                        if q4 {
                            shift -= offset[u];
                        }
                        part += scale[u] * unit_scale * dot - shift * sx;
                    }
                }
                v0 += comptime!(UNROLL * LANES);
            }
            acc += weight * part;
        }
        store_routed::<O>(acc, out, rows, halves, plane);
    }

    /// The grid, output and comptime flags of a routed product of `rows` rows per expert.
    fn shape(
        product: ExpertProduct,
        rows: usize,
        (tokens, top_k): (usize, usize),
    ) -> (CubeCount, [usize; 2], bool) {
        let halves = product == ExpertProduct::GeluHalves;
        let (y, width, cubes) = if halves {
            (tokens * top_k, rows / 2, (rows / 2).div_ceil(HALF))
        } else {
            (tokens, rows, rows.div_ceil(ROWS))
        };
        (CubeCount::Static(cubes.max(1) as u32, y.max(1) as u32, 1), [y, width], halves)
    }

    /// Dense experts: `w` `[count * rows, cols]`; `x` `[tokens, cols]` (`GeluHalves`) or
    /// `[tokens * top_k, cols]` (`WeightedSum`), any float dtype; `ids`/`weights` `[tokens,
    /// top_k]` (`U32`, f32). Returns `dtype`.
    #[allow(clippy::too_many_arguments)]
    pub fn routed_gemv<R: CubeRuntime>(
        x: CubeTensor<R>,
        w: CubeTensor<R>,
        (count, rows): (usize, usize),
        ids: CubeTensor<R>,
        weights: CubeTensor<R>,
        product: ExpertProduct,
        dtype: DType,
    ) -> CubeTensor<R> {
        let (tokens, top_k) = (ids.meta.shape()[0], ids.meta.shape()[1]);
        let (cubes, out_shape, halves) = shape(product, rows, (tokens, top_k));
        let out = empty(&x, out_shape, dtype);
        let cols = w.meta.shape()[1];
        if out_shape[0] == 0 || out_shape[1] == 0 || cols == 0 {
            return out;
        }
        let size = x.dtype.size().max(w.dtype.size());
        let width = load_vector_size(&x.client, size, cols, 16 / size);
        launch!(routed_gemv_kernel(
            &x.client,
            cubes,
            CubeDim::new_1d((ROWS * LANES) as u32),
            width,
            arg(&x),
            arg(&w),
            arg(&ids),
            arg(&weights),
            arg(&out),
            RoutingLaunch::new(rows as u32, count as u32),
            (cols / width) as u32,
            top_k,
            halves,
            planes_of_32(&x.client),
            [x.dtype.into(), w.dtype.into(), dtype.into()],
        ));
        out
    }

    /// Quantized experts (`w` `[count * rows, cols]` packed); otherwise as [`routed_gemv`].
    pub fn routed_qgemv<R: CubeRuntime>(
        x: CubeTensor<R>,
        w: &Packed<R>,
        (count, rows): (usize, usize),
        ids: CubeTensor<R>,
        weights: CubeTensor<R>,
        product: ExpertProduct,
        dtype: DType,
    ) -> CubeTensor<R> {
        let (tokens, top_k) = (ids.meta.shape()[0], ids.meta.shape()[1]);
        let (cubes, out_shape, halves) = shape(product, rows, (tokens, top_k));
        let out = empty(&x, out_shape, dtype);
        if out_shape[0] == 0 || out_shape[1] == 0 {
            return out;
        }
        let (codes, scales, offsets, q4) = w.args();
        let (row_words, row_blocks) = w.row_sizes();
        let nw = load_vector_size(&x.client, 4, codes.meta.shape()[1], 4);
        let nx = load_vector_size(&x.client, x.dtype.size(), nw * w.format.codes_per_word(), 8);
        launch!(routed_qgemv_kernel(
            &x.client,
            cubes,
            CubeDim::new_1d((ROWS * LANES) as u32),
            nw,
            nx,
            arg(&x),
            arg(&codes),
            arg(&scales),
            arg(&offsets),
            arg(&ids),
            arg(&weights),
            arg(&out),
            RoutingLaunch::new(rows as u32, count as u32),
            row_words,
            row_blocks,
            top_k,
            q4,
            halves,
            planes_of_32(&x.client),
            [x.dtype.into(), dtype.into(), scales.dtype.into()],
        ));
        out
    }
}

#[cfg(test)]
mod gpu {
    use crate::experts::{project_reference, route_reference, ExpertProduct, Experts};
    use crate::gpu_test::{assert_close, seed, tolerance};
    use crate::{GemmaBackend, HostMatrix, HostQuantized, QuantFormat};
    use burn::tensor::{DType, Distribution, Tensor};

    /// The stacked experts of `count` matrices `[rows, cols]` in `format` (`None`: dense in
    /// `dtype`), uploaded as the backend keeps them.
    fn experts<B: GemmaBackend>(
        [count, rows, cols]: [usize; 3],
        format: Option<QuantFormat>,
        dtype: DType,
        device: &B::Device,
    ) -> Experts<B> {
        let w = Tensor::<B, 2>::random([count * rows, cols], Distribution::Normal(0.0, 0.05), device);
        let host = match format {
            None => HostMatrix::Dense(w.cast(dtype)),
            Some(q) => {
                let values = w.into_data().to_vec::<f32>().expect("f32");
                HostMatrix::Quantized(HostQuantized::quantize(&values, count * rows, cols, q).expect("quantize"))
            }
        };
        B::upload_experts(host, count, device).expect("upload")
    }

    /// Both products against the grouped reference (each chosen expert's dequantized matrix in
    /// one product), for 1 to 8 tokens (the routed kernels) and more (grouped on the device),
    /// odd widths, dense and Q8/Q4 experts, activations in f32 and the model dtype.
    pub fn routed<B: GemmaBackend>(device: &B::Device, dtype: DType) {
        seed::<B>(device, "routed experts");
        let formats = [None, Some(QuantFormat::Q8), Some(QuantFormat::Q4)];
        // (tokens, experts, top_k, 2 * m, cols, down cols)
        for (tokens, count, top_k, rows, cols) in
            [(1, 8, 2, 48, 64), (3, 5, 3, 22, 96), (8, 16, 8, 176, 256), (1, 128, 8, 88, 160), (13, 6, 2, 40, 64)]
        {
            for format in formats {
                let what = format!("{tokens} tokens, {count} experts top {top_k}, [{rows}, {cols}] {format:?} {dtype:?}");
                let gate_up = experts::<B>([count, rows, cols], format, dtype, device);
                let m = rows / 2;
                // The down projection's rows are `cols` wide and read `m` inputs; quantized only
                // where `m` splits into blocks.
                let down_format = format.filter(|_| m.is_multiple_of(32));
                let down = experts::<B>([count, cols, m], down_format, dtype, device);
                let scores = Tensor::<B, 2>::random([tokens, count], Distribution::Normal(0.0, 1.0), device);
                let scale = Tensor::<B, 1>::random([count], Distribution::Uniform(0.5, 1.5), device);
                let routes = route_reference(scores, scale, top_k).expect("routes");
                let x = Tensor::<B, 2>::random([tokens, cols], Distribution::Normal(0.0, 1.0), device);

                let h = B::project_experts(x.clone(), &gate_up, &routes, ExpertProduct::GeluHalves, dtype)
                    .expect("gate/up");
                let h_ref = project_reference(x, &gate_up, &routes, ExpertProduct::GeluHalves, dtype).expect("ref");
                assert_eq!(h.dtype(), dtype);
                assert_close(h.clone(), h_ref.clone(), tolerance(dtype) * 2.0, &format!("gate/up {what}"));

                // The down product from the same input on both sides.
                let y = B::project_experts(h_ref.clone(), &down, &routes, ExpertProduct::WeightedSum, dtype)
                    .expect("down");
                let y_ref =
                    project_reference(h_ref, &down, &routes, ExpertProduct::WeightedSum, dtype).expect("ref");
                assert_close(y, y_ref, tolerance(dtype) * 2.0, &format!("down {what}"));
            }
        }
    }

    gpu_tests!(routed_experts_match_reference => routed);
}
