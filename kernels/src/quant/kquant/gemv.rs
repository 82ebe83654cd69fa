//! The k-quant matrix-vector kernel (decode: at most [`crate::linear::GEMV_MAX_ROWS`] activation
//! rows), the Q4/Q8 one's ([`crate::quant::gemv`]) over GGUF's super-blocks.
//!
//! The work is split as there: each cube owns `ROWS` output features, in row groups of one,
//! two or four features served by one plane or by `splits` planes together, whose units stride
//! over the row in code vectors of 32 weights (16 bytes of `lo`, and one or two `hi` words),
//! several vectors per row in flight before any is used. A vector is one Q4_K/Q5_K sub-block
//! (one scale and min) or two Q6_K ones (two scales), so each unit decodes its vector's scales
//! from the packed bytes once per row and vector, and the 32 products run in f32 over codes
//! turned into floats `1 + q / 2^bits` by shifts and masks (as [`crate::quant::gemv`]'s
//! `unit_code`, the high bits placed beside the low four): with the activations' sum `sx`, a
//! sub-block's `sum(x * w)` is `a * dot - b * sx` for two numbers `a`, `b` of its scales.

// Kernel code cannot call `div_ceil` or `is_multiple_of` (not CubeCL intrinsics).
#![allow(clippy::manual_div_ceil, clippy::manual_is_multiple_of)]

use super::{KQuantFormat, VECTOR};
use crate::cube::{cube_index, grid, load_vector_size, planes_of_32};
use crate::graph::{arg, launch_unchecked};
use crate::linear::kernel::{reduce_and_store, OutPlace, OutPlaceLaunch, LANES, ROWS};
use crate::quant::gemv::{gemv_unroll, split_reduce_and_store, work_split, ONE_BITS};
use crate::Epilogue;
use burn_cubecl::{tensor::CubeTensor, CubeRuntime};
use cubecl::prelude::*;

/// `word` shifted so that its bit `from` lands on bit `to`.
#[cube]
fn place(word: u32, #[comptime] from: usize, #[comptime] to: usize) -> u32 {
    if comptime!(from <= to) {
        word << comptime!((to - from) as u32)
    } else {
        word >> comptime!((from - to) as u32)
    }
}

/// Code `c` (`0..32`) of a code vector as the float `1 + q / 2^bits` (exact): the low four bits
/// from `lo` (the vector's word `c / 8`), the high ones (`kind` of them) from `hi` (the vector's
/// high-bit word holding code `c`), shifted to the top of the mantissa of 1.0 (`one`:
/// [`ONE_BITS`] at run time, kept in a register; see [`crate::quant::gemv::unit_code`]).
#[cube]
pub(crate) fn unit_code(lo: u32, hi: u32, #[comptime] c: usize, #[comptime] kind: u32, one: u32) -> f32 {
    let hb = comptime!(kind as usize);
    let low = comptime!(23 - 4 - hb);
    let mut placed = place(lo, comptime!((c % 8) * 4), low) & comptime!(15u32 << low as u32);
    if comptime!(hb > 0) {
        let per = comptime!(32 / hb);
        let mask = comptime!(((1u32 << hb as u32) - 1) << (low + 4) as u32);
        placed |= place(hi, comptime!((c % per) * hb), comptime!(low + 4)) & mask;
    }
    f32::reinterpret(placed | one)
}

/// The scale and min (Q4_K, Q5_K: `sc`, `m`, each `0..64`) of sub-block `j` (`0..8`) from the
/// three words of a super-block's packed scale bytes.
#[cube]
pub(crate) fn scale_min(q0: u32, q1: u32, q2: u32, j: usize) -> Vector<u32, Const<2>> {
    let s = ((j % 4) * 8) as u32;
    let (b0, b1, b2) = (q0 >> s, q1 >> s, q2 >> s);
    let low = j < 4;
    let mut out = Vector::<u32, Const<2>>::empty();
    out[0] = select(low, b0 & 63u32, (b2 & 15u32) | ((b0 >> 2u32) & 48u32));
    out[1] = select(low, b1 & 63u32, ((b2 >> 4u32) & 15u32) | ((b1 >> 2u32) & 48u32));
    out
}

/// A signed byte `b` (`0..256` as stored) as a float.
#[cube]
pub(crate) fn signed_byte(b: u32) -> f32 {
    f32::cast_from(b) - select(b >= 128u32, 256.0f32, 0.0f32)
}

