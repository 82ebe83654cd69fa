//! The quantized product for a batch of a few dozen activation rows, on the matrix units: a
//! batched decode step ([`MMA_MIN_ROWS`] to [`MMA_MAX_ROWS`] sequences) reads each weight
//! block once for all of its rows.
//!
//! The matrix-vector kernel ([`super::gemv`]) keeps one f32 sum per (row, feature) in registers,
//! which stops paying above [`crate::linear::GEMV_MAX_ROWS`] rows; the prompt path dequantizes
//! the whole matrix and multiplies it with the prefill GEMM, which for a few rows moves the
//! dense matrix through memory twice more than its codes. Here each cube owns `bn` output
//! features and every activation row, and walks `k` in stages of `bk` columns:
//!
//! 1. each unit loads its share of the stage's code vectors (16 bytes: one Q4 block, half a Q8
//!    block) with their scales, and of the activations (16 bytes of `F`), into registers; the
//!    shared tiles are double-buffered (one barrier per stage), and the loads of stage `s + 2`
//!    are issued before the products of stage `s + 1`, so they overlap them;
//! 2. the codes are dequantized exactly as [`super::device::dequantize`] does (`scale * q +
//!    offset`, rounded to `F`) into a shared `[bn, bk]` tile, the activations copied into a shared
//!    `[16 * mt, bk]` tile (zeros past the last row);
//! 3. each plane multiplies its `nt` column tiles of 16 features by the `mt` row tiles with
//!    16 x 16 x 16 cooperative-matrix products accumulating in f32.
//!
//! When the matrix has too few features to keep every multiprocessor busy the columns are also
//! split along `k` (`splits` cubes per column tile, the grid's y axis): each split writes its
//! f32 partial sums to its own `[16 * mt, n]` slab, and `reduce_kernel` adds the slabs, rounds
//! to `F` and applies the epilogue (as the matrix-vector kernel rounds gate and up to `F`
//! before `gelu_tanh(gate) * up`).
//!
//! Only on CUDA, in f16/bf16, where the device has 16 x 16 x 16 cooperative matrices for `F`
//! with an f32 accumulator ([`applies`]); other runtimes (Vulkan and HIP also have them, but the
//! kernel has not been checked there; lavapipe has none) keep the other paths.

// Kernel code cannot call `usize::div_ceil` (not a CubeCL intrinsic).
#![allow(clippy::manual_div_ceil)]

use super::device::{code, Packed};
use super::QuantizedMatrix;
use crate::cube::Cb;
use crate::cube::{elementwise, empty, unit_index};
use crate::graph::{arg, launch};
use crate::linear::kernel::{OutPlace, OutPlaceLaunch};
use crate::Epilogue;
use burn::tensor::{DType, Tensor};
use burn_cubecl::{tensor::CubeTensor, BoolElement, CubeRuntime, FloatElement, IntElement};
use cubecl::ir::StorageType;
use cubecl::prelude::*;

/// Most activation rows the kernel takes (four row tiles of 16).
pub const MMA_MAX_ROWS: usize = 64;

/// Fewest activation rows the backends multiply with this kernel rather than the quantized
/// matrix-vector kernel. Its time hardly falls below 16 rows (one row tile), while the GEMV's
/// grows with every row: on the H200 (graph replays, Gemma 3 4B's qkv, Q4,
/// `docs/runs/gpu/2026-11-26-mma.md` calls 2-3) this kernel takes 12.5 us at 3 and 4 rows where the
/// GEMV took 15.0 and 17.7 us, and the GEMV's 10.8 us at 2 rows is below it.
pub const MMA_MIN_ROWS: usize = 3;

/// Most shared memory a tiling may take per cube: two cubes fit a Hopper multiprocessor
/// (227 KiB), one an Ampere one (164 KiB).
const MAX_SHARED: usize = 112 << 10;

/// Side of the cooperative-matrix tiles.
const TILE: usize = 16;

/// Extra `F` per shared-memory row: a row of `bk + PAD` values starts 16 bytes further along
/// the banks than the last, so the 16 rows a fragment load reads fall on different banks.
const PAD: usize = 8;

/// Values of `F` (16-bit) per 16-byte vector.
const VEC: usize = 8;

