//! The tiled flash-attention kernel: prefill, and decode shapes the decode kernel does not take.
//!
//! CubeCL flash attention (prefill and decode share one kernel).
//!
//! Each cube owns one KV head of one sequence and `BQ` consecutive rows of the `[groups * q_len]`
//! query rows that share that KV head (GQA/MQA: the query heads of a group read the same K/V
//! tiles, repeated KV heads are never materialized). It walks the key tiles its rows can see
//! (causal and sliding-window bounds skip whole tiles), staging `BK` keys and values in shared
//! memory, and keeps an online softmax (running max and sum per row) in f32 with the output
//! accumulators in registers. For decode and short prompts the key range is also split across
//! cubes (`splits` along the grid's z axis); a second kernel merges the partial results.
//! Only shared memory and barriers are used (no plane operations), so lavapipe runs it.

// Kernel code cannot call `usize::div_ceil` (not a CubeCL intrinsic).
#![allow(clippy::manual_div_ceil)]

use super::kernel::{shape_arg, visible_tiles, AttentionShape, Kv, ShapeSizes, MAX_SPLITS, TARGET_CUBES};
use super::merge::merge;
use super::AttentionOptions;
use crate::cube::{empty, pow2_ceil, tanh_f32, Strides4};
use crate::graph::{arg, launch};
use burn::tensor::DType;
use burn_cubecl::{tensor::CubeTensor, CubeRuntime};
use cubecl::prelude::*;

// Scores of masked (query, key) pairs are -3e38; anything below -1e38 counts as masked.
// The running maximum starts at -1e30: finite, so `exp(m_old - m_new)` never sees inf - inf.

/// Comptime launch configuration.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Tiling {
    /// Query rows per cube.
    pub bq: usize,
    /// Keys per shared-memory tile.
    pub bk: usize,
    /// Units per query row (`bq * tpr` units per cube).
    pub tpr: usize,
    /// Output columns each unit accumulates (`ceil(head_dim / tpr)`).
    pub cols: usize,
    /// Head dimension.
    pub dim: usize,
    /// Units sharing one (row, key) dot product.
    pub lanes: usize,
}

