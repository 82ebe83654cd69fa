//! Prefill flash attention on the matrix units: one pass over the keys, no score matrix in
//! memory.
//!
//! Each cube owns one KV head of one sequence and `16 x planes` consecutive rows of the query
//! rows that share it, ordered position-major (row `r` is position `r / groups`, query head
//! `r % groups` of the group), so a cube covers a narrow band of positions and the causal and
//! sliding-window bounds skip whole key tiles; the group's heads read each K/V tile once
//! (GQA/MQA, repeated heads never materialized). The cube stages its queries once, then for
//! each tile of `bk` keys:
//!
//! 1. stages the tile's keys and values in shared memory as `F`, each unit issuing all of its
//!    loads before storing any (int8 caches are decoded on the way: `code * scale`, as the
//!    other kernels read them); with [`Prefetch::NextTile`] the loads of the next tile are in
//!    flight during this tile's products;
//! 2. each plane multiplies its 16 query rows by the keys on 16 x 16 x 16 cooperative matrices
//!    (f32 accumulators) and stores the scores in its shared scratch;
//! 3. two units per row scale, softcap and mask the scores (absolute positions), keep the row's
//!    running maximum and sum in f32 and write the probabilities as `F`;
//! 4. the plane adds probabilities x values into its output accumulators (registers).
//!
//! The output accumulators are rescaled only when a row's maximum grows by more than
//! [`STALE_MAX`] (e^8): below that the old maximum stays the reference, probabilities reach
//! at most e^8 (far inside `F`'s range) and the result is the same up to rounding, so the
//! rescale (a round trip of the accumulators through shared memory, which cooperative
//! matrices need for per-row factors) happens a few times per row instead of once per tile.
//!
//! Head sizes up to 256 are one launch; larger ones (Gemma 4's 512) split the value columns
//! over the grid's z axis, each cube recomputing the scores.
//!
//! How many planes a cube has and how many keys a tile holds is a [`FlashLayout`], measured per
//! head size ([`DEFAULT_LAYOUTS`]).
//!
//! Only on CUDA, in f16/bf16, where the device has 16 x 16 x 16 cooperative matrices for `F`
//! with an f32 accumulator ([`tiling`]): Vulkan and HIP report cooperative matrices too, but
//! nothing here has checked the kernel there (they keep the blocked and tiled kernels).

// Kernel code cannot call `usize::div_ceil` (not a CubeCL intrinsic).
#![allow(clippy::manual_div_ceil)]

pub use super::choice::{FlashLayout, Prefetch, DEFAULT_LAYOUTS};
use super::kernel::{int8_code, shape_arg, visible_tiles, AttentionShape, Kv, ShapeSizes};
use super::AttentionOptions;
use crate::cube::{tanh_f32, Strides4};
use crate::graph::{arg, launch};
use crate::quant::mma::{accumulators, load_fragment};
use burn_cubecl::{tensor::CubeTensor, CubeRuntime};
use cubecl::ir::StorageType;
use cubecl::prelude::*;

/// Side of the cooperative-matrix tiles.
const TILE: usize = 16;

/// Values of `F` (16-bit) per 16-byte vector.
const VEC: usize = 8;

/// Extra `F` per shared row of queries, keys, values and probabilities (16 bytes), so that the
/// 16 rows a fragment load reads start on different banks.
const PAD: usize = 8;

/// Extra f32 per row of the score scratch.
const S_PAD: usize = 4;

/// Growth of a row's maximum (natural log) below which the old maximum stays the reference.
const STALE_MAX: f32 = 8.0;

/// Fewest query positions the default choice gives this kernel: below that the tiled kernel,
/// which also splits the keys over cubes, keeps more of the device busy.
pub const MIN_QUERIES: usize = 16;

/// Largest head size: the value columns of a cube are at most [`MAX_DV`], larger heads split
/// them over cubes.
pub const MAX_DIM: usize = 512;

/// Most value columns per cube (its output accumulators: `MAX_DV / 16` fragments per plane).
const MAX_DV: usize = 256;

/// Comptime launch configuration.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct FlashTiling {
    /// Planes (32 units) per cube, 16 query rows each.
    pub planes: usize,
    /// Keys per tile (a multiple of 32).
    pub bk: usize,
    pub prefetch: Prefetch,
    /// Head size.
    pub dim: usize,
    /// Value columns per cube (`dim`, or half of it above `MAX_DV`).
    pub dv: usize,
}

impl FlashTiling {
    /// Query rows per cube.
    pub fn bq(&self) -> usize {
        self.planes * TILE
    }

    /// Shared memory a cube takes, in bytes.
    pub fn shared_bytes(&self) -> usize {
        let half = 2;
        let q = self.bq() * (self.dim + PAD) * half;
        let k = self.bk * (self.dim + PAD) * half;
        let v = self.bk * (self.dv + PAD) * half;
        let s = self.bq() * (self.bk + S_PAD) * 4;
        let p = self.bq() * (self.bk + PAD) * half;
        q + k + v + s + p + self.bq() * 4
    }

    /// The tiling for heads of `dim` with `layout`, where the kernel takes it (`dim` a multiple
    /// of 16 up to `MAX_DIM`, value columns a multiple of the keys per tile).
    pub fn new(dim: usize, layout: FlashLayout) -> Option<Self> {
        let FlashLayout { planes, bk, prefetch } = layout;
        let dv = if dim <= MAX_DV { dim } else { dim / 2 };
        let fits = dim.is_multiple_of(TILE)
            && dim <= MAX_DIM
            && dv.is_multiple_of(TILE)
            && bk.is_multiple_of(32)
            && bk > 0
            && dv.is_multiple_of(bk)
            && (1..=8).contains(&planes);
        fits.then_some(FlashTiling { planes, bk, prefetch, dim, dv })
    }