/// Each plane computes `per_plane` output features (`ROWS / per_plane` planes per cube, or
/// `splits` planes per row group); rows past `n_out` read the last row and are not stored.
#[allow(clippy::too_many_arguments)]
#[cube(launch_unchecked)]
fn kgemv_kernel<F: Float, S: Float, NW: Size, NX: Size>(
    x: &Array<Vector<F, NX>>,
    lo: &Array<Vector<u32, NW>>,
    hi: &Array<u32>,
    meta: &Array<u32>,
    supers: &Array<S>,
    out: &mut Array<F>,
    place: OutPlace,
    vectors: u32,
    n_out: u32,
    one: u32,
    #[comptime] m: usize,
    #[comptime] per_plane: usize,
    #[comptime] unroll: usize,
    #[comptime] kind: u32,
    #[comptime] plane: bool,
    #[comptime] pairs: bool,
    #[comptime] splits: usize,
    #[define(F, S)] _dtypes: [StorageType; 2],
) {
    let hb = comptime!(kind as usize);
    let q6 = comptime!(kind == 2);
    // Scale groups per code vector (Q6_K: two sub-blocks of 16), scale words and super-block
    // scales per super-block.
    let halves = comptime!(if kind == 2 { 2usize } else { 1usize });
    let meta_words = comptime!(if kind == 2 { 4usize } else { 3usize });
    let sups = comptime!(if kind == 2 { 1usize } else { 2usize });
    // `2^bits`, with which `sum(x * q) = 2^bits * (dot - sx)`.
    let unit_scale = comptime!((1u32 << (4 + hb) as u32) as f32);
    let nx = x.vector_size();
    let loads = comptime!(32usize / nx);
    let vectors = vectors as usize;
    let per_row = vectors / 8;
    let k = vectors * 32;
    let n_out = n_out as usize;
    let unit = UNIT_POS_X as usize;
    let group_units = comptime!(LANES * splits);
    let lane = unit % group_units;
    let first = cube_index() * ROWS + (unit / group_units) * per_plane;
    let slots = comptime!(m * per_plane);
    let mut acc = Array::<f32>::new(slots);
    #[unroll]
    for s in 0..slots {
        acc[s] = 0.0f32;
    }
    let mut rows = Array::<usize>::new(per_plane);
    #[unroll]
    for r in 0..per_plane {
        rows[r] = min(first + r, n_out - 1);
    }
    let loaded = comptime!(unroll * per_plane);
    let mut cw = Array::<Vector<u32, NW>>::new(loaded);
    let mut hw = Array::<u32>::new(comptime!(if hb > 0 { loaded * hb } else { 1usize }));
    // Per loaded vector and scale group: `sum(x * w) = a * dot - b * sx`.
    let mut ca = Array::<f32>::new(comptime!(loaded * halves));
    let mut cb = Array::<f32>::new(comptime!(loaded * halves));
    let mut dots = Array::<f32>::new(comptime!(slots * halves));
    let mut sx = Array::<f32>::new(comptime!(m * halves));
    let mut v0 = lane;
    while v0 < vectors {
        #[unroll]
        for u in 0..unroll {
            // Past the row's end a unit re-reads its last vector and discards it below.
            let v = min(v0 + u * group_units, vectors - 1);
            let sb = v / 8;
            #[unroll]
            for r in 0..per_plane {
                let at = comptime!(u * per_plane + r);
                let row = rows[r];
                let vector = row * vectors + v;
                cw[at] = lo[vector];
                #[unroll]
                for h in 0..hb {
                    hw[comptime!(at * hb + h)] = hi[vector * hb + h];
                }
                let block = row * per_row + sb;
                let d = f32::cast_from(supers[block * sups]);
                if q6 {
                    let word = meta[block * meta_words + (v % 8) / 2];
                    let shift = ((v % 2) * 16) as u32;
                    #[unroll]
                    for h in 0..2usize {
                        let sc = signed_byte((word >> (shift + comptime!(8 * h as u32))) & 255u32);
                        // `sum(x * (q - 32)) = 64 * dot - 96 * sx`.
                        ca[comptime!(at * 2 + h)] = d * sc * 64.0f32;
                        cb[comptime!(at * 2 + h)] = d * sc * 96.0f32;
                    }
                } else {
                    let base = block * meta_words;
                    let sm = scale_min(meta[base], meta[base + 1], meta[base + 2], v % 8);
                    let dmin = f32::cast_from(supers[block * sups + 1]);
                    let scale = d * f32::cast_from(sm[0]) * unit_scale;
                    ca[at] = scale;
                    cb[at] = scale + dmin * f32::cast_from(sm[1]);
                }
            }
        }
        #[unroll]
        for u in 0..unroll {
            let v = v0 + u * group_units;
            if v < vectors {
                #[unroll]
                for s in 0..comptime!(slots * halves) {
                    dots[s] = 0.0f32;
                }
                #[unroll]
                for t in 0..m {
                    #[unroll]
                    for h in 0..halves {
                        sx[comptime!(t * halves + h)] = 0.0f32;
                    }
                    #[unroll]
                    for g in 0..loads {
                        let xv = x[(t * k + v * 32) / nx + g];
                        #[unroll]
                        for i in 0..nx {
                            let xi = f32::cast_from(xv[i]);
                            let c = comptime!(g * nx + i);
                            let h = comptime!(if halves == 2 { c / 16 } else { 0usize });
                            sx[comptime!(t * halves + h)] += xi;
                            #[unroll]
                            for r in 0..per_plane {
                                let at = comptime!(u * per_plane + r);
                                let word = cw[at][comptime!(c / 8)];
                                let mut high = 0u32;
                                if comptime!(hb > 0) {
                                    high = hw[comptime!(at * hb + c / (32 / hb))];
                                }
                                dots[comptime!((t * per_plane + r) * halves + h)] +=
                                    unit_code(word, high, c, kind, one) * xi;
                            }
                        }
                    }
                }
                #[unroll]
                for t in 0..m {
                    #[unroll]
                    for r in 0..per_plane {
                        let at = comptime!(u * per_plane + r);
                        #[unroll]
                        for h in 0..halves {
                            let g = comptime!(at * halves + h);
                            acc[comptime!(t * per_plane + r)] += ca[g]
                                * dots[comptime!((t * per_plane + r) * halves + h)]
                                - cb[g] * sx[comptime!(t * halves + h)];
                        }
                    }
                }
            }
        }
        v0 += comptime!(unroll * group_units);
    }
    if comptime!(splits > 1) {
        split_reduce_and_store::<F>(&acc, out, place, first, n_out, m, per_plane, plane, pairs, splits);
    } else {
        reduce_and_store::<F>(&acc, out, place, first, n_out, m, per_plane, plane, pairs);
    }
}