/// How a launch divides the product.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct MmaTiling {
    /// Row tiles of 16 activation rows (1 to 4).
    pub mt: usize,
    /// Column tiles of 16 features per plane.
    pub nt: usize,
    /// Planes (32 units) per cube.
    pub planes: usize,
    /// Columns of `k` per stage (a multiple of 32).
    pub bk: usize,
    /// Cubes along `k` per column tile.
    pub splits: usize,
}

impl MmaTiling {
    /// Features per cube.
    pub fn bn(&self) -> usize {
        self.planes * self.nt * TILE
    }

    /// The tiling for `m` rows of a `[n, k]` matrix on a device of `sms` multiprocessors, from
    /// the H200's timings of every candidate on Gemma 3 4B's products at 4, 16 and 64 rows
    /// (`docs/runs/gpu/2026-11-26-mma.md`): four planes per cube; one column tile per plane and
    /// stages of 128 columns up to 32 rows, two column tiles and stages of 64 above (the
    /// activation tile is then the larger part of a stage, and wider cubes load it for more
    /// features); splits along `k` for about four cubes per multiprocessor, at most eight.
    pub fn choose(m: usize, n: usize, k: usize, sms: usize) -> Self {
        let mt = m.div_ceil(TILE).clamp(1, 4);
        let (nt, bk) = if mt <= 2 { (1, 128) } else { (2, 64) };
        let bk = if k.is_multiple_of(bk) { bk } else { 64 };
        let mut tiling = Self { mt, nt, planes: 4, bk, splits: 1 };
        let columns = n.div_ceil(tiling.bn()).max(1);
        let stages = k / bk;
        tiling.splits = (4 * sms).div_ceil(columns).min(8).min(stages / 2).max(1);
        tiling
    }

    /// The tilings worth timing for `m` rows of a `[n, k]` matrix: [`MmaTiling::choose`]'s, then
    /// one to four column tiles per plane, two to eight planes, stages of 64 or 128 columns, and
    /// one to eight splits, those that fit.
    pub fn candidates(m: usize, n: usize, k: usize, sms: usize) -> Vec<Self> {
        let mt = m.div_ceil(TILE).clamp(1, 4);
        let mut all = vec![Self::choose(m, n, k, sms)];
        for (nt, planes) in [(1, 4), (2, 4), (4, 4), (1, 8), (2, 8), (2, 2), (4, 2)] {
            for bk in [64, 128] {
                for splits in [1, 2, 4, 8] {
                    let t = Self { mt, nt, planes, bk, splits };
                    if t.fits(m, k) && !all.contains(&t) {
                        all.push(t);
                    }
                }
            }
        }
        all
    }

    /// Shared memory a cube takes: two buffers of the weight and activation tiles.
    pub fn shared_bytes(&self) -> usize {
        2 * (self.bn() + self.mt * TILE) * (self.bk + PAD) * 2
    }

    /// Whether the kernel takes `m` rows of a matrix `k` wide with this tiling.
    pub fn fits(&self, m: usize, k: usize) -> bool {
        (1..=4).contains(&self.mt)
            && m <= self.mt * TILE
            && self.bk.is_multiple_of(32)
            && k.is_multiple_of(self.bk)
            && self.splits >= 1
            && self.splits <= k / self.bk
            && self.nt >= 1
            && self.planes >= 1
            && self.shared_bytes() <= MAX_SHARED
            // Every unit loads the same number of code and activation vectors per stage (Q8's
            // 16-code vectors: `bk / 16` per row; Q4's: `bk / 32`).
            && (self.bn() * self.bk / 32).is_multiple_of(self.planes * 32)
            && (self.mt * TILE * self.bk / VEC).is_multiple_of(self.planes * 32)
    }
}

/// Whether the backends multiply `m` activation rows in `dtype` by a quantized matrix `k` wide
/// with this kernel rather than the matrix-vector kernel: from [`MMA_MIN_ROWS`] rows, where it
/// [`applies`].
pub fn takes<R: CubeRuntime>(client: &ComputeClient<R>, dtype: DType, m: usize, k: usize) -> bool {
    m >= MMA_MIN_ROWS && applies(client, dtype, m, k)
}