    /// The tiling the kernel uses for heads of `dim` under `shared` bytes of shared memory per
    /// cube: the layout of the [`crate::KernelTuning`] in effect where it fits, else the first of
    /// `DEFAULT_LAYOUTS` that fits.
    pub fn choose(dim: usize, shared: usize) -> Option<Self> {
        let fits = |t: &Self| t.shared_bytes() <= shared;
        let chosen = crate::tuning::current(|t| t.flash_layout).and_then(|l| Self::new(dim, l)).filter(fits);
        let defaults = || DEFAULT_LAYOUTS.iter().filter_map(|&l| Self::new(dim, l));
        chosen.or_else(|| defaults().filter(Self::suits_head).find(fits)).or_else(|| defaults().find(fits))
    }
}

impl FlashTiling {
    /// Whether the layout suits the head size: heads above 256 take 32-key tiles (on the H200,
    /// 8 planes x 64 keys gave 40 TFLOP/s on Gemma 4's 512-wide heads, 8 x 32 prefetching 64).
    fn suits_head(&self) -> bool {
        self.dim <= MAX_DV || self.bk == 32
    }
}

/// `out[b, h, i, :]` (contiguous `[batch, q_heads, q_len, dim]`, vectors of 8) for the cube's
/// rows, value columns `[z * dv, (z + 1) * dv)`.
#[allow(clippy::too_many_arguments)]
#[cube(launch)]
fn flash_kernel<F: Float, N: Size, W: Size>(
    q: &Array<Vector<F, N>>,
    k: &Array<Vector<F, N>>,
    v: &Array<Vector<F, N>>,
    out: &mut Array<Vector<F, N>>,
    k_codes: &Array<Vector<u32, W>>,
    k_scales: &Array<f32>,
    v_codes: &Array<Vector<u32, W>>,
    v_scales: &Array<f32>,
    q_strides: Strides4,
    k_strides: Strides4,
    v_strides: Strides4,
    shape: AttentionShape,
    kv_len: u32,
    q_offset: u32,
    k_offset: u32,
    window: u32,
    scale: f32,
    cap: f32,
    #[comptime] tiling: FlashTiling,
    #[comptime] has_window: bool,
    #[comptime] has_cap: bool,
    #[comptime] int8: bool,
    #[define(F)] _dtype: StorageType,
) {
    let bk = comptime!(tiling.bk);
    let dv = comptime!(tiling.dv);
    let bq = comptime!(tiling.planes * TILE);
    let units = comptime!(tiling.planes * 32);
    // Shared row pitches: queries and keys, values, probabilities in vectors of 8; scores in f32.
    let qp = comptime!((tiling.dim + PAD) / VEC);
    let vp = comptime!((tiling.dv + PAD) / VEC);
    let pp = comptime!((tiling.bk + PAD) / VEC);
    let sp = comptime!(tiling.bk + S_PAD);

    let mut q_s = SharedMemory::<Vector<F, N>>::new_aligned(comptime!(bq * qp), 32usize);
    let mut k_s = SharedMemory::<Vector<F, N>>::new_aligned(comptime!(bk * qp), 32usize);
    let mut v_s = SharedMemory::<Vector<F, N>>::new_aligned(comptime!(bk * vp), 32usize);
    let mut p_s = SharedMemory::<Vector<F, N>>::new_aligned(comptime!(bq * pp), 32usize);
    let mut s_s = SharedMemory::<f32>::new_aligned(comptime!(bq * sp), 32usize);
    let mut row_factor = SharedMemory::<f32>::new(bq);

    let unit = UNIT_POS_X as usize;
    let plane = unit / 32;
    let lane = unit % 32;
    let q_heads = shape.q_heads;
    let q_len = shape.q_len;
    let kv_heads = shape.kv_heads;
    let k_len = kv_len as usize;
    let groups = q_heads / kv_heads;
    let rows = groups * q_len;
    let b = CUBE_POS_Y as usize / kv_heads;
    let kvh = CUBE_POS_Y as usize % kv_heads;
    let c0 = CUBE_POS_Z as usize * dv;
    let r0 = CUBE_POS_X as usize * bq;
    let r_last = min(r0 + bq, rows) - 1;

    // The cube's queries, zeros past the last row: all of a unit's loads issued, then stored.
    let q_vecs = comptime!(tiling.dim / VEC);
    let nq = comptime!(tiling.dim / 16);
    let mut q_regs = Array::<Vector<F, N>>::new(nq);
    #[unroll]
    for j in 0..nq {
        let i = unit + comptime!(j * units);
        let r = r0 + i / q_vecs;
        q_regs[j] = Vector::<F, N>::new(F::from_int(0));
        if r < rows {
            q_regs[j] = q[q_strides.at(b, kvh * groups + r % groups, r / groups, 0) / VEC + i % q_vecs];
        }
    }
    #[unroll]
    for j in 0..nq {
        let i = unit + comptime!(j * units);
        q_s[(i / q_vecs) * qp + i % q_vecs] = q_regs[j];
    }

    // Tiles of keys visible from the cube's positions.
    let tiles = visible_tiles(r0 / groups, r_last / groups, k_len, q_offset, k_offset, window, has_window, bk);
    let (t_lo, t_hi) = (tiles.lo, tiles.hi);

    // This unit's row of the softmax (two units per row, each half of the tile's keys).
    let my_row = lane / 2;
    let half = lane % 2;
    let r = r0 + plane * TILE + my_row;
    let q_pos = q_offset as usize + r / groups;
    let mut m = f32::new(-1.0e30);
    let mut l = 0.0f32;

    let o_acc = accumulators(comptime!(tiling.dv / TILE));
    let s_acc = accumulators(comptime!(tiling.bk / TILE));
    let s_at = plane * comptime!(TILE * sp);
    let p_at = plane * comptime!(TILE * pp);
    let q_at = plane * comptime!(TILE * qp);

    // Registers of one tile's keys and values between their loads and their shared stores.
    let (_, nk) = comptime!(vectors(tiling.bk, tiling.dim, units, int8));
    let (_, nv) = comptime!(vectors(tiling.bk, tiling.dv, units, int8));
    let (dense_k, dense_v, int8_k, int8_v) = comptime!(if int8 { (1, 1, nk, nv) } else { (nk, nv, 1, 1) });
    let mut regs = Staged::<F, N, W> {
        k: Array::new(dense_k),
        v: Array::new(dense_v),
        k_codes: Array::new(int8_k),
        v_codes: Array::new(int8_v),
        k_scales: Array::new(int8_k),
        v_scales: Array::new(int8_v),
    };
    let prefetch = comptime!(tiling.prefetch == Prefetch::NextTile);
    if prefetch && t_lo < t_hi {
        let at = KvAt { b, kvh, key0: t_lo * bk, k_len, slots: shape.slots, kv_heads, c0 };
        load_tile::<F, N, W>(
            k, v, k_codes, k_scales, v_codes, v_scales, &k_strides, &v_strides, &mut regs, at, tiling, int8,
        );
    }

    for tile in t_lo..t_hi {
        let key0 = tile * bk;
        if !prefetch {
            let at = KvAt { b, kvh, key0, k_len, slots: shape.slots, kv_heads, c0 };
            load_tile::<F, N, W>(
                k, v, k_codes, k_scales, v_codes, v_scales, &k_strides, &v_strides, &mut regs, at, tiling, int8,
            );
        }
        // Every plane is done with the last tile's keys and values.
        sync_cube();
        store_rows::<F, N, W>(&regs.k, &regs.k_codes, &regs.k_scales, &mut k_s, tiling.dim, qp, units, tiling.bk, int8);
        store_rows::<F, N, W>(&regs.v, &regs.v_codes, &regs.v_scales, &mut v_s, tiling.dv, vp, units, tiling.bk, int8);
        sync_cube();
        if prefetch && tile + 1 < t_hi {
            // The next tile's loads are in flight while this one is multiplied.
            let at = KvAt { b, kvh, key0: key0 + bk, k_len, slots: shape.slots, kv_heads, c0 };
            load_tile::<F, N, W>(
                k, v, k_codes, k_scales, v_codes, v_scales, &k_strides, &v_strides, &mut regs, at, tiling, int8,
            );
        }

        // Scores of the plane's 16 rows against the tile's keys.
        #[unroll]
        for t in 0..comptime!(tiling.bk / TILE) {
            cmma::fill(s_acc.index(t), 0.0f32);
        }
        #[unroll]
        for kk in 0..comptime!(tiling.dim / TILE) {
            let a = load_fragment::<F, N>(
                &q_s,
                q_at + comptime!(kk * TILE / VEC),
                cmma::MatrixIdent::A,
                cmma::MatrixLayout::RowMajor,
                qp,
            );
            #[unroll]
            for t in 0..comptime!(tiling.bk / TILE) {
                // Keys are rows of `k_s`: as B (`dim x keys`) they are column-major.
                let kb = load_fragment::<F, N>(
                    &k_s,
                    comptime!(t * TILE * qp + kk * TILE / VEC),
                    cmma::MatrixIdent::B,
                    cmma::MatrixLayout::ColMajor,
                    qp,
                );
                let acc = s_acc.index(t);
                cmma::execute::<F, F, f32, f32>(&a, &kb, acc, acc);
            }
        }
        #[unroll]
        for t in 0..comptime!(tiling.bk / TILE) {
            let start = s_at + comptime!(t * TILE);
            cmma::store(
                &mut s_s.slice_mut(start, start + comptime!((TILE - 1) * sp + TILE)),
                s_acc.index(t),
                sp as u32,
                cmma::MatrixLayout::RowMajor,
            );
        }
        sync_plane();

        // Online softmax: this unit's half of its row.
        let keys_half = comptime!(tiling.bk / 2);
        let row_at = s_at + my_row * sp + half * keys_half;
        let mut tile_max = f32::new(-3.0e38);
        #[unroll]
        for jj in 0..keys_half {
            let key = key0 + half * keys_half + jj;
            let s = masked_score(
                s_s[row_at + jj],
                r < rows,
                key,
                k_len,
                q_pos,
                k_offset as usize,
                window as usize,
                scale,
                cap,
                has_window,
                has_cap,
            );
            s_s[row_at + jj] = s;
            tile_max = max(tile_max, s);
        }
        tile_max = max(tile_max, plane_shuffle_xor(tile_max, 1u32));
        let mut factor = 1.0f32;
        if tile_max > m + f32::new(STALE_MAX) {
            factor = f32::exp(m - tile_max);
            m = tile_max;
        }
        l *= factor;
        #[unroll]
        for vv in 0..comptime!(tiling.bk / 2 / VEC) {
            let mut p = Vector::<F, N>::empty();
            #[unroll]
            for e in 0..VEC {
                let s = s_s[row_at + comptime!(vv * VEC + e)];
                let mut x = F::from_int(0);
                if s > -1.0e38f32 {
                    x = F::cast_from(f32::exp(s - m));
                }
                l += f32::cast_from(x);
                p[e] = x;
            }
            p_s[p_at + my_row * pp + half * comptime!(tiling.bk / 2 / VEC) + vv] = p;
        }
        if half == 0 {
            row_factor[plane * TILE + my_row] = factor;
        }
        let rescale = plane_any(factor != 1.0f32);
        sync_plane();
        if rescale {
            rescale_rows(&o_acc, &mut s_s, &row_factor, s_at, plane * TILE, lane, tiling);
        }

        // Probabilities x values into the plane's output accumulators.
        #[unroll]
        for kk in 0..comptime!(tiling.bk / TILE) {
            let a = load_fragment::<F, N>(
                &p_s,
                p_at + comptime!(kk * TILE / VEC),
                cmma::MatrixIdent::A,
                cmma::MatrixLayout::RowMajor,
                pp,
            );
            #[unroll]
            for t in 0..comptime!(tiling.dv / TILE) {
                let vb = load_fragment::<F, N>(
                    &v_s,
                    comptime!(kk * TILE * vp + t * TILE / VEC),
                    cmma::MatrixIdent::B,
                    cmma::MatrixLayout::RowMajor,
                    vp,
                );
                let acc = o_acc.index(t);
                cmma::execute::<F, F, f32, f32>(&a, &vb, acc, acc);
            }
        }
    }

    // Each row's sum over both halves; rows that saw no key get zeros.
    l += plane_shuffle_xor(l, 1u32);
    if half == 0 {
        let mut inv = 0.0f32;
        if l > 0.0f32 {
            inv = 1.0f32 / l;
        }
        row_factor[plane * TILE + my_row] = inv;
    }
    sync_plane();
    write_rows::<F, N>(
        &o_acc,
        &mut s_s,
        &row_factor,
        out,
        s_at,
        r0 + plane * TILE,
        plane * TILE,
        lane,
        b,
        kvh,
        c0,
        shape,
        tiling,
    );
}

