//! The quantized matrix-vector kernel (decode: at most [`crate::linear::GEMV_MAX_ROWS`]
//! activation rows).
//!
//! - `gemv_into`: decode-sized products (at most [`crate::linear::GEMV_MAX_ROWS`] activation rows).
//!   Each cube owns `ROWS` output features, in row groups of one, two or four features served
//!   by one plane of 32 units or, for matrices with few features and long rows, by `splits`
//!   planes together (see `work_split`); the group's units stride over the rows in vectors of
//!   up to 4 words (16 bytes: 16 Q8 or 32 Q4 codes, so a plane reads 512 consecutive bytes of
//!   each row per step and every code byte once; each
//!   unit loads up to four such vectors per row before using any, see `gemv_unroll`), with
//!   the vector's block scale (and offset) per row. The matching activations are loaded in
//!   vectors as wide as the runtime allows, converted to f32 and summed once for all the rows of
//!   the plane; the codes become floats `1 + code / 2^bits` by a shift and a mask (see
//!   `unit_code`), and the activation sum turns their dot products into the weights' (f32
//!   throughout). Launched unchecked: every index is in range by construction. Sums are added
//!   as in the dense kernel (`plane_sum` on 32-wide planes, else a shared-memory tree); a split
//!   group's plane totals meet in shared memory.

// Kernel code cannot call `div_ceil` or `is_multiple_of` (not CubeCL intrinsics).
#![allow(clippy::manual_div_ceil, clippy::manual_is_multiple_of)]

use super::device::Packed;
use crate::cube::{cube_index, grid, planes_of_32};
use crate::gelu::kernel::gelu_mul_f32;
use crate::graph::{arg, launch_unchecked};
use crate::linear::kernel::{reduce_and_store, OutPlace, OutPlaceLaunch, LANES, ROWS};
use crate::Epilogue;
use burn_cubecl::{tensor::CubeTensor, CubeRuntime};
use cubecl::prelude::*;

/// The bits of 1.0f32, which the GEMVs built on [`unit_code`] take as a launch argument.
pub(crate) const ONE_BITS: u32 = 0x3F80_0000;

/// Code `n` of a packed word as the float `1 + code / 2^bits` (exact): the code's bits are
/// shifted to the top of the mantissa of 1.0 - one shift and one mask-and-or, where [`code`]
/// also needs a subtraction. A dot product over these values is `sum(x) + sum(x * code) /
/// 2^bits`; the GEMV subtracts `sum(x)` once per code vector, shared by the rows it serves.
///
/// `one` is [`ONE_BITS`], passed to the kernel at run time: in a register, the mask-and-or is
/// one `LOP3` (it takes one immediate operand; with both the mask and 1.0 as constants nvcc
/// emitted two, as the SASS of the 12B decode GEMV showed, 2026-11-30).
#[cube]
pub(crate) fn unit_code(word: u32, #[comptime] n: usize, #[comptime] q4: bool, one: u32) -> f32 {
    let bits = comptime!(if q4 { 4usize } else { 8usize });
    // Lowest mantissa bit the code lands on, and the code's lowest bit in the word.
    let low = comptime!(23 - bits);
    let at = comptime!(n * bits);
    let mask = comptime!(((1u32 << bits) - 1) << low);
    let placed =
        if comptime!(at <= low) { word << comptime!((low - at) as u32) } else { word >> comptime!((at - low) as u32) };
    f32::reinterpret((placed & mask) | one)
}

/// One code vector's contribution to a row's product, from the dot product of its activations
/// with the [`unit_code`] values (`dot`), the activations' sum (`sx`) and the vector's block
/// `scale` (and Q4 `offset`): `sum(x * code) = 2^bits * (dot - sx)`; Q4 weights are `scale *
/// code + offset`, Q8's stored code is `q + 128`, so `sum(x * q) = 256 * dot - 384 * sx`.
#[cube]
pub(crate) fn block_product(dot: f32, sx: f32, scale: f32, offset: f32, #[comptime] q4: bool) -> f32 {
    let unit_scale = comptime!(if q4 { 16.0f32 } else { 256.0f32 });
    let sum_scale = comptime!(if q4 { 16.0f32 } else { 384.0f32 });
    let mut shift = scale * sum_scale;
    if q4 {
        shift -= offset;
    }
    scale * unit_scale * dot - shift * sx
}