/// Whether this kernel takes `m` activation rows in `dtype` of a quantized matrix `k`
/// wide on `client`: the CUDA runtime (the only one its tests have run on), 16-bit floats
/// multiplied on 16 x 16 x 16 cooperative matrices with an f32 accumulator, at most
/// [`MMA_MAX_ROWS`] rows, `k` a multiple of 64.
pub fn applies<R: CubeRuntime>(client: &ComputeClient<R>, dtype: DType, m: usize, k: usize) -> bool {
    crate::cube::cuda_runtime::<R>()
        && (1..=MMA_MAX_ROWS).contains(&m)
        && k.is_multiple_of(64)
        && crate::cube::cmma_16(client, dtype)
}

/// What one stage moves, per cube and per unit (comptime).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct StageShape {
    /// Columns of `k` per stage.
    bk: usize,
    /// Code vectors and activation vectors each unit loads per stage.
    per_unit: usize,
    x_per_unit: usize,
    /// Units per cube.
    units: usize,
    /// Shared-memory row pitch, in vectors of [`VEC`].
    pitch: usize,
    q4: bool,
}

/// One stage in a unit's registers: its code vectors with their scale and offset (0 for Q8),
/// and its activation vectors.
#[derive(CubeType)]
struct Loaded<F: Float, NW: Size, NX: Size> {
    codes: Array<Vector<u32, NW>>,
    scales: Array<f32>,
    offsets: Array<f32>,
    x: Array<Vector<F, NX>>,
}

/// Loads this unit's share of stage `stage` into `into`: code vector `i = unit + j * units`
/// is vector `i % stage_vecs` of row `n0 + i / stage_vecs` (rows past the matrix read its last
/// row), and likewise the activations (zeros past row `m`).
#[cube]
fn load_stage<F: Float, S: Float, NW: Size, NX: Size>(
    x: &Array<Vector<F, NX>>,
    codes: &Array<Vector<u32, NW>>,
    scales: &Array<S>,
    offsets: &Array<S>,
    into: &mut Loaded<F, NW, NX>,
    stage: usize,
    n0: usize,
    dims: Dims,
    #[comptime] shape: StageShape,
) {
    let per_word = comptime!(if shape.q4 { 8usize } else { 4usize });
    let nw = codes.vector_size();
    let stage_vecs = comptime!(shape.bk / (nw * per_word));
    let x_vecs = comptime!(shape.bk / VEC);
    let unit = UNIT_POS_X as usize;
    let row_vecs = dims.words as usize / nw;
    let k_vecs = dims.k as usize / VEC;
    #[unroll]
    for j in 0..shape.per_unit {
        let i = unit + j * shape.units;
        let row = min(n0 + i / stage_vecs, dims.n_out as usize - 1);
        let v = stage * stage_vecs + i % stage_vecs;
        into.codes[j] = codes[row * row_vecs + v];
        let block = row * dims.blocks as usize + (v * comptime!(nw * per_word)) / 32;
        into.scales[j] = f32::cast_from(scales[block]);
        if shape.q4 {
            into.offsets[j] = f32::cast_from(offsets[block]);
        } else {
            into.offsets[j] = 0.0f32;
        }
    }
    #[unroll]
    for j in 0..shape.x_per_unit {
        let i = unit + j * shape.units;
        let r = i / x_vecs;
        if r < dims.m as usize {
            into.x[j] = x[r * k_vecs + stage * x_vecs + i % x_vecs];
        } else {
            into.x[j] = Vector::<F, NX>::new(F::from_int(0));
        }
    }
}

/// Writes the loaded stage into shared buffer `buffer`: the codes dequantized exactly as
/// [`super::device::dequantize`] does (`scale * q + offset`, rounded to `F`), the activations
/// as loaded; rows of `bk + PAD` values.
#[cube]
fn store_stage<F: Float, NW: Size, NX: Size>(
    from: &Loaded<F, NW, NX>,
    w_tile: &mut SharedMemory<Vector<F, NX>>,
    x_tile: &mut SharedMemory<Vector<F, NX>>,
    buffer: usize,
    #[comptime] shape: StageShape,
) {
    let per_word = comptime!(if shape.q4 { 8usize } else { 4usize });
    let nw = from.codes.vector_size();
    let per_vec = comptime!(nw * per_word);
    let stage_vecs = comptime!(shape.bk / per_vec);
    let x_vecs = comptime!(shape.bk / VEC);
    let pitch = comptime!(shape.pitch);
    let unit = UNIT_POS_X as usize;
    let w_at = buffer * comptime!(shape.units * shape.per_unit / stage_vecs * shape.pitch);
    let x_at = buffer * comptime!(shape.units * shape.x_per_unit / x_vecs * shape.pitch);
    #[unroll]
    for j in 0..shape.per_unit {
        let i = unit + j * shape.units;
        let at = w_at + (i / stage_vecs) * pitch + (i % stage_vecs) * comptime!(per_vec / VEC);
        #[unroll]
        for h in 0..comptime!(per_vec / VEC) {
            let mut v = Vector::<F, NX>::empty();
            #[unroll]
            for e in 0..VEC {
                let c = comptime!(h * VEC + e);
                let word = from.codes[j][comptime!(c / per_word)];
                v[e] = F::cast_from(code(word, comptime!(c % per_word), shape.q4) * from.scales[j] + from.offsets[j]);
            }
            w_tile[at + h] = v;
        }
    }
    #[unroll]
    for j in 0..shape.x_per_unit {
        let i = unit + j * shape.units;
        x_tile[x_at + (i / x_vecs) * pitch + i % x_vecs] = from.x[j];
    }
}