/// One tile's keys and values in a unit's registers, as loaded (dense vectors, or int8 code
/// vectors with their slots' scales), before they are written to shared memory.
#[derive(CubeType)]
struct Staged<F: Float, N: Size, W: Size> {
    k: Array<Vector<F, N>>,
    v: Array<Vector<F, N>>,
    k_codes: Array<Vector<u32, W>>,
    v_codes: Array<Vector<u32, W>>,
    k_scales: Array<f32>,
    v_scales: Array<f32>,
}

/// Vectors (of 8 values, or of 16 int8 codes) in `bk` rows of `cols` columns, and how many of
/// them each of `units` units moves.
fn vectors(bk: usize, cols: usize, units: usize, int8: bool) -> (usize, usize) {
    let total = bk * cols / if int8 { 16 } else { VEC };
    (total, total.div_ceil(units))
}

/// This unit's share of `bk` rows of keys or values (`cols` columns from `c0`) from key `key0`
/// into registers, all loads issued before any is used: vector `i = unit + j * units` is
/// vector `i % per_row` of row `i / per_row`; rows past `k_len` are zeros (int8: scale 0).
#[allow(clippy::too_many_arguments)]
#[cube]
fn load_rows<F: Float, N: Size, W: Size>(
    dense: &Array<Vector<F, N>>,
    codes: &Array<Vector<u32, W>>,
    scales: &Array<f32>,
    strides: &Strides4,
    regs: &mut Array<Vector<F, N>>,
    code_regs: &mut Array<Vector<u32, W>>,
    scale_regs: &mut Array<f32>,
    at: KvAt,
    #[comptime] dim: usize,
    #[comptime] cols: usize,
    #[comptime] units: usize,
    #[comptime] bk: usize,
    #[comptime] int8: bool,
) {
    let unit = UNIT_POS_X as usize;
    let (total, n) = comptime!(vectors(bk, cols, units, int8));
    if int8 {
        let per_row = comptime!(cols / 16);
        let head = (at.b * at.kv_heads + at.kvh) * at.slots;
        #[unroll]
        for j in 0..n {
            let i = unit + comptime!(j * units);
            let key = at.key0 + i / per_row;
            code_regs[j] = Vector::<u32, W>::new(0u32);
            scale_regs[j] = 0.0f32;
            if i < total && key < at.k_len {
                let slot = head + key;
                code_regs[j] = codes[slot * comptime!(dim / 16) + at.c0 / 16 + i % per_row];
                scale_regs[j] = scales[slot];
            }
        }
    } else {
        let per_row = comptime!(cols / VEC);
        let base = strides.at(at.b, at.kvh, 0, 0) + at.c0;
        #[unroll]
        for j in 0..n {
            let i = unit + comptime!(j * units);
            let key = at.key0 + i / per_row;
            regs[j] = Vector::<F, N>::new(F::from_int(0));
            if i < total && key < at.k_len {
                regs[j] = dense[(base + key * strides.s) / VEC + i % per_row];
            }
        }
    }
}