/// Each plane (32 units) computes `per_plane` output features (`ROWS / per_plane` planes per
/// cube); its units stride over the rows in code vectors of `nw` words, loading the same
/// vector of every row it serves, so that the activations are loaded, converted to f32 and
/// summed once for all of them. Rows past `n_out` read the last row and are not stored.
#[allow(clippy::too_many_arguments)]
#[cube(launch_unchecked)]
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
    one: u32,
    #[comptime] m: usize,
    #[comptime] per_plane: usize,
    #[comptime] unroll: usize,
    #[comptime] q4: bool,
    #[comptime] plane: bool,
    #[comptime] pairs: bool,
    #[comptime] splits: usize,
    #[define(F, S)] _dtypes: [StorageType; 2],
) {
    // A row group (`per_plane` features) is served by `splits` planes striding over the row
    // together: consecutive units read consecutive code vectors.
    let group_units = comptime!(LANES * splits);
    let unit = UNIT_POS_X as usize;
    let first = cube_index() * ROWS + (unit / group_units) * per_plane;
    let mut acc = Array::<f32>::new(comptime!(m * per_plane));
    let shape = GemvShape { words, blocks, n_out, one };
    accumulate::<F, S, NW, NX>(x, codes, scales, offsets, &mut acc, first, shape, m, per_plane, unroll, q4, splits);
    let n_out = n_out as usize;
    if comptime!(splits > 1) {
        split_reduce_and_store::<F>(&acc, out, place, first, n_out, m, per_plane, plane, pairs, splits);
    } else {
        reduce_and_store::<F>(&acc, out, place, first, n_out, m, per_plane, plane, pairs);
    }
}

/// A quantized matrix as the GEMVs built on [`accumulate`] take it: code words and scale
/// blocks per row, rows (output features), and [`ONE_BITS`].
#[derive(CubeType, Clone, Copy)]
pub(crate) struct GemvShape {
    pub words: u32,
    pub blocks: u32,
    pub n_out: u32,
    pub one: u32,
}

/// The body of [`qgemv_kernel`] up to the reduction: this unit's partial sums of the `m`
/// activation rows' products with the `per_plane` output features from `first`, `acc[t *
/// per_plane + r]` (`acc` holds `m * per_plane`). The unit is lane `UNIT_POS_X % (32 *
/// splits)` of its row group. Every index is in range (rows clamped to the last).
#[allow(clippy::too_many_arguments)]
#[cube]
pub(crate) fn accumulate<F: Float, S: Float, NW: Size, NX: Size>(
    x: &Array<Vector<F, NX>>,
    codes: &Array<Vector<u32, NW>>,
    scales: &Array<S>,
    offsets: &Array<S>,
    acc: &mut Array<f32>,
    first: usize,
    shape: GemvShape,
    #[comptime] m: usize,
    #[comptime] per_plane: usize,
    #[comptime] unroll: usize,
    #[comptime] q4: bool,
    #[comptime] splits: usize,
) {
    let per_word = comptime!(if q4 { 8usize } else { 4usize });
    let nw = codes.vector_size();
    let nx = x.vector_size();
    let one = shape.one;
    // Activation loads per code vector (`nx` divides the vector's `nw * per_word` codes).
    let loads = comptime!(nw * per_word / nx);
    let vectors = shape.words as usize / nw;
    let n_out = shape.n_out as usize;
    let blocks = shape.blocks as usize;
    let k = shape.words as usize * per_word;
    let group_units = comptime!(LANES * splits);
    let lane = UNIT_POS_X as usize % group_units;
    let slots = comptime!(m * per_plane);
    #[unroll]
    for s in 0..slots {
        acc[s] = 0.0f32;
    }
    // Where the rows this plane serves start (codes, scales), clamped to the last row so that
    // every unit runs the same loop and reaches the reduction.
    let mut code_at = Array::<usize>::new(per_plane);
    let mut scale_at = Array::<usize>::new(per_plane);
    #[unroll]
    for r in 0..per_plane {
        let row = min(first + r, n_out - 1);
        code_at[r] = row * vectors;
        scale_at[r] = row * blocks;
    }
    // `unroll` code vectors per row and step, all loaded before any is used.
    let loaded = comptime!(unroll * per_plane);
    let mut cw = Array::<Vector<u32, NW>>::new(loaded);
    let mut scale = Array::<f32>::new(loaded);
    let mut offset = Array::<f32>::new(loaded);
    let mut dots = Array::<f32>::new(slots);
    let mut sx = Array::<f32>::new(m);
    let mut v0 = lane;
    // The first step's weights are loaded before anything an earlier kernel writes is read: in
    // a replayed graph the wait for the kernels before goes at the marker below, so these loads
    // overlap their tail (see `crate::graph`'s dependent launch).
    load_codes::<S, NW>(
        codes,
        scales,
        offsets,
        &code_at,
        &scale_at,
        &mut cw,
        &mut scale,
        &mut offset,
        v0,
        vectors,
        group_units,
        per_plane,
        unroll,
        q4,
    );
    comment!("burn-gemma: wait for the kernels before");
    while v0 < vectors {
        #[unroll]
        for u in 0..unroll {
            let v = v0 + u * group_units;
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
                                dots[t * per_plane + r] += unit_code(word, comptime!(c % per_word), q4, one) * xi;
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
                        acc[s] += block_product(dots[s], sx[t], scale[at], offset[at], q4);
                    }
                }
            }
        }
        v0 += comptime!(unroll * group_units);
        if v0 < vectors {
            load_codes::<S, NW>(
                codes,
                scales,
                offsets,
                &code_at,
                &scale_at,
                &mut cw,
                &mut scale,
                &mut offset,
                v0,
                vectors,
                group_units,
                per_plane,
                unroll,
                q4,
            );
        }
    }
}