/// `count` f32 accumulator fragments holding zeros (this kernel's and flash attention's).
#[cube]
pub(crate) fn accumulators(#[comptime] count: usize) -> Sequence<cmma::Matrix<f32>> {
    let mut accs = Sequence::<cmma::Matrix<f32>>::new();
    #[unroll]
    for _ in 0..count {
        accs.push(cmma::Matrix::<f32>::from_value(
            cmma::MatrixIdent::Accumulator,
            TILE,
            TILE,
            TILE,
            cmma::MatrixLayout::Undefined,
            0.0f32,
        ));
    }
    accs
}

/// The 16 x 16 fragment of a shared tile (rows `pitch` vectors of 8 apart) starting at vector
/// `start` (also the flash attention kernel's).
#[cube]
pub(crate) fn load_fragment<F: Float, NX: Size>(
    tile: &SharedMemory<Vector<F, NX>>,
    start: usize,
    #[comptime] ident: cmma::MatrixIdent,
    #[comptime] layout: cmma::MatrixLayout,
    #[comptime] pitch: usize,
) -> cmma::Matrix<F> {
    let fragment = unsafe { cmma::Matrix::<F>::uninitialized(ident, TILE, TILE, TILE, layout) };
    cmma::load(&fragment, &tile.slice(start, start + comptime!(TILE * pitch)), comptime!(pitch * VEC) as u32);
    fragment
}

/// Sizes every launch passes.
#[derive(CubeLaunch, CubeType, Clone, Copy)]
struct Dims {
    /// Activation rows.
    m: u32,
    /// Input width.
    k: u32,
    /// Code words and scale blocks per weight row.
    words: u32,
    blocks: u32,
    /// Weight rows (output features), and the partial slabs' row pitch (a multiple of `bn`).
    n_out: u32,
    n_pad: u32,
}