/// Writes what [`load_rows`] loaded into `into` (rows `pitch` vectors apart), int8 codes
/// decoded as the other kernels decode them (`code * scale`, rounded to `F`).
#[allow(clippy::too_many_arguments)]
#[cube]
fn store_rows<F: Float, N: Size, W: Size>(
    regs: &Array<Vector<F, N>>,
    code_regs: &Array<Vector<u32, W>>,
    scale_regs: &Array<f32>,
    into: &mut SharedMemory<Vector<F, N>>,
    #[comptime] cols: usize,
    #[comptime] pitch: usize,
    #[comptime] units: usize,
    #[comptime] bk: usize,
    #[comptime] int8: bool,
) {
    let unit = UNIT_POS_X as usize;
    let (total, n) = comptime!(vectors(bk, cols, units, int8));
    if int8 {
        let per_row = comptime!(cols / 16);
        #[unroll]
        for j in 0..n {
            let i = unit + comptime!(j * units);
            if i < total {
                let words = code_regs[j];
                let s = scale_regs[j];
                let mut lo = Vector::<F, N>::empty();
                let mut hi = Vector::<F, N>::empty();
                #[unroll]
                for e in 0..VEC {
                    lo[e] = F::cast_from(int8_code(words[comptime!(e / 4)], comptime!(e % 4)) * s);
                    hi[e] = F::cast_from(int8_code(words[comptime!((e + VEC) / 4)], comptime!(e % 4)) * s);
                }
                let at = (i / per_row) * pitch + (i % per_row) * 2;
                into[at] = lo;
                into[at + 1] = hi;
            }
        }
    } else {
        let per_row = comptime!(cols / VEC);
        #[unroll]
        for j in 0..n {
            let i = unit + comptime!(j * units);
            if i < total {
                into[(i / per_row) * pitch + i % per_row] = regs[j];
            }
        }
    }
}