/// Loads one step of [`qgemv_kernel`]: `unroll` code vectors (from `v0`, `group_units` apart) of
/// each of the `per_plane` rows starting at `code_at` / `scale_at`, with each vector's block
/// scale (and Q4 offset), all issued before any is used. Past the row's end a unit re-reads its
/// last vector, which the step discards.
#[allow(clippy::too_many_arguments)]
#[cube]
fn load_codes<S: Float, NW: Size>(
    codes: &Array<Vector<u32, NW>>,
    scales: &Array<S>,
    offsets: &Array<S>,
    code_at: &Array<usize>,
    scale_at: &Array<usize>,
    cw: &mut Array<Vector<u32, NW>>,
    scale: &mut Array<f32>,
    offset: &mut Array<f32>,
    v0: usize,
    vectors: usize,
    #[comptime] group_units: usize,
    #[comptime] per_plane: usize,
    #[comptime] unroll: usize,
    #[comptime] q4: bool,
) {
    let nw = codes.vector_size();
    let words_per_block = comptime!(if q4 { 4usize } else { 8usize });
    #[unroll]
    for u in 0..unroll {
        let v = min(v0 + u * group_units, vectors - 1);
        // A vector never straddles two blocks: one scale (and offset) per row.
        let block = (v * nw) / words_per_block;
        #[unroll]
        for r in 0..per_plane {
            let at = comptime!(u * per_plane + r);
            cw[at] = codes[code_at[r] + v];
            scale[at] = f32::cast_from(scales[scale_at[r] + block]);
            if q4 {
                offset[at] = f32::cast_from(offsets[scale_at[r] + block]);
            }
        }
    }
}