/// `partial[split, r, c]` (`[splits, 16 * mt, n_pad]`, f32): split `split`'s share of `x[r] .
/// w[c]` for the cube's `bn` features `c`.
#[allow(clippy::too_many_arguments)]
#[cube(launch)]
fn mma_kernel<F: Float, S: Float, NW: Size, NX: Size>(
    x: &Array<Vector<F, NX>>,
    codes: &Array<Vector<u32, NW>>,
    scales: &Array<S>,
    offsets: &Array<S>,
    partial: &mut Array<f32>,
    dims: Dims,
    #[comptime] mt: usize,
    #[comptime] nt: usize,
    #[comptime] planes: usize,
    #[comptime] bk: usize,
    #[comptime] q4: bool,
    #[define(F, S)] _dtypes: [StorageType; 2],
) {
    let per_word = comptime!(if q4 { 8usize } else { 4usize });
    let nw = codes.vector_size();
    let per_vec = comptime!(nw * per_word);
    let stage_vecs = comptime!(bk / per_vec);
    let units = comptime!(planes * 32);
    let bn = comptime!(planes * nt * TILE);
    let per_unit = comptime!(bn * stage_vecs / units);
    let x_vecs = comptime!(bk / VEC);
    let x_per_unit = comptime!(mt * TILE * x_vecs / units);
    // Shared rows of `bk + PAD` values, in vectors of 8.
    let pitch = comptime!((bk + PAD) / VEC);
    // Two buffers of each tile: stage `s` is multiplied from buffer `s % 2` while stage `s + 1`
    // is written into the other, one barrier per stage.
    let w_size = comptime!(bn * pitch);
    let x_size = comptime!(mt * TILE * pitch);
    let mut w_tile = SharedMemory::<Vector<F, NX>>::new_aligned(comptime!(2 * bn * pitch), 32usize);
    let mut x_tile = SharedMemory::<Vector<F, NX>>::new_aligned(comptime!(2 * mt * TILE * pitch), 32usize);

    let unit = UNIT_POS_X as usize;
    let plane = unit / 32;
    let n0 = CUBE_POS_X as usize * bn;
    let split = CUBE_POS_Y as usize;
    let splits = CUBE_COUNT_Y as usize;
    let stages = dims.k as usize / bk;
    let first = split * stages / splits;
    let last = (split + 1) * stages / splits;

    let shape = comptime!(StageShape { bk, per_unit, x_per_unit, units, pitch, q4 });
    let mut loaded = Loaded::<F, NW, NX> {
        codes: Array::new(per_unit),
        scales: Array::new(per_unit),
        offsets: Array::new(per_unit),
        x: Array::new(x_per_unit),
    };
    let accs = accumulators(comptime!(mt * nt));

    if first < last {
        load_stage::<F, S, NW, NX>(x, codes, scales, offsets, &mut loaded, first, n0, dims, shape);
        store_stage::<F, NW, NX>(&loaded, &mut w_tile, &mut x_tile, 0, shape);
        sync_cube();
        if first + 1 < last {
            load_stage::<F, S, NW, NX>(x, codes, scales, offsets, &mut loaded, first + 1, n0, dims, shape);
        }
    }
    let mut stage = first;
    while stage < last {
        let buffer = (stage - first) % 2;
        let (w_at, x_at) = (buffer * w_size, buffer * x_size);
        #[unroll]
        for s in 0..comptime!(bk / TILE) {
            let mut bs = Sequence::<cmma::Matrix<F>>::new();
            #[unroll]
            for t in 0..nt {
                let start = w_at + (plane * nt + t) * comptime!(TILE * pitch) + comptime!(s * TILE / VEC);
                bs.push(load_fragment::<F, NX>(
                    &w_tile,
                    start,
                    cmma::MatrixIdent::B,
                    cmma::MatrixLayout::ColMajor,
                    pitch,
                ));
            }
            #[unroll]
            for i in 0..mt {
                let start = x_at + comptime!(i * TILE * pitch + s * TILE / VEC);
                let a =
                    load_fragment::<F, NX>(&x_tile, start, cmma::MatrixIdent::A, cmma::MatrixLayout::RowMajor, pitch);
                #[unroll]
                for t in 0..nt {
                    let acc = accs.index(comptime!(i * nt + t));
                    cmma::execute::<F, F, f32, f32>(&a, bs.index(t), acc, acc);
                }
            }
        }
        if stage + 1 < last {
            store_stage::<F, NW, NX>(&loaded, &mut w_tile, &mut x_tile, 1 - buffer, shape);
        }
        // Stage `s + 1` is in its buffer, and every plane is done with buffer `s % 2`.
        sync_cube();
        if stage + 2 < last {
            load_stage::<F, S, NW, NX>(x, codes, scales, offsets, &mut loaded, stage + 2, n0, dims, shape);
        }
        stage += 1;
    }
    let n_pad = dims.n_pad as usize;
    #[unroll]
    for i in 0..mt {
        #[unroll]
        for t in 0..nt {
            let start = (split * comptime!(mt * TILE) + i * TILE) * n_pad + n0 + (plane * nt + t) * TILE;
            cmma::store(
                &mut partial.slice_mut(start, start + comptime!(TILE - 1) * n_pad + TILE),
                accs.index(comptime!(i * nt + t)),
                n_pad as u32,
                cmma::MatrixLayout::RowMajor,
            );
        }
    }
}