/// Where a tile's rows are: sequence, KV head, first key, keys attended, slots per head (int8),
/// KV heads, first value column.
#[derive(CubeType, Clone, Copy)]
struct KvAt {
    b: usize,
    kvh: usize,
    key0: usize,
    k_len: usize,
    slots: usize,
    kv_heads: usize,
    c0: usize,
}

/// Loads tile `key0`'s keys (every column) and values (the cube's `dv` from `c0`) into `regs`.
#[allow(clippy::too_many_arguments)]
#[cube]
fn load_tile<F: Float, N: Size, W: Size>(
    k: &Array<Vector<F, N>>,
    v: &Array<Vector<F, N>>,
    k_codes: &Array<Vector<u32, W>>,
    k_scales: &Array<f32>,
    v_codes: &Array<Vector<u32, W>>,
    v_scales: &Array<f32>,
    k_strides: &Strides4,
    v_strides: &Strides4,
    regs: &mut Staged<F, N, W>,
    at: KvAt,
    #[comptime] tiling: FlashTiling,
    #[comptime] int8: bool,
) {
    let units = comptime!(tiling.planes * 32);
    let keys =
        KvAt { b: at.b, kvh: at.kvh, key0: at.key0, k_len: at.k_len, slots: at.slots, kv_heads: at.kv_heads, c0: 0 };
    load_rows::<F, N, W>(
        k,
        k_codes,
        k_scales,
        k_strides,
        &mut regs.k,
        &mut regs.k_codes,
        &mut regs.k_scales,
        keys,
        tiling.dim,
        tiling.dim,
        units,
        tiling.bk,
        int8,
    );
    load_rows::<F, N, W>(
        v,
        v_codes,
        v_scales,
        v_strides,
        &mut regs.v,
        &mut regs.v_codes,
        &mut regs.v_scales,
        at,
        tiling.dim,
        tiling.dv,
        units,
        tiling.bk,
        int8,
    );
}

/// A raw score of query position `q_pos` (row in range: `row_ok`) and key `key` scaled and
/// softcapped, or -3e38 where the key is hidden (past `k_len`, in the future, before the
/// window).
#[allow(clippy::too_many_arguments)]
#[cube]
fn masked_score(
    raw: f32,
    row_ok: bool,
    key: usize,
    k_len: usize,
    q_pos: usize,
    k_offset: usize,
    window: usize,
    scale: f32,
    cap: f32,
    #[comptime] has_window: bool,
    #[comptime] has_cap: bool,
) -> f32 {
    let k_pos = k_offset + key;
    let mut visible = row_ok && key < k_len && k_pos <= q_pos;
    if has_window {
        visible = visible && q_pos - k_pos < window;
    }
    let mut s = f32::new(-3.0e38);
    if visible {
        s = raw * scale;
        if has_cap {
            s = tanh_f32(s / cap) * cap;
        }
    }
    s
}

/// Stores output fragments `chunk * bk / 16 ..` (columns `chunk * bk ..` of the plane's 16
/// rows) into the plane's score scratch (rows `bk + S_PAD` apart), then syncs the plane.
#[cube]
fn store_chunk(
    o_acc: &Sequence<cmma::Matrix<f32>>,
    s_s: &mut SharedMemory<f32>,
    s_at: usize,
    #[comptime] chunk: usize,
    #[comptime] tiling: FlashTiling,
) {
    let sp = comptime!(tiling.bk + S_PAD);
    let per_chunk = comptime!(tiling.bk / TILE);
    #[unroll]
    for t in 0..per_chunk {
        let start = s_at + comptime!(t * TILE);
        cmma::store(
            &mut s_s.slice_mut(start, start + comptime!((TILE - 1) * sp + TILE)),
            o_acc.index(comptime!(chunk * per_chunk + t)),
            sp as u32,
            cmma::MatrixLayout::RowMajor,
        );
    }
    sync_plane();
}