/// [`reduce_and_store`] for row groups served by `splits` planes: the `LANES * splits` partial
/// sums of each (activation row, feature) pair are added (each plane's by `plane_sum` when
/// `plane`, then the planes' totals through shared memory; else a shared-memory tree over the
/// group's units), and the group's first unit writes the totals, or with `pairs` hands them to
/// the GELU epilogue as the unsplit kernel does.
#[allow(clippy::too_many_arguments, clippy::collapsible_else_if)]
#[cube]
pub(crate) fn split_reduce_and_store<F: Float>(
    acc: &Array<f32>,
    out: &mut Array<F>,
    place: OutPlace,
    first: usize,
    n_out: usize,
    #[comptime] m: usize,
    #[comptime] per_plane: usize,
    #[comptime] plane: bool,
    #[comptime] pairs: bool,
    #[comptime] splits: usize,
) {
    let slots = comptime!(m * per_plane);
    let group_units = comptime!(LANES * splits);
    let groups = comptime!(ROWS / per_plane);
    let unit = UNIT_POS_X as usize;
    let group = unit / group_units;
    let lane = unit % group_units;
    let local = first - cube_index() * ROWS;
    let mut totals = SharedMemory::<F>::new(comptime!(if pairs { m * ROWS } else { 1usize }));
    // Slot `s` of unit `lane` (or of plane `lane / LANES`) of group `group`.
    let mut partial =
        SharedMemory::<f32>::new(comptime!(if plane { groups * splits * slots } else { groups * group_units * slots }));
    if plane {
        #[unroll]
        for s in 0..slots {
            let total = plane_sum(acc[s]);
            if lane % LANES == 0 {
                partial[(group * splits + lane / LANES) * slots + s] = total;
            }
        }
        sync_cube();
    } else {
        #[unroll]
        for s in 0..slots {
            partial[(group * group_units + lane) * slots + s] = acc[s];
        }
        sync_cube();
        // From a builtin so the loop variable is a runtime value (CUBE_DIM_X = groups * group_units).
        let mut stride = CUBE_DIM_X as usize / comptime!(2 * groups);
        while stride > 0 {
            if lane < stride {
                #[unroll]
                for s in 0..slots {
                    let at = (group * group_units + lane) * slots + s;
                    partial[at] = partial[at] + partial[at + stride * slots];
                }
            }
            sync_cube();
            stride /= 2;
        }
    }
    if lane == 0 {
        #[unroll]
        for t in 0..m {
            #[unroll]
            for r in 0..per_plane {
                let s = comptime!(t * per_plane + r);
                let mut total = 0.0f32;
                if plane {
                    #[unroll]
                    for p in 0..splits {
                        total += partial[(group * splits + p) * slots + s];
                    }
                } else {
                    total = partial[group * group_units * slots + s];
                }
                if pairs {
                    totals[t * ROWS + local + r] = F::cast_from(total);
                } else {
                    if first + r < n_out {
                        out[t * place.stride as usize + place.offset as usize + first + r] = F::cast_from(total);
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

/// Planes per streaming multiprocessor a quantized GEMV keeps busy before its planes take
/// several output features each (128 multiprocessors assumed where the runtime does not say).
const PLANES_PER_SM: usize = 16;

/// The quantized GEMV's work split for `n` activation rows: output features per plane and
/// planes per row group (`splits`, which stride over the row together).
///
/// Features per plane: four (two for three or more rows, whose per-unit sums take `2 * n *
/// features` registers), so that each activation is loaded, converted and summed once for all
/// of them; splits: for one or two rows, enough planes per row group to keep `PLANES_PER_SM`
/// planes per multiprocessor busy (each unit keeping at least one code vector per row).
/// Measured on the H200 (ncu, Gemma 3 12B q4 decode, `docs/runs/gpu/2026-11-27-gemv.md`): four
/// features per plane reached 1,888 GB/s on gate|up (30,720 features) and 3,310 GB/s on the
/// LM head, while the 3,840-feature products, at one feature per plane to keep enough planes,
/// reached 1,167 GB/s with the units 66% busy converting activations once per feature; split
/// four ways they keep four features per plane and reached 1,430 GB/s (16.4 us against 20.0 us
/// per product; a 12B-shaped q4 token 7.7% faster, q8 9.1%).
pub(crate) fn work_split<R: CubeRuntime>(
    client: &ComputeClient<R>,
    n: usize,
    out_features: usize,
    vectors: usize,
) -> (usize, usize) {
    let hardware = &client.properties().hardware;
    let sms = hardware.num_streaming_multiprocessors.map_or(128, |s| s as usize);
    let wanted = PLANES_PER_SM * sms;
    let most = if n <= 2 { 4 } else { 2 };
    let max_split = if n <= 2 { [8, 4, 2].into_iter().find(|&s| vectors >= LANES * s).unwrap_or(1) } else { 1 };
    // A cube is `ROWS / per_plane` groups of `splits` planes: within the runtime's cube size
    // (the unsplit kernel's 256 units always are).
    let max_units = (hardware.max_units_per_cube as usize).max(ROWS * LANES);
    let splits_for = |per_plane: usize| {
        let mut s = max_split;
        while s > 1 && ROWS / per_plane * LANES * s > max_units {
            s /= 2;
        }
        s
    };
    for per_plane in [4, 2, 1].into_iter().filter(|&p| p <= most) {
        let groups = out_features.div_ceil(per_plane);
        let most_splits = splits_for(per_plane);
        let mut splits = 1;
        while splits <= most_splits {
            if groups * splits >= wanted {
                return (per_plane, splits);
            }
            splits *= 2;
        }
    }
    (1, splits_for(1))
}

/// Code vectors each unit loads per row before using any: enough 16-byte loads in flight per
/// unit (`unroll * per_plane`, about 4) to cover the memory latency.
pub(crate) fn gemv_unroll(per_plane: usize, n: usize) -> usize {
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
    let (per_plane, splits) = work_split(&x.client, n, out_features, row_words as usize / nw);
    let unroll = gemv_unroll(per_plane, n);
    let stride = out.meta.shape()[1] as u32;
    // Unchecked: every index is in range by construction (rows and vectors clamped, stores
    // guarded); the bounds checks cost a compare and a select per activation (SASS, 2026-11-30).
    launch_unchecked!(qgemv_kernel(
        &x.client,
        grid(out_features.div_ceil(ROWS)),
        CubeDim::new_1d((ROWS / per_plane * LANES * splits) as u32),
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
        ONE_BITS,
        n,
        per_plane,
        unroll,
        q4,
        planes_of_32(&x.client),
        pairs,
        splits,
        dtypes,
    ));
}