/// Adds the splits' partial sums of each (row, feature) and writes them to `out` in `F`; with
/// `pairs`, features interleaved as gate and up blocks of [`crate::gelu::PAIR_BLOCK`], each
/// rounded to `F`, become `gelu_tanh(gate) * up`.
#[allow(clippy::too_many_arguments)]
#[cube(launch)]
fn reduce_kernel<F: Float>(
    partial: &Array<f32>,
    out: &mut Array<F>,
    place: OutPlace,
    m: u32,
    width: u32,
    n_pad: u32,
    slab: u32,
    splits: u32,
    #[comptime] pairs: bool,
    #[define(F)] _dtype: StorageType,
) {
    let idx = unit_index();
    let width = width as usize;
    if idx >= m as usize * width {
        terminate!();
    }
    let (r, j) = (idx / width, idx % width);
    let n_pad = n_pad as usize;
    let slab = slab as usize;
    let pair = comptime!(crate::gelu::PAIR_BLOCK);
    let column = if pairs { (j / pair) * comptime!(2 * pair) + j % pair } else { j };
    let mut total = 0.0f32;
    let mut up = 0.0f32;
    for s in 0..splits as usize {
        let at = s * slab + r * n_pad + column;
        total += partial[at];
        if pairs {
            up += partial[at + pair];
        }
    }
    let value = if pairs {
        let gate = f32::cast_from(F::cast_from(total));
        crate::gelu::kernel::gelu_mul_f32(gate, f32::cast_from(F::cast_from(up)))
    } else {
        total
    };
    out[r * place.stride as usize + place.offset as usize + j] = F::cast_from(value);
}

/// `x [m, k] @ dequantize(w)^T` (or its [`Epilogue::GeluPairs`]) written into columns
/// `offset..` of `out` (`[m, wider]`, contiguous, `x`'s dtype), with `tiling` (which must fit:
/// see [`MmaTiling::choose`]).
///
/// # Panics
///
/// If `tiling` does not fit the shape: [`product_into`] takes [`MmaTiling::choose`]'s, and
/// [`project_with`] checks the one it is given and returns an error instead.
pub(crate) fn product_into_tiled<R: CubeRuntime>(
    x: CubeTensor<R>,
    w: &Packed<R>,
    epilogue: Epilogue,
    out: &CubeTensor<R>,
    offset: usize,
    tiling: MmaTiling,
) {
    let [m, k] = [x.meta.shape()[0], x.meta.shape()[1]];
    let n_out = w.codes.meta.shape()[0];
    assert!(tiling.fits(m, k), "the quantized mma product does not take {m} x {k} with {tiling:?}");
    if m == 0 || n_out == 0 {
        return;
    }
    let (codes, scales, offsets, q4) = w.args();
    let (row_words, row_blocks) = w.row_sizes();
    let bn = tiling.bn();
    let n_pad = n_out.div_ceil(bn) * bn;
    let rows = tiling.mt * TILE;
    let partial = empty(&x, [tiling.splits * rows, n_pad], DType::F32);
    let dtypes = [x.dtype.into(), scales.dtype.into()];
    launch!(mma_kernel(
        &x.client,
        CubeCount::Static((n_pad / bn) as u32, tiling.splits as u32, 1),
        CubeDim::new_1d((tiling.planes * 32) as u32),
        4,
        VEC,
        arg(&x),
        arg(&codes),
        arg(&scales),
        arg(&offsets),
        arg(&partial),
        DimsLaunch::new(m as u32, k as u32, row_words, row_blocks, n_out as u32, n_pad as u32),
        tiling.mt,
        tiling.nt,
        tiling.planes,
        tiling.bk,
        q4,
        dtypes,
    ));
    let width = epilogue.out_width(n_out);
    let (count, dim) = elementwise(m * width, 256);
    launch!(reduce_kernel(
        &x.client,
        count,
        dim,
        arg(&partial),
        arg(out),
        OutPlaceLaunch::new(out.meta.shape()[1] as u32, offset as u32),
        m as u32,
        width as u32,
        n_pad as u32,
        (rows * n_pad) as u32,
        tiling.splits as u32,
        epilogue == Epilogue::GeluPairs,
        x.dtype.into(),
    ));
}

/// [`product_into_tiled`] with the tiling [`MmaTiling::choose`] picks for the device (the
/// backends ask [`applies`] first).
pub(crate) fn product_into<R: CubeRuntime>(
    x: CubeTensor<R>,
    w: &Packed<R>,
    epilogue: Epilogue,
    out: &CubeTensor<R>,
    offset: usize,
) {
    let [m, k] = [x.meta.shape()[0], x.meta.shape()[1]];
    let tiling = MmaTiling::choose(m, w.codes.meta.shape()[0], k, multiprocessors(&x.client));
    product_into_tiled(x, w, epilogue, out, offset, tiling);
}