/// Multiplies row `i` of the plane's output accumulators by `factor[row0 + i]`, through the
/// plane's score scratch (`bk` columns, `bk / 16` fragments at a time).
#[cube]
fn rescale_rows(
    o_acc: &Sequence<cmma::Matrix<f32>>,
    s_s: &mut SharedMemory<f32>,
    factor: &SharedMemory<f32>,
    s_at: usize,
    row0: usize,
    lane: usize,
    #[comptime] tiling: FlashTiling,
) {
    let sp = comptime!(tiling.bk + S_PAD);
    let per_chunk = comptime!(tiling.bk / TILE);
    #[unroll]
    for chunk in 0..comptime!(tiling.dv / tiling.bk) {
        store_chunk(o_acc, s_s, s_at, chunk, tiling);
        let mut e = lane;
        while e < comptime!(TILE * tiling.bk) {
            let row = e / comptime!(tiling.bk);
            let at = s_at + row * sp + e % comptime!(tiling.bk);
            s_s[at] = s_s[at] * factor[row0 + row];
            e += 32;
        }
        sync_plane();
        #[unroll]
        for t in 0..per_chunk {
            let start = s_at + comptime!(t * TILE);
            cmma::load_with_layout(
                o_acc.index(comptime!(chunk * per_chunk + t)),
                &s_s.slice(start, start + comptime!((TILE - 1) * sp + TILE)),
                sp as u32,
                cmma::MatrixLayout::RowMajor,
            );
        }
        sync_plane();
    }
}

/// Writes the plane's 16 rows (cube rows from `r0`) of the output accumulators times
/// `factor[row0 + i]` to `out` as `F`, through the plane's score scratch.
#[allow(clippy::too_many_arguments)]
#[cube]
fn write_rows<F: Float, N: Size>(
    o_acc: &Sequence<cmma::Matrix<f32>>,
    s_s: &mut SharedMemory<f32>,
    factor: &SharedMemory<f32>,
    out: &mut Array<Vector<F, N>>,
    s_at: usize,
    r0: usize,
    row0: usize,
    lane: usize,
    b: usize,
    kvh: usize,
    c0: usize,
    shape: AttentionShape,
    #[comptime] tiling: FlashTiling,
) {
    let sp = comptime!(tiling.bk + S_PAD);
    let chunk_vecs = comptime!(tiling.bk / VEC);
    let groups = shape.q_heads / shape.kv_heads;
    let rows = groups * shape.q_len;
    #[unroll]
    for chunk in 0..comptime!(tiling.dv / tiling.bk) {
        store_chunk(o_acc, s_s, s_at, chunk, tiling);
        let mut e = lane;
        while e < comptime!(TILE * tiling.bk / VEC) {
            let row = e / chunk_vecs;
            let cv = e % chunk_vecs;
            let r = r0 + row;
            if r < rows {
                let f = factor[row0 + row];
                let mut value = Vector::<F, N>::empty();
                #[unroll]
                for x in 0..VEC {
                    value[x] = F::cast_from(s_s[s_at + row * sp + cv * VEC + x] * f);
                }
                let h = kvh * groups + r % groups;
                let o = ((b * shape.q_heads + h) * shape.q_len + r / groups) * comptime!(tiling.dim)
                    + c0
                    + comptime!(chunk * tiling.bk);
                out[o / VEC + cv] = value;
            }
            e += 32;
        }
        sync_plane();
    }
}

/// Whether a tensor's rows can be read as vectors of [`VEC`]: the head dimension contiguous,
/// every other stride a multiple of 8 and the buffer 16-byte aligned.
fn vector_rows<R: CubeRuntime>(t: &CubeTensor<R>) -> bool {
    let s = t.meta.strides();
    s[3] == 1 && s[..3].iter().all(|x| x.is_multiple_of(VEC)) && t.handle.offset_start.unwrap_or(0).is_multiple_of(16)
}

/// The head size heads of `dim` are padded to (with zeros) so that the flash kernel takes
/// them, where it does not take `dim` itself but takes the next multiple of 32 (SigLIP's heads
/// of 72: 96): `None` where the kernel takes `dim`, or takes neither, or `q` is not on CUDA in
/// f16/bf16.
pub(crate) fn padded_dim<R: CubeRuntime>(q: &CubeTensor<R>) -> Option<usize> {
    let dim = q.meta.shape()[3];
    if !crate::cube::cuda_runtime::<R>() || !crate::cube::cmma_16(&q.client, q.dtype) {
        return None;
    }
    let shared = q.client.properties().hardware.max_shared_memory_size;
    let padded = dim.next_multiple_of(32);
    let takes = |d: usize| FlashTiling::choose(d, shared).is_some();
    (!takes(dim) && takes(padded)).then_some(padded)
}

