//! The quantized matrix-vector kernel (decode: at most [`crate::linear::GEMV_MAX_ROWS`]
//! activation rows).
//!
//! - `gemv_into`: decode-sized products (at most [`crate::linear::GEMV_MAX_ROWS`] activation rows).
//!   Each cube owns `ROWS` output features, each plane of 32 units one, two or four of them; the
//!   units stride over the rows in vectors of up to 4 words (16 bytes: 16 Q8 or 32 Q4 codes, so
//!   a plane reads 512 consecutive bytes of each row per step and every code byte once; each
//!   unit loads up to four such vectors per row before using any, see `gemv_unroll`), with
//!   the vector's block scale (and offset) per row. The matching activations are loaded in
//!   vectors as wide as the runtime allows, converted to f32 and summed once for all the rows of
//!   the plane; the codes become floats `1 + code / 2^bits` by a shift and a mask (see
//!   `unit_code`), and the activation sum turns their dot products into the weights' (f32
//!   throughout). Sums are added as in the dense kernel (`plane_sum` on 32-wide planes, else a
//!   shared-memory tree).

#![allow(clippy::manual_div_ceil)]

use super::device::Packed;
use crate::cube::{cube_index, grid, planes_of_32};
use crate::graph::{arg, launch};
use crate::linear::kernel::{reduce_and_store, OutPlace, OutPlaceLaunch, LANES, ROWS};
use crate::Epilogue;
use burn_cubecl::{tensor::CubeTensor, CubeRuntime};
use cubecl::prelude::*;

/// Code `n` of a packed word as the float `1 + code / 2^bits` (exact): the code's bits are
/// shifted to the top of the mantissa of 1.0 - one shift and one mask-and-or, where [`code`]
/// also needs a subtraction. A dot product over these values is `sum(x) + sum(x * code) /
/// 2^bits`; the GEMV subtracts `sum(x)` once per code vector, shared by the rows it serves.
#[cube]
pub(crate) fn unit_code(word: u32, #[comptime] n: usize, #[comptime] q4: bool) -> f32 {
    let bits = comptime!(if q4 { 4usize } else { 8usize });
    // Lowest mantissa bit the code lands on, and the code's lowest bit in the word.
    let low = comptime!(23 - bits);
    let at = comptime!(n * bits);
    let mask = comptime!(((1u32 << bits) - 1) << low);
    let placed =
        if comptime!(at <= low) { word << comptime!((low - at) as u32) } else { word >> comptime!((at - low) as u32) };
    f32::reinterpret((placed & mask) | 0x3F80_0000u32)
}

/// Each plane (32 units) computes `per_plane` output features (`ROWS / per_plane` planes per
/// cube); its units stride over the rows in code vectors of `nw` words, loading the same
/// vector of every row it serves, so that the activations are loaded, converted to f32 and
/// summed once for all of them. Rows past `n_out` read the last row and are not stored.
#[allow(clippy::too_many_arguments)]
#[cube(launch)]
fn qgemv_kernel<F: Float, S: Float, NW: Size, NX: Size>(
    x: &Array<Vector<F, NX>>,
    codes: &Array<Vector<u32, NW>>,
    scales: &Array<S>,
    offsets: &Array<S>,
    out: &mut Array<F>,
    place: OutPlace,
    words: u32,
    blocks: u32,
    n_out: u32,
    #[comptime] m: usize,
    #[comptime] per_plane: usize,
    #[comptime] unroll: usize,
    #[comptime] q4: bool,
    #[comptime] plane: bool,
    #[comptime] pairs: bool,
    #[define(F, S)] _dtypes: [StorageType; 2],
) {
    let per_word = comptime!(if q4 { 8usize } else { 4usize });
    let words_per_block = comptime!(32usize / per_word);
    // `sum(x * code) = 2^bits * (dot - sum(x))` with `dot` over `1 + code / 2^bits`; Q8's
    // stored code is `q + 128`, so `sum(x * q) = 256 * dot - 384 * sum(x)`.
    let unit_scale = comptime!(if q4 { 16.0f32 } else { 256.0f32 });
    let sum_scale = comptime!(if q4 { 16.0f32 } else { 384.0f32 });
    let nw = codes.vector_size();
    let nx = x.vector_size();
    // Activation loads per code vector (`nx` divides the vector's `nw * per_word` codes).
    let loads = comptime!(nw * per_word / nx);
    let vectors = words as usize / nw;
    let n_out = n_out as usize;
    let blocks = blocks as usize;
    let k = words as usize * per_word;
    let unit = UNIT_POS_X as usize;
    let lane = unit % LANES;
    let first = cube_index() * ROWS + (unit / LANES) * per_plane;
    let slots = comptime!(m * per_plane);
    let mut acc = Array::<f32>::new(slots);
    #[unroll]
    for s in 0..slots {
        acc[s] = 0.0f32;
    }
    // The rows this plane serves, clamped to the last row so that every unit runs the same loop and reaches the reduction.
    let mut row_at = Array::<usize>::new(per_plane);
    #[unroll]
    for r in 0..per_plane {
        row_at[r] = min(first + r, n_out - 1);
    }
    // `unroll` code vectors per row and step, all loaded before any is used.
    let loaded = comptime!(unroll * per_plane);
    let mut cw = Array::<Vector<u32, NW>>::new(loaded);
    let mut scale = Array::<f32>::new(loaded);
    let mut offset = Array::<f32>::new(loaded);
    let mut dots = Array::<f32>::new(slots);
    let mut sx = Array::<f32>::new(m);
    let mut v0 = lane;
    while v0 < vectors {
        #[unroll]
        for u in 0..unroll {
            // Past the row's end a unit re-reads its last vector and discards it below.
            let v = min(v0 + u * LANES, vectors - 1);
            // A vector never straddles two blocks: one scale (and offset) per row.
            let block = (v * nw) / words_per_block;
            #[unroll]
            for r in 0..per_plane {
                let at = comptime!(u * per_plane + r);
                cw[at] = codes[row_at[r] * vectors + v];
                scale[at] = f32::cast_from(scales[row_at[r] * blocks + block]);
                if q4 {
                    offset[at] = f32::cast_from(offsets[row_at[r] * blocks + block]);
                }
            }
        }
        #[unroll]
        for u in 0..unroll {
            let v = v0 + u * LANES;
            if v < vectors {
                #[unroll]
                for s in 0..slots {
                    dots[s] = 0.0f32;
                }
                #[unroll]
                for t in 0..m {
                    sx[t] = 0.0f32;
                    #[unroll]
                    for g in 0..loads {
                        let xv = x[(t * k + v * nw * per_word) / nx + g];
                        #[unroll]
                        for i in 0..nx {
                            let xi = f32::cast_from(xv[i]);
                            sx[t] += xi;
                            let c = comptime!(g * nx + i);
                            #[unroll]
                            for r in 0..per_plane {
                                let word = cw[comptime!(u * per_plane + r)][comptime!(c / per_word)];
                                dots[t * per_plane + r] += unit_code(word, comptime!(c % per_word), q4) * xi;
                            }
                        }
                    }
                }
                #[unroll]
                for t in 0..m {
                    #[unroll]
                    for r in 0..per_plane {
                        let s = comptime!(t * per_plane + r);
                        let at = comptime!(u * per_plane + r);
                        // Q8: scale * sum(x * q); Q4: scale * sum(x * code) + offset * sum(x).
                        let mut shift = scale[at] * sum_scale;
                        if q4 {
                            shift -= offset[at];
                        }
                        acc[s] += scale[at] * unit_scale * dots[s] - shift * sx[t];
                    }
                }
            }
        }
        v0 += comptime!(unroll * LANES);
    }
    reduce_and_store::<F>(&acc, out, place, first, n_out, m, per_plane, plane, pairs);
}