/// Why [`project_with`] refused a product.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MmaError {
    /// The runtime has no 16 x 16 x 16 cooperative matrices for the dtype, or the shape is
    /// outside the kernel's (more than [`MMA_MAX_ROWS`] rows, `k` not a multiple of 64).
    #[error("the quantized mma product does not run {rows} x {cols} rows of {dtype:?} on this device")]
    Unsupported { rows: usize, cols: usize, dtype: DType },
    /// The tiling does not divide the shape.
    #[error("tiling {tiling:?} does not fit {rows} x {cols}")]
    Tiling { tiling: MmaTiling, rows: usize, cols: usize },
}

/// `x [m, k] @ dequantize(w)^T` (or its epilogue) with a given tiling, for measuring tilings
/// side by side (`kernel_bench --section batched`); the backends' `project` picks
/// [`MmaTiling::choose`].
pub fn project_with<R, F, I, BT>(
    x: Tensor<Cb<R, F, I, BT>, 2>,
    w: &QuantizedMatrix<Cb<R, F, I, BT>>,
    epilogue: Epilogue,
    tiling: MmaTiling,
) -> Result<Tensor<Cb<R, F, I, BT>, 2>, MmaError>
where
    R: CubeRuntime,
    F: FloatElement,
    I: IntElement,
    BT: BoolElement,
{
    let [rows, cols] = x.dims();
    let dtype = x.dtype();
    if !applies(&R::client(&x.device()), dtype, rows, cols) {
        return Err(MmaError::Unsupported { rows, cols, dtype });
    }
    if !tiling.fits(rows, cols) {
        return Err(MmaError::Tiling { tiling, rows, cols });
    }
    let x = crate::cube::float(x);
    let out = empty(&x, [rows, epilogue.out_width(w.shape[0])], x.dtype);
    product_into_tiled(x, &super::device::packed(w), epilogue, &out, 0, tiling);
    Ok(crate::cube::tensor(out))
}

/// The device's multiprocessors (132 assumed where the runtime does not say), as
/// [`MmaTiling::choose`] takes them.
pub fn multiprocessors<R: CubeRuntime>(client: &ComputeClient<R>) -> usize {
    client.properties().hardware.num_streaming_multiprocessors.map_or(132, |s| s as usize)
}

#[cfg(all(test, feature = "cuda"))]
mod tests {
    use super::*;
    use crate::gpu_test::{assert_close, seed, tolerance};
    use crate::quant::check::{host, values};
    use crate::quant::device::packed;
    use crate::quant::{CodeLayout, HostQuantized, QuantFormat, QuantizedMatrix};
    use crate::HostMatrix;
    use burn::backend::Cuda;
    use burn::tensor::{Tensor, TensorData};