/// The tiling [`attention`] runs `q` over `kv` with, where the kernel takes them: the CUDA
/// runtime, f16/bf16 with 16 x 16 x 16 cooperative matrices accumulating in f32, heads of a
/// multiple of 16 up to [`MAX_DIM`] (of 32 above 256), queries and dense keys and values read
/// as vectors (head dimension contiguous, other strides multiples of 8), int8 codes in rows of
/// whole vectors of 16.
pub(crate) fn tiling<R: CubeRuntime>(q: &CubeTensor<R>, kv: &Kv<R>) -> Option<FlashTiling> {
    let dim = q.meta.shape()[3];
    if !crate::cube::cuda_runtime::<R>() || !crate::cube::cmma_16(&q.client, q.dtype) || !vector_rows(q) {
        return None;
    }
    let kv_ok = match kv {
        Kv::Dense { k, v } => k.dtype == q.dtype && v.dtype == q.dtype && vector_rows(k) && vector_rows(v),
        Kv::Int8 { k_codes, v_codes, .. } => {
            dim.is_multiple_of(16)
                && [k_codes, v_codes]
                    .iter()
                    .all(|c| c.is_contiguous() && c.handle.offset_start.unwrap_or(0).is_multiple_of(16))
        }
    };
    if !kv_ok {
        return None;
    }
    FlashTiling::choose(dim, q.client.properties().hardware.max_shared_memory_size)
}

/// Launches [`flash_kernel`] with `tiling` (from [`tiling`]) into `out` (contiguous `[batch,
/// q_heads, q_len, dim]`).
pub(super) fn attention<R: CubeRuntime>(
    q: &CubeTensor<R>,
    kv: Kv<R>,
    out: &CubeTensor<R>,
    options: &AttentionOptions,
    tiling: FlashTiling,
) {
    let AttentionOptions { mask, scale, softcap } = *options;
    let [batch, q_heads, q_len, _] = [q.meta.shape()[0], q.meta.shape()[1], q.meta.shape()[2], q.meta.shape()[3]];
    let (kv_heads, k_len, slots) = kv.sizes();
    let rows = (q_heads / kv_heads) * q_len;
    let int8 = matches!(kv, Kv::Int8 { .. });
    let [k, v, k_codes, k_scales, v_codes, v_scales] = kv.args(q);
    // Dense keys and values bring their strides (int8 codes are contiguous rows, the strides
    // of the stand-ins are not read).
    let shape = ShapeSizes { batch, q_heads, q_len, kv_heads, slots };
    launch!(flash_kernel(
        &q.client,
        CubeCount::Static(
            rows.div_ceil(tiling.bq()) as u32,
            (batch * kv_heads) as u32,
            (tiling.dim / tiling.dv) as u32
        ),
        CubeDim::new_1d((tiling.planes * 32) as u32),
        VEC,
        4,
        arg(q),
        arg(&k),
        arg(&v),
        arg(out),
        arg(&k_codes),
        arg(&k_scales),
        arg(&v_codes),
        arg(&v_scales),
        Strides4::launch(q),
        Strides4::launch(&k),
        Strides4::launch(&v),
        shape_arg(shape),
        k_len as u32,
        mask.q_offset as u32,
        mask.k_offset as u32,
        mask.window.unwrap_or(0) as u32,
        scale as f32,
        softcap.unwrap_or(1.0) as f32,
        tiling,
        mask.window.is_some(),
        softcap.is_some(),
        int8,
        q.dtype.into(),
    ));
}

#[cfg(all(test, feature = "cuda"))]
mod tests {
    use super::{attention, tiling, FlashLayout, FlashTiling, Kv, Prefetch};
    use crate::attention::{naive, AttentionMask, AttentionOptions};
    use crate::cube::{empty, float, float_strided, int, tensor};
    use crate::gpu_test::{assert_close, seed, tolerance};
    use crate::{GemmaBackend, KvFormat, KvStore};
    use burn::backend::Cuda;
    use burn::tensor::{DType, Distribution, Tensor, TensorData};
    use cubecl::cuda::CudaRuntime;

    /// `(batch, q_heads, kv_heads, q_len, k_len, dim, q_offset, k_offset, window, softcap)`.
    type Case = (usize, usize, usize, usize, usize, usize, usize, usize, Option<usize>, Option<f64>);

    const CASES: [Case; 9] = [
        // Gemma 3 270M heads (four query heads on one KV head), odd length: one partial cube.
        (1, 4, 1, 37, 37, 256, 0, 0, None, None),
        // Gemma 2 softcap, batch 2, 4B's grouping, several cubes and key tiles.
        (2, 8, 4, 70, 70, 256, 0, 0, None, Some(50.0)),
        // A sliding window far shorter than the prompt: whole tiles skipped on both sides.
        (1, 8, 4, 300, 300, 256, 0, 0, Some(100), None),
        // Gemma 4's full layers: head size 512 (value columns split over two cubes), MQA.
        (1, 8, 1, 45, 45, 512, 0, 0, None, None),
        // A chunk continuing a cache, head size 128.
        (1, 4, 2, 33, 120, 128, 87, 0, None, None),
        // Keys starting past position 0 (a ring's window), a window, head size 64.
        (1, 2, 2, 130, 200, 64, 150, 80, Some(70), None),
        // Head size 96 (32 keys per tile), 3 query heads per KV head.
        (1, 6, 2, 19, 19, 96, 0, 0, None, Some(30.0)),
        // A 16-query chunk (one cube row of positions for MQA), a window and softcap.
        (2, 4, 1, 16, 600, 256, 584, 0, Some(512), Some(50.0)),
        // Long enough that a row's maximum grows past the stale bound more than once.
        (1, 2, 1, 1030, 1030, 128, 0, 0, None, None),
    ];