#[allow(clippy::too_many_arguments)]
#[cube(launch)]
fn flash_attention_kernel<F: Float>(
    q: &Array<F>,
    k: &Array<F>,
    v: &Array<F>,
    out: &mut Array<F>,
    partial: &mut Array<f32>,
    stats: &mut Array<f32>,
    k_codes: &Array<u32>,
    k_scales: &Array<f32>,
    v_codes: &Array<u32>,
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
    #[comptime] tiling: Tiling,
    #[comptime] has_window: bool,
    #[comptime] has_cap: bool,
    #[comptime] split: bool,
    #[comptime] int8: bool,
    #[define(F)] _dtype: StorageType,
) {
    let bq = tiling.bq;
    let bk = tiling.bk;
    let tpr = tiling.tpr;
    let dim = tiling.dim;
    let threads = bq * tpr;
    let q_heads = shape.q_heads;
    let q_len = shape.q_len;
    // int8 keys and values: packed codes `[batch, kv_heads, slots, dim / 4]` and scales
    // `[batch, kv_heads, slots]`, of which the first `kv_len` slots are attended.
    let kv_heads = shape.kv_heads;
    let k_len = kv_len as usize;
    let groups = q_heads / kv_heads;
    let rows = groups * q_len;
    let b = CUBE_POS_Y as usize / kv_heads;
    let kvh = CUBE_POS_Y as usize % kv_heads;
    let splits = CUBE_COUNT_Z as usize;
    let split_index = CUBE_POS_Z as usize;
    let tid = UNIT_POS_X as usize;

    // Rows of this cube and the positions they cover.
    let r0 = CUBE_POS_X as usize * bq;
    let r_last = min(r0 + bq, rows) - 1;
    let mut i_min = 0usize;
    let mut i_max = q_len - 1;
    if r0 / q_len == r_last / q_len {
        i_min = r0 % q_len;
        i_max = r_last % q_len;
    }
    let tiles = visible_tiles(i_min, i_max, k_len, q_offset, k_offset, window, has_window, bk);
    let (t_lo, t_hi) = (tiles.lo, tiles.hi);
    let per_split = (t_hi - t_lo + splits - 1) / splits;
    let t_begin = min(t_lo + split_index * per_split, t_hi);
    let t_end = min(t_begin + per_split, t_hi);

    // K rows are padded by one float so that units reading different keys at the same
    // column hit different shared-memory banks.
    let kstride = dim + 1;
    let lanes = tiling.lanes;
    let mut k_tile = SharedMemory::<f32>::new(tiling.bk * (tiling.dim + 1));
    let mut s_part = SharedMemory::<f32>::new(tiling.bq * tiling.bk * tiling.lanes);
    let mut v_tile = SharedMemory::<f32>::new(tiling.bk * tiling.dim);
    let mut s_tile = SharedMemory::<f32>::new(tiling.bq * tiling.bk);

    // This unit's row and columns for the softmax and output phase.
    let my_row = tid / tpr;
    let my_col = tid % tpr;
    let mut acc = Array::<f32>::new(tiling.cols);
    #[unroll]
    for i in 0..tiling.cols {
        acc[i] = 0.0f32;
    }
    let mut m = f32::new(-1.0e30);
    let mut l = 0.0f32;

    let k_base = k_strides.at(b, kvh, 0, 0);
    let v_base = v_strides.at(b, kvh, 0, 0);
    for tile in t_begin..t_end {
        let key0 = tile * bk;
        // Stage K and V (f32) for this tile.
        sync_cube();
        let mut idx = tid;
        while idx < bk * dim {
            let j = idx / dim;
            let c = idx % dim;
            let key = key0 + j;
            let mut kv = 0.0f32;
            let mut vv = 0.0f32;
            if key < k_len {
                if int8 {
                    let slot = (b * kv_heads + kvh) * shape.slots + key;
                    let word = slot * (dim / 4) + c / 4;
                    let shift = (c % 4) as u32 * 8;
                    kv = (f32::cast_from((k_codes[word] >> shift) & 255u32) - 128.0f32) * k_scales[slot];
                    vv = (f32::cast_from((v_codes[word] >> shift) & 255u32) - 128.0f32) * v_scales[slot];
                } else {
                    kv = f32::cast_from(k[k_base + key * k_strides.s + c * k_strides.d]);
                    vv = f32::cast_from(v[v_base + key * v_strides.s + c * v_strides.d]);
                }
            }
            k_tile[j * kstride + c] = kv;
            v_tile[idx] = vv;
            idx += threads;
        }
        sync_cube();
        // Scores of the cube's rows against the tile: each (row, key) pair's dot product
        // is split over `lanes` units, whose partial sums are then added.
        let mut idx = tid;
        while idx < bq * bk * lanes {
            let pair = idx / lanes;
            let lane = idx % lanes;
            let r = r0 + pair / bk;
            let j = pair % bk;
            let key = key0 + j;
            let mut dot = 0.0f32;
            if r < rows && key < k_len {
                let g = r / q_len;
                let i = r % q_len;
                let q_base = q_strides.at(b, kvh * groups + g, i, 0);
                let mut c = lane;
                while c < dim {
                    dot += f32::cast_from(q[q_base + c * q_strides.d]) * k_tile[j * kstride + c];
                    c += lanes;
                }
            }
            s_part[idx] = dot;
            idx += threads;
        }
        sync_cube();
        let mut pair = tid;
        while pair < bq * bk {
            let r = r0 + pair / bk;
            let key = key0 + pair % bk;
            let mut score = f32::new(-3.0e38);
            if r < rows && key < k_len {
                let q_pos = q_offset as usize + r % q_len;
                let k_pos = k_offset as usize + key;
                let mut visible = k_pos <= q_pos;
                if has_window {
                    visible = visible && q_pos - k_pos < window as usize;
                }
                if visible {
                    let mut dot = 0.0f32;
                    for lane in 0..lanes {
                        dot += s_part[pair * lanes + lane];
                    }
                    score = dot * scale;
                    if has_cap {
                        score = tanh_f32(score / cap) * cap;
                    }
                }
            }
            s_tile[pair] = score;
            pair += threads;
        }
        sync_cube();
        // Online softmax and P.V for this unit's row and columns.
        let mut tile_max = f32::new(-1.0e30);
        for j in 0..bk {
            tile_max = tile_max.max(s_tile[my_row * bk + j]);
        }
        let m_new = m.max(tile_max);
        let correction = f32::exp(m - m_new);
        l *= correction;
        #[unroll]
        for i in 0..tiling.cols {
            acc[i] *= correction;
        }
        for j in 0..bk {
            let s = s_tile[my_row * bk + j];
            if s > -1.0e38f32 {
                let p = f32::exp(s - m_new);
                l += p;
                #[unroll]
                for i in 0..tiling.cols {
                    let c = my_col + i * tpr;
                    if c < dim {
                        acc[i] += p * v_tile[j * dim + c];
                    }
                }
            }
        }
        m = m_new;
    }

    let r = r0 + my_row;
    if r < rows {
        if split {
            // Partial results [splits, batch, kv_heads, rows, dim] and (max, sum) stats.
            let slot = ((split_index * shape.batch + b) * kv_heads + kvh) * rows + r;
            #[unroll]
            for i in 0..tiling.cols {
                let c = my_col + i * tpr;
                if c < dim {
                    partial[slot * dim + c] = acc[i];
                }
            }
            if my_col == 0 {
                stats[slot * 2] = m;
                stats[slot * 2 + 1] = l;
            }
        } else {
            let g = r / q_len;
            let i = r % q_len;
            let o_base = ((b * q_heads + kvh * groups + g) * q_len + i) * dim;
            let mut inv = 0.0f32;
            if l > 0.0f32 {
                inv = 1.0f32 / l;
            }
            #[unroll]
            for i in 0..tiling.cols {
                let c = my_col + i * tpr;
                if c < dim {
                    out[o_base + c] = F::cast_from(acc[i] * inv);
                }
            }
        }
    }
}