    /// The launcher's tiling and a spread of others, on odd row and feature counts, Q8 and Q4,
    /// both epilogues, written into columns of a wider output, against f64 host sums over the
    /// host-dequantized matrix.
    fn matches_reference(dtype: DType) {
        let device = Default::default();
        let s = seed::<Cuda>(&device, "mma_matches_reference");
        let client = <cubecl::cuda::CudaRuntime as Runtime>::client(&device);
        let shapes = [(9, 64, 33), (16, 128, 64), (23, 640, 1001), (33, 2560, 72), (64, 1152, 520), (41, 384, 16)];
        // The launcher's choice, and a spread of the others: one, two and four column tiles
        // per plane, two to eight planes, stages of 64 and 128, one to three splits.
        let tilings = |m: usize, n: usize, k: usize| {
            let mt = m.div_ceil(TILE);
            let mut all = vec![MmaTiling::choose(m, n, k, multiprocessors(&client))];
            for (nt, planes, bk, splits) in
                [(1, 4, 64, 1), (2, 4, 128, 3), (4, 2, 64, 2), (2, 8, 64, 1), (1, 2, 128, 2)]
            {
                let t = MmaTiling { mt, nt, planes, bk, splits };
                if t.fits(m, k) {
                    all.push(t);
                }
            }
            all
        };
        for format in [QuantFormat::Q8, QuantFormat::Q4] {
            for (i, &(m, k, n)) in shapes.iter().enumerate() {
                assert!(applies(&client, dtype, m, k), "the H200's CUDA runtime multiplies {dtype:?} on cmma");
                let hq = HostQuantized::quantize(&values(n * k, s + i as u64), n, k, format).expect("quantize");
                let w = QuantizedMatrix::<Cuda>::upload(&hq, CodeLayout::Words, DType::F16, &device);
                let xs = values(m * k, s ^ (0x51 + i as u64));
                let x = Tensor::<Cuda, 2>::from_data(TensorData::new(xs, [m, k]), (&device, DType::F32)).cast(dtype);
                let xh = host(x.clone());
                let deq = hq.dequantize();
                let dot =
                    |r: usize, o: usize| (0..k).map(|c| xh[r * k + c] as f64 * deq[o * k + c] as f64).sum::<f64>();
                // Gate and up are rounded to the dtype before the GELU, as a separate product stores them.
                let round = |v: f64| match dtype {
                    DType::BF16 => half::bf16::from_f64(v).to_f64(),
                    _ => half::f16::from_f64(v).to_f64(),
                };
                let plain: Vec<f32> = (0..m).flat_map(|r| (0..n).map(move |o| dot(r, o) as f32)).collect();
                let pairs: Vec<f32> = (0..m)
                    .flat_map(|r| {
                        (0..n / 2).map(move |j| {
                            let (b, c) = (j / crate::gelu::PAIR_BLOCK, j % crate::gelu::PAIR_BLOCK);
                            let gate = dot(r, b * 2 * crate::gelu::PAIR_BLOCK + c);
                            let up = dot(r, b * 2 * crate::gelu::PAIR_BLOCK + crate::gelu::PAIR_BLOCK + c);
                            let (g, u) = (round(gate), round(up));
                            (0.5 * g * (1.0 + (0.797_884_560_8 * (g + 0.044715 * g * g * g)).tanh()) * u) as f32
                        })
                    })
                    .collect();
                for tiling in tilings(m, n, k) {
                    for (epilogue, expected, width) in
                        [(Epilogue::Identity, &plain, n), (Epilogue::GeluPairs, &pairs, n / 2)]
                    {
                        let x = crate::cube::float(x.clone());
                        let out = crate::cube::empty(&x, [m, width + 3], x.dtype);
                        product_into_tiled(x, &packed(&w), epilogue, &out, 3, tiling);
                        let got: Tensor<Cuda, 2> = crate::cube::tensor(out);
                        let got = got.slice([0..m, 3..width + 3]);
                        let expected = Tensor::<Cuda, 2>::from_data(
                            TensorData::new(expected.clone(), [m, width]),
                            (&device, DType::F32),
                        );
                        let what = format!("{format} {m}x{k} -> {n} {epilogue:?} {tiling:?}");
                        assert_close(got, expected, 2.0 * tolerance(dtype), &what);
                    }
                }
            }
        }
        // A matrix uploaded the backend's own way (f16 scales) through `project`.
        let hq = HostQuantized::quantize(&values(300 * 640, s + 99), 300, 640, QuantFormat::Q4).expect("quantize");
        let w =
            <Cuda as crate::GemmaBackend>::upload_matrix(HostMatrix::Quantized(hq.clone()), &device).expect("upload");
        let x =
            Tensor::<Cuda, 2>::from_data(TensorData::new(values(40 * 640, s + 98), [40, 640]), (&device, DType::F32))
                .cast(dtype);
        let xh = host(x.clone());
        let deq = hq.dequantize();
        let expected: Vec<f32> = (0..40)
            .flat_map(|r| {
                let (xh, deq) = (&xh, &deq);
                (0..300).map(move |o| {
                    (0..640).map(|c| xh[r * 640 + c] as f64 * deq[o * 640 + c] as f64).sum::<f64>() as f32
                })
            })
            .collect();
        let got = <Cuda as crate::GemmaBackend>::project(x, &w, Epilogue::Identity);
        let expected = Tensor::<Cuda, 2>::from_data(TensorData::new(expected, [40, 300]), (&device, DType::F32));
        assert_close(got, expected, 2.0 * tolerance(dtype), "q4 project 40x640 -> 300");
    }

    #[test]
    fn mma_matches_reference_bf16() {
        matches_reference(DType::BF16);
    }

    #[test]
    fn mma_matches_reference_f16() {
        matches_reference(DType::F16);
    }
}