/// The device tensors of a k-quant matrix as the kernels take them (`hi` stands in for itself
/// with `lo` where the format has none; the kernels never read it then).
pub struct KPacked<R: CubeRuntime> {
    pub lo: CubeTensor<R>,
    pub hi: Option<CubeTensor<R>>,
    pub meta: CubeTensor<R>,
    pub supers: CubeTensor<R>,
    pub format: KQuantFormat,
}

impl<R: CubeRuntime> KPacked<R> {
    pub(crate) fn hi_arg(&self) -> CubeTensor<R> {
        self.hi.clone().unwrap_or_else(|| self.lo.clone())
    }

    /// `[rows, cols]`.
    pub(crate) fn shape(&self) -> [usize; 2] {
        [self.lo.meta.shape()[0], self.lo.meta.shape()[1] * 8]
    }
}

/// `x`: contiguous `[n, in]` with `n <= GEMV_MAX_ROWS`. Writes `[n, out]` in `x`'s dtype, or for
/// [`Epilogue::GeluPairs`] `gelu_tanh(gate) * up`, `[n, out / 2]`, into columns `offset..` of
/// `out` (`[n, wider]`, contiguous), as [`crate::quant::gemv::gemv_into`].
pub fn gemv_into<R: CubeRuntime>(
    x: CubeTensor<R>,
    w: &KPacked<R>,
    epilogue: Epilogue,
    out: &CubeTensor<R>,
    offset: usize,
) {
    let pairs = epilogue == Epilogue::GeluPairs;
    let n = x.meta.shape()[0];
    let [out_features, cols] = w.shape();
    if n == 0 || out_features == 0 {
        return;
    }
    let vectors = cols / VECTOR;
    // Activations in loads of up to 16 bytes, at most 8 values (a Q6_K scale group is 16).
    let nx = load_vector_size(&x.client, x.dtype.size(), VECTOR, 8);
    let (per_plane, splits) = work_split(&x.client, n, out_features, vectors);
    let unroll = gemv_unroll(per_plane, n);
    let stride = out.meta.shape()[1] as u32;
    let hi = w.hi_arg();
    // Unchecked: rows and vectors are clamped and stores guarded, so every index is in range.
    launch_unchecked!(kgemv_kernel(
        &x.client,
        grid(out_features.div_ceil(ROWS)),
        CubeDim::new_1d((ROWS / per_plane * LANES * splits) as u32),
        4,
        nx,
        arg(&x),
        arg(&w.lo),
        arg(&hi),
        arg(&w.meta),
        arg(&w.supers),
        arg(out),
        OutPlaceLaunch::new(stride, offset as u32),
        vectors as u32,
        out_features as u32,
        ONE_BITS,
        n,
        per_plane,
        unroll,
        w.format.tag(),
        planes_of_32(&x.client),
        pairs,
        splits,
        [x.dtype.into(), w.supers.dtype.into()],
    ));
}