    /// Layouts tried besides the default (bf16 only: f16 runs the default): four and eight
    /// planes, 32 and 64 keys, both prefetches.
    const LAYOUTS: [FlashLayout; 3] = [
        FlashLayout { planes: 8, bk: 64, prefetch: Prefetch::None },
        FlashLayout { planes: 8, bk: 32, prefetch: Prefetch::NextTile },
        FlashLayout { planes: 4, bk: 32, prefetch: Prefetch::None },
    ];

    fn host(t: Tensor<Cuda, 4>) -> Vec<f32> {
        t.cast(DType::F32).into_data().to_vec::<f32>().expect("f32")
    }

    /// The kernel on dense (strided, as projections come) and int8 keys and values, against
    /// f64 attention on the same rounded (or decoded) values. The scores are scaled up (2 /
    /// sqrt(dim)) so that rows' maxima move.
    fn matches_reference(dtype: DType) {
        let device = Default::default();
        seed::<Cuda>(&device, "flash attention");
        let normal = Distribution::Normal(0.0, 1.0);
        for (batch, hq, hkv, tq, tk, dim, q_offset, k_offset, window, softcap) in CASES {
            let q = Tensor::<Cuda, 4>::random([batch, tq, hq, dim], normal, &device).cast(dtype).swap_dims(1, 2);
            let k = Tensor::<Cuda, 4>::random([batch, tk, hkv, dim], normal, &device).cast(dtype).swap_dims(1, 2);
            let v = Tensor::<Cuda, 4>::random([batch, hkv, tk, dim], normal, &device).cast(dtype);
            let mask = AttentionMask { q_offset, k_offset, window };
            let options = AttentionOptions { mask, scale: 2.0 / (dim as f64).sqrt(), softcap };
            let int8 = <Cuda as GemmaBackend>::kv_write(
                <Cuda as GemmaBackend>::kv_zeros([batch, hkv, tk, dim], KvFormat::Int8, &device),
                k.clone(),
                v.clone(),
                0,
            );
            let (k8, v8) = <Cuda as GemmaBackend>::kv_read(&int8, 0..tk, DType::F32);
            let KvStore::Int8 { keys, values } = int8 else { unreachable!("an int8 store") };
            let inputs = [
                ("dense", Kv::Dense { k: float_strided(k.clone()), v: float_strided(v.clone()) }, k, v),
                (
                    "int8",
                    Kv::Int8 {
                        k_codes: int(keys.codes),
                        k_scales: float(keys.scales),
                        v_codes: int(values.codes),
                        v_scales: float(values.scales),
                        len: tk,
                    },
                    k8,
                    v8,
                ),
            ];
            for (format, kv, k, v) in inputs {
                let qc = float_strided(q.clone());
                let chosen: FlashTiling = tiling(&qc, &kv).expect("the H200 runs flash attention on these shapes");
                let expected = naive(&host(q.clone()), &host(k), &host(v), [batch, hq, hkv, tq, tk, dim], &options);
                let expected = Tensor::<Cuda, 4>::from_data(
                    TensorData::new(expected, [batch, hq, tq, dim]),
                    (&device, DType::F32),
                );
                // The default and every other layout that fits the head size.
                let shared = qc.client.properties().hardware.max_shared_memory_size;
                let others = LAYOUTS
                    .iter()
                    .filter_map(|&l| FlashTiling::new(dim, l))
                    .filter(|t| t.shared_bytes() <= shared && *t != chosen && dtype == DType::BF16);
                for t in std::iter::once(chosen).chain(others) {
                    let out = empty(&qc, [batch, hq, tq, dim], dtype);
                    attention(&qc, kv.clone(), &out, &options, t);
                    let got = tensor::<CudaRuntime, f32, i32, u8, 4>(out);
                    let what = format!(
                        "flash {format} b{batch} hq{hq} hkv{hkv} tq{tq} tk{tk} d{dim} {mask:?} softcap {softcap:?} {t:?}"
                    );
                    assert_close(got, expected.clone(), tolerance(dtype), &what);
                }
            }
        }
    }

    #[test]
    fn flash_attention_matches_reference_bf16() {
        matches_reference(DType::BF16);
    }

    #[test]
    fn flash_attention_matches_reference_f16() {
        matches_reference(DType::F16);
    }

    #[test]
    fn tilings_fit_hopper_shared_memory() {
        // Hopper (227 KiB per cube) takes every head size; 100 KiB (consumer GPUs) those up to
        // 256 (a cube's 64 query rows of 512 need 66 KiB alone; such heads take the other kernels).
        for (shared, dims) in [(227 << 10, &[64, 96, 128, 256, 512][..]), (100 << 10, &[64, 96, 128, 256][..])] {
            for &dim in dims {
                let t = FlashTiling::choose(dim, shared).expect("a tiling");
                assert!(t.shared_bytes() <= shared && t.dv * (dim / t.dv) == dim, "{t:?}");
            }
        }
        assert_eq!(FlashTiling::choose(512, 100 << 10), None);
        // The measured choices on a Hopper multiprocessor, and the small layout where shared
        // memory is 100 KiB.
        let hopper = |dim| FlashTiling::choose(dim, 227 << 10).map(|t| (t.planes, t.bk, t.prefetch));
        assert_eq!(hopper(256), Some((8, 64, Prefetch::None)));
        assert_eq!(hopper(512), Some((8, 32, Prefetch::NextTile)));
        assert_eq!(FlashTiling::choose(256, 100 << 10).map(|t| (t.planes, t.bk)), Some((4, 32)));
        assert_eq!(FlashTiling::choose(40, 227 << 10), None);
    }
}