/// Planes per streaming multiprocessor a quantized GEMV keeps busy before its planes take
/// several output features each (128 multiprocessors assumed where the runtime does not say).
const PLANES_PER_SM: usize = 16;

/// Output features per plane of the quantized GEMV for `n` activation rows: four (two for
/// three or more rows, whose per-unit sums take `2 * n * features` registers), each
/// activation then loaded, converted and summed once for all of them - while enough planes
/// remain; fewer features per plane otherwise. H100, ncu, Q8: 1 x 2560 -> 10240 went from
/// 20.8 to 18.0 us with four (2,560 planes), 1 x 640 -> 52,428 from 34.9 to 27.7 us, while
/// 1 x 10240 -> 2560 (640 planes left) went from 27.1 to 35.7 us.
fn rows_per_plane<R: CubeRuntime>(client: &ComputeClient<R>, n: usize, out_features: usize) -> usize {
    let sms = client.properties().hardware.num_streaming_multiprocessors.map_or(128, |s| s as usize);
    let most = if n <= 2 { 4 } else { 2 };
    [4, 2].into_iter().filter(|&r| r <= most).find(|&r| out_features / r >= PLANES_PER_SM * sms).unwrap_or(1)
}

/// Code vectors each unit loads per row before using any: enough 16-byte loads in flight per
/// unit (`unroll * per_plane`, about 4) to cover the memory latency.
fn gemv_unroll(per_plane: usize, n: usize) -> usize {
    if n > 2 {
        return 1;
    }
    (4 / per_plane).max(1)
}

/// `x`: contiguous `[n, in]` with `n <= GEMV_MAX_ROWS`. Writes `[n, out]` in `x`'s dtype, or
/// for [`Epilogue::GeluPairs`] (gate and up rows interleaved, `out` a multiple of `ROWS`)
/// `gelu_tanh(gate) * up`, `[n, out / 2]`, into columns `offset..` of `out` (`[n, wider]`,
/// contiguous).
pub fn gemv_into<R: CubeRuntime>(
    x: CubeTensor<R>,
    w: &Packed<R>,
    epilogue: Epilogue,
    out: &CubeTensor<R>,
    offset: usize,
) {
    let pairs = epilogue == Epilogue::GeluPairs;
    let n = x.meta.shape()[0];
    let out_features = w.codes.meta.shape()[0];
    if n == 0 || out_features == 0 {
        return;
    }
    let (codes, scales, offsets, q4) = w.args();
    let (row_words, row_blocks) = w.row_sizes();
    let dtypes = [x.dtype.into(), scales.dtype.into()];
    // Up to 4 words (16 bytes) per code load: a divisor of the row, and of the block (4 or
    // 8 words); activations in loads of up to 16 bytes dividing the vector's codes.
    let (nw, nx) = w.load_vectors(&x);
    let per_plane = rows_per_plane(&x.client, n, out_features);
    let unroll = gemv_unroll(per_plane, n);
    let stride = out.meta.shape()[1] as u32;
    launch!(qgemv_kernel(
        &x.client,
        grid(out_features.div_ceil(ROWS)),
        CubeDim::new_1d((ROWS / per_plane * LANES) as u32),
        nw,
        nx,
        arg(&x),
        arg(&codes),
        arg(&scales),
        arg(&offsets),
        arg(out),
        OutPlaceLaunch::new(stride, offset as u32),
        row_words,
        row_blocks,
        out_features as u32,
        n,
        per_plane,
        unroll,
        q4,
        planes_of_32(&x.client),
        pairs,
        dtypes,
    ));
}