/// Chooses the tiling for `rows` query rows of `dim` columns under `shared_bytes`.
pub fn tiling(rows: usize, dim: usize, shared_bytes: usize) -> Tiling {
    let bq = pow2_ceil(rows).min(16);
    let tpr = (256 / bq).min(pow2_ceil(dim)).max(1);
    let threads = bq * tpr;
    let budget = shared_bytes.min(48 * 1024);
    // Shared floats: K (padded) and V tiles, scores, and at most `threads` partial dots
    // (or one per pair when there are more pairs than units).
    let bytes = |bk: usize| (bk * (2 * dim + 1) + bq * bk + threads.max(bq * bk)) * 4;
    let mut bk = 64;
    while bk > 1 && bytes(bk) > budget {
        bk /= 2;
    }
    let lanes = (threads / (bq * bk)).max(1);
    Tiling { bq, bk, tpr, cols: dim.div_ceil(tpr), dim, lanes }
}

/// Launches [`flash_attention_kernel`] (and the split merge) into `out`.
pub(super) fn attention<R: CubeRuntime>(
    q: CubeTensor<R>,
    kv: Kv<R>,
    out: CubeTensor<R>,
    options: &AttentionOptions,
) -> CubeTensor<R> {
    let AttentionOptions { mask, scale, softcap } = *options;
    let [batch, q_heads, q_len, dim] = [q.meta.shape()[0], q.meta.shape()[1], q.meta.shape()[2], q.meta.shape()[3]];
    let (kv_heads, k_len, slots) = kv.sizes();
    let rows = (q_heads / kv_heads) * q_len;
    let tiling = tiling(rows, dim, q.client.properties().hardware.max_shared_memory_size);
    let row_blocks = rows.div_ceil(tiling.bq);
    let base_cubes = row_blocks * batch * kv_heads;
    let tiles = k_len.div_ceil(tiling.bk);
    // Down to one tile per split: a decode step has one cube per KV head otherwise, and
    // each tile is a chain of dependent loads and barriers.
    let splits = TARGET_CUBES.div_ceil(base_cubes).min(tiles).clamp(1, MAX_SPLITS);
    let split = splits > 1;
    let (partial, stats) = if split {
        (
            empty(&q, [splits * batch * kv_heads * rows, dim], DType::F32),
            empty(&q, [splits * batch * kv_heads * rows, 2], DType::F32),
        )
    } else {
        (q.clone(), q.clone())
    };
    let dtype: StorageType = q.dtype.into();
    let client = q.client.clone();
    let int8 = matches!(kv, Kv::Int8 { .. });
    let [k, v, k_codes, k_scales, v_codes, v_scales] = kv.args(&q);
    let shape = ShapeSizes { batch, q_heads, q_len, kv_heads, slots };
    launch!(flash_attention_kernel(
        &client,
        CubeCount::Static(row_blocks as u32, (batch * kv_heads) as u32, splits as u32),
        CubeDim::new_1d((tiling.bq * tiling.tpr) as u32),
        arg(&q),
        arg(&k),
        arg(&v),
        arg(&out),
        arg(&partial),
        arg(&stats),
        arg(&k_codes),
        arg(&k_scales),
        arg(&v_codes),
        arg(&v_scales),
        Strides4::launch(&q),
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
        split,
        int8,
        dtype,
    ));
    if split {
        merge(partial, stats, &out, splits, shape, dim);
    }
    out
}
