//! The decode attention kernel: one query position per sequence, keys walked by planes of 32 lanes.

#![allow(clippy::manual_div_ceil)]

use super::kernel::{int8_code, shape_arg, AttentionShape, Kv, ShapeSizes, MAX_SPLITS, TARGET_CUBES};
use super::merge::merge;
use super::AttentionOptions;
use crate::cube::{empty, load_vector_size, planes_of_32, tanh_f32, Strides4};
use crate::graph::{arg, launch};
use crate::kv::paged::kernel::{args as table_args, store_row, store_slot, Table};
use crate::step::kernel::Position;
use burn::tensor::DType;
use burn_cubecl::{tensor::CubeTensor, CubeRuntime};
use cubecl::prelude::*;

// Scores of masked (query, key) pairs are -3e38; anything below -1e38 counts as masked.
// The running maximum starts at -1e30: finite, so `exp(m_old - m_new)` never sees inf - inf.

/// Comptime configuration of [`decode_attention_kernel`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct DecodeTiling {
    /// Head dimension.
    pub dim: usize,
    /// Query heads per KV head (the rows one cube serves).
    pub groups: usize,
    /// Head-dimension elements per lane: lane `i` owns `[i * per_lane, (i + 1) * per_lane)`
    /// (`ceil(dim / 32)`, dividing `dim`; lanes past `dim` idle).
    pub per_lane: usize,
    /// Planes of 32 units per cube, each walking its own keys.
    pub planes: usize,
    /// Consecutive keys a plane takes per step: their loads are all issued before any is
    /// used (bytes in flight), and the online softmax rescales once per block.
    pub keys: usize,
    /// `plane_sum` adds the lanes' partial dots (32-wide planes), else shared memory does.
    pub plane_ops: bool,
}

/// Sums each of `values` over the 32 lanes of every plane, returned to all lanes: by
/// `plane_sum`, or through `scratch` (`count * CUBE_DIM_X` floats) and barriers.
#[cube]
fn lanes_sum(
    values: &mut Array<f32>,
    scratch: &mut SharedMemory<f32>,
    #[comptime] count: usize,
    #[comptime] planes: usize,
    #[comptime] plane_ops: bool,
) {
    if plane_ops {
        #[unroll]
        for i in 0..count {
            values[i] = plane_sum(values[i]);
        }
    } else {
        let threads = comptime!(planes * 32);
        let unit = UNIT_POS_X as usize;
        let lane = unit % 32;
        #[unroll]
        for i in 0..count {
            scratch[i * threads + unit] = values[i];
        }
        sync_cube();
        // From a builtin so the loop variable is a runtime value (CUBE_DIM_X = planes * 32).
        let mut stride = CUBE_DIM_X as usize / comptime!(2 * planes);
        while stride > 0 {
            if lane < stride {
                #[unroll]
                for i in 0..count {
                    scratch[i * threads + unit] = scratch[i * threads + unit] + scratch[i * threads + unit + stride];
                }
            }
            sync_cube();
            stride /= 2;
        }
        #[unroll]
        for i in 0..count {
            values[i] = scratch[i * threads + unit - lane];
        }
        sync_cube();
    }
}

/// Decode attention (one query position): one cube per (sequence, KV head, split of the
/// visible keys) serves all the query heads of the group. Each plane of 32 units walks its
/// own keys, one per step: every lane reads its `per_lane` elements of the key and value
/// rows (a plane reads each row once, coalesced, in vectors of `N` elements or of `NC`
/// words of int8 codes), the lanes' partial dots are summed across the plane, and each
/// lane keeps the online softmax (f32) and its slice of the output accumulators in
/// registers - no shared-memory staging and no barrier per key. The planes' results are
/// combined once at the end; splits go to `partial`/`stats` for [`merge_splits_kernel`].
#[allow(clippy::too_many_arguments)]
#[cube(launch)]
fn decode_attention_kernel<F: Float, N: Size, NC: Size>(
    q: &Array<F>,
    k: &Array<Vector<F, N>>,
    v: &Array<Vector<F, N>>,
    out: &mut Array<F>,
    partial: &mut Array<f32>,
    stats: &mut Array<f32>,
    k_codes: &Array<Vector<u32, NC>>,
    k_scales: &Array<f32>,
    v_codes: &Array<Vector<u32, NC>>,
    v_scales: &Array<f32>,
    step: &Array<u32>,
    blocks: &Array<u32>,
    q_strides: Strides4,
    k_strides: Strides4,
    v_strides: Strides4,
    shape: AttentionShape,
    kv_len: u32,
    q_offset: u32,
    k_offset: u32,
    position_stride: u32,
    row_step: u32,
    store_stride: u32,
    window: u32,
    scale: f32,
    cap: f32,
    table_width: u32,
    block_shift: u32,
    #[comptime] tiling: DecodeTiling,
    #[comptime] has_window: bool,
    #[comptime] has_cap: bool,
    #[comptime] split: bool,
    #[comptime] int8: bool,
    #[comptime] position_on_device: bool,
    #[comptime] paged: bool,
    #[define(F)] _dtype: StorageType,
) {
    // A position read on the device (sequence `b`'s own where the buffer holds one per
    // sequence): the first `min(p + 1, kv_len)` slots are visible, placed so that the query at
    // `p` sees them all (see `crate::step::decode_visible`).
    let kv_heads = shape.kv_heads;
    let b = CUBE_POS_Y as usize / kv_heads;
    let kvh = CUBE_POS_Y as usize % kv_heads;
    let mut kv_len = kv_len;
    let mut q_offset = q_offset;
    let mut k_offset = k_offset;
    // The store row the query row reads: its own sequence, or the first for consecutive rows
    // of one sequence (row `b` then at the first row's position plus `b`).
    let sb = b * store_stride as usize;
    if position_on_device {
        let p = step[b * position_stride as usize] + b as u32 * row_step;
        kv_len = min(p + 1, kv_len);
        q_offset = p;
        k_offset = p + 1 - kv_len;
    }
    let dim = tiling.dim;
    let groups = tiling.groups;
    let per_lane = tiling.per_lane;
    let planes = tiling.planes;
    let n = k.vector_size();
    let nc = k_codes.vector_size();
    let splits = CUBE_COUNT_X as usize;
    let split_index = CUBE_POS_X as usize;
    let unit = UNIT_POS_X as usize;
    let lane = unit % 32;
    let plane_index = unit / 32;
    let c0 = lane * per_lane;
    let active = c0 < dim;

    // Visible keys [lo, hi) (key indices), this split's share [begin, end).
    let mut j_hi = i64::cast_from(q_offset) - i64::cast_from(k_offset) + 1;
    j_hi = min(j_hi, i64::cast_from(kv_len));
    let mut j_lo = 0i64;
    if has_window {
        j_lo = max(i64::cast_from(q_offset) + 1 - i64::cast_from(window) - i64::cast_from(k_offset), 0i64);
    }
    let mut lo = 0usize;
    let mut hi = 0usize;
    if j_hi > j_lo {
        lo = usize::cast_from(j_lo);
        hi = usize::cast_from(j_hi);
    }
    let per_split = (hi - lo + splits - 1) / splits;
    let begin = min(lo + split_index * per_split, hi);
    let end = min(begin + per_split, hi);
    // The same step count for every plane, so that all units meet the same barriers.
    let steps = (end - begin + planes * tiling.keys - 1) / (planes * tiling.keys);

    // This lane's slice of every query row of the group, with the score scale folded in.
    let mut qr = Array::<f32>::new(comptime!(groups * per_lane));
    let mut acc = Array::<f32>::new(comptime!(groups * per_lane));
    let mut kf = Array::<f32>::new(per_lane);
    let mut vf = Array::<f32>::new(per_lane);
    #[unroll]
    for e in 0..per_lane {
        kf[e] = 0.0f32;
        vf[e] = 0.0f32;
    }
    #[unroll]
    for g in 0..groups {
        #[unroll]
        for e in 0..per_lane {
            let mut value = 0.0f32;
            if active {
                value = f32::cast_from(q[q_strides.at(b, kvh * groups + g, 0, c0 + e)]) * scale;
            }
            qr[g * per_lane + e] = value;
            acc[g * per_lane + e] = 0.0f32;
        }
    }
    let mut m = Array::<f32>::new(groups);
    let mut l = Array::<f32>::new(groups);
    #[unroll]
    for g in 0..groups {
        m[g] = f32::new(-1.0e30);
        l[g] = 0.0f32;
    }
    let mut scratch =
        SharedMemory::<f32>::new(comptime!(if tiling.plane_ops { 1usize } else { tiling.keys * groups * planes * 32 }));

    let kb = tiling.keys;
    let k_vectors = comptime!(per_lane / n);
    let c_vectors = comptime!(if int8 { per_lane / 4 / nc } else { 1usize });
    let mut k_raw = Array::<Vector<F, N>>::new(comptime!(if int8 { 1usize } else { kb * k_vectors }));
    let mut v_raw = Array::<Vector<F, N>>::new(comptime!(if int8 { 1usize } else { kb * k_vectors }));
    let mut k_words = Array::<Vector<u32, NC>>::new(comptime!(if int8 { kb * c_vectors } else { 1usize }));
    let mut v_words = Array::<Vector<u32, NC>>::new(comptime!(if int8 { kb * c_vectors } else { 1usize }));
    let mut k_sc = Array::<f32>::new(kb);
    let mut v_sc = Array::<f32>::new(kb);
    // Lanes past the head dimension never load: their zeros keep the plane sums finite.
    if int8 {
        #[unroll]
        for w in 0..comptime!(kb * c_vectors) {
            k_words[w] = Vector::new(0u32);
            v_words[w] = Vector::new(0u32);
        }
        #[unroll]
        for u in 0..kb {
            k_sc[u] = 0.0f32;
            v_sc[u] = 0.0f32;
        }
    } else {
        #[unroll]
        for w in 0..comptime!(kb * k_vectors) {
            k_raw[w] = Vector::new(F::new(0.0));
            v_raw[w] = Vector::new(F::new(0.0));
        }
    }
    let mut scores = Array::<f32>::new(comptime!(kb * groups));
    for step in 0..steps {
        let j0 = begin + (step * planes + plane_index) * kb;
        // Every load of the block first (keys past the end re-read the last key, discarded).
        if active {
            #[unroll]
            for u in 0..kb {
                let key = min(j0 + u, end - 1);
                // The key's store row and slot there (its block in a paged store).
                let row = store_row(blocks, sb, key, table_width, block_shift, paged);
                let at = store_slot(key, block_shift, paged);
                if int8 {
                    let slot = (row * kv_heads + kvh) * shape.slots + at;
                    k_sc[u] = k_scales[slot];
                    v_sc[u] = v_scales[slot];
                    let first = (slot * (dim / 4) + c0 / 4) / nc;
                    #[unroll]
                    for w in 0..c_vectors {
                        k_words[u * c_vectors + w] = k_codes[first + w];
                        v_words[u * c_vectors + w] = v_codes[first + w];
                    }
                } else {
                    let k_first = k_strides.at(row, kvh, at, c0) / n;
                    let v_first = v_strides.at(row, kvh, at, c0) / n;
                    #[unroll]
                    for w in 0..k_vectors {
                        k_raw[u * k_vectors + w] = k[k_first + w];
                        v_raw[u * k_vectors + w] = v[v_first + w];
                    }
                }
            }
        }
        // The lanes' partial dots of every (key, query row).
        #[unroll]
        for u in 0..kb {
            #[unroll]
            for e in 0..per_lane {
                if int8 {
                    let word = k_words[u * c_vectors + comptime!(e / 4 / nc)][comptime!((e / 4) % nc)];
                    kf[e] = int8_code(word, comptime!(e % 4)) * k_sc[u];
                } else {
                    kf[e] = f32::cast_from(k_raw[u * k_vectors + comptime!(e / n)][comptime!(e % n)]);
                }
            }
            #[unroll]
            for g in 0..groups {
                let mut dot = 0.0f32;
                #[unroll]
                for e in 0..per_lane {
                    dot += qr[g * per_lane + e] * kf[e];
                }
                scores[u * groups + g] = dot;
            }
        }
        lanes_sum(&mut scores, &mut scratch, comptime!(kb * groups), planes, tiling.plane_ops);
        // Online softmax over the block: one rescale, then each valid key's weight.
        #[unroll]
        for g in 0..groups {
            let mut top = m[g];
            #[unroll]
            for u in 0..kb {
                let mut score = scores[u * groups + g];
                if has_cap {
                    score = tanh_f32(score / cap) * cap;
                }
                if j0 + u >= end {
                    score = f32::new(-3.0e38);
                }
                scores[u * groups + g] = score;
                top = max(top, score);
            }
            let correction = f32::exp(m[g] - top);
            l[g] *= correction;
            #[unroll]
            for e in 0..per_lane {
                acc[g * per_lane + e] *= correction;
            }
            m[g] = top;
        }
        #[unroll]
        for u in 0..kb {
            #[unroll]
            for e in 0..per_lane {
                if int8 {
                    let word = v_words[u * c_vectors + comptime!(e / 4 / nc)][comptime!((e / 4) % nc)];
                    vf[e] = int8_code(word, comptime!(e % 4)) * v_sc[u];
                } else {
                    vf[e] = f32::cast_from(v_raw[u * k_vectors + comptime!(e / n)][comptime!(e % n)]);
                }
            }
            #[unroll]
            for g in 0..groups {
                // Masked keys: exp(-3e38 - top) is 0.
                let p = f32::exp(scores[u * groups + g] - m[g]);
                l[g] += p;
                #[unroll]
                for e in 0..per_lane {
                    acc[g * per_lane + e] += p * vf[e];
                }
            }
        }
    }

    // Combine the planes: their (max, sum) per row, then the rescaled accumulators.
    let mut ml = SharedMemory::<f32>::new(comptime!(planes * groups * 2));
    let mut red = SharedMemory::<f32>::new(comptime!(planes * groups * dim));
    if lane == 0 {
        #[unroll]
        for g in 0..groups {
            ml[(plane_index * groups + g) * 2] = m[g];
            ml[(plane_index * groups + g) * 2 + 1] = l[g];
        }
    }
    sync_cube();
    #[unroll]
    for g in 0..groups {
        let mut top = f32::new(-1.0e30);
        for p in 0..planes {
            top = max(top, ml[(p * groups + g) * 2]);
        }
        let factor = f32::exp(m[g] - top);
        if active {
            #[unroll]
            for e in 0..per_lane {
                red[(plane_index * groups + g) * dim + c0 + e] = acc[g * per_lane + e] * factor;
            }
        }
    }
    sync_cube();
    let mut idx = unit;
    while idx < groups * dim {
        let g = idx / dim;
        let c = idx % dim;
        let mut top = f32::new(-1.0e30);
        for p in 0..planes {
            top = max(top, ml[(p * groups + g) * 2]);
        }
        let mut sum = 0.0f32;
        let mut o = 0.0f32;
        for p in 0..planes {
            sum += ml[(p * groups + g) * 2 + 1] * f32::exp(ml[(p * groups + g) * 2] - top);
            o += red[(p * groups + g) * dim + c];
        }
        if split {
            // Partial results [splits, batch, kv_heads, groups, dim] and (max, sum) stats.
            let slot = ((split_index * shape.batch + b) * kv_heads + kvh) * groups + g;
            partial[slot * dim + c] = o;
            if c == 0 {
                stats[slot * 2] = top;
                stats[slot * 2 + 1] = sum;
            }
        } else {
            let mut value = 0.0f32;
            if sum > 0.0f32 {
                value = o / sum;
            }
            out[(b * shape.q_heads + kvh * groups + g) * dim + c] = F::cast_from(value);
        }
        idx += CUBE_DIM_X as usize;
    }
}

/// Planes per decode cube at most, and steps (blocks of [`DecodeTiling::keys`] keys) each
/// plane takes per split at least: a step costs a memory latency, so a short cache is split
/// until each plane has a few steps, and a long one is not split past what fills the GPU.
const DECODE_PLANES: usize = 8;
const DECODE_STEPS_PER_PLANE: usize = 2;

/// Keys per plane step: 8 where the lane's query rows and accumulators are small (`groups *
/// per_lane` at most 16 floats each: Gemma 3 4B, 12B, 27B), else 4 (1B: 4 query heads per KV
/// head), so that the block's loads fit in registers next to them.
fn keys_per_step(groups: usize, per_lane: usize) -> usize {
    if groups * per_lane <= 16 {
        8
    } else {
        4
    }
}

/// The decode kernel's configuration where it applies: one query position, a head dimension
/// that splits evenly over 32 lanes (whole int8 words per lane for an int8 cache), keys and
/// values contiguous along the head dimension, and the group's accumulators within the
/// shared-memory budget. Other shapes (prefill, odd head sizes) take the tiled kernel.
pub(super) fn tiling<R: CubeRuntime>(q: &CubeTensor<R>, kv: &Kv<R>, shared_bytes: usize) -> Option<DecodeTiling> {
    let [_, q_heads, q_len, dim] = [q.meta.shape()[0], q.meta.shape()[1], q.meta.shape()[2], q.meta.shape()[3]];
    let (kv_heads, _, _) = kv.sizes();
    let per_lane = dim.div_ceil(32);
    let contiguous = match kv {
        Kv::Dense { k, v } => k.meta.strides()[3] == 1 && v.meta.strides()[3] == 1,
        Kv::Int8 { .. } => per_lane % 4 == 0,
    };
    if q_len != 1 || dim % per_lane != 0 || !contiguous {
        return None;
    }
    let groups = q_heads / kv_heads;
    let budget = shared_bytes.min(48 * 1024);
    let keys = keys_per_step(groups, per_lane);
    let plane_ops = planes_of_32(&q.client);
    let scratch = if plane_ops { 0 } else { keys * groups * 32 * 4 };
    let bytes = |planes: usize| planes * groups * (dim + 2) * 4 + planes * scratch;
    let mut planes = DECODE_PLANES;
    while planes > 1 && bytes(planes) > budget {
        planes /= 2;
    }
    (bytes(planes) <= budget).then_some(DecodeTiling { dim, groups, per_lane, planes, keys, plane_ops })
}

/// The widest load (elements) dividing `per_lane` and every stride but the last of `t`.
fn kv_vector<R: CubeRuntime>(t: &CubeTensor<R>, per_lane: usize) -> usize {
    let s = t.meta.strides();
    let mut n = load_vector_size(&t.client, t.dtype.size(), per_lane, 8);
    while n > 1 && (!s[0].is_multiple_of(n) || !s[1].is_multiple_of(n) || !s[2].is_multiple_of(n)) {
        n /= 2;
    }
    n
}

/// Launches [`decode_attention_kernel`] (and the split merge) into `out`. With the position on
/// the device, the splits are sized for its bound (splits past the visible keys are empty).
pub(super) fn attention<R: CubeRuntime>(
    q: CubeTensor<R>,
    kv: Kv<R>,
    out: CubeTensor<R>,
    tiling: DecodeTiling,
    options: &AttentionOptions,
    position: Option<Position<R>>,
    blocks: Option<Table<R>>,
) -> CubeTensor<R> {
    let AttentionOptions { mask, scale, softcap } = *options;
    let [batch, q_heads, q_len, dim] = [q.meta.shape()[0], q.meta.shape()[1], q.meta.shape()[2], q.meta.shape()[3]];
    let (kv_heads, k_len, slots) = kv.sizes();
    // A paged store: the keys are each sequence's logical slots.
    let k_len = blocks.as_ref().map_or(k_len, Table::slots);
    // Visible keys, as the kernel computes them, to size the splits (at most the window: a
    // store keeping every position of a sliding window reads only the window's keys).
    let span = match &position {
        Some(Position::Device { bound, .. }) => (bound + 1).min(k_len).min(mask.window.unwrap_or(usize::MAX)),
        _ => {
            let hi = (mask.q_offset + 1).saturating_sub(mask.k_offset).min(k_len);
            let lo = mask.window.map_or(0, |w| (mask.q_offset + 1).saturating_sub(w + mask.k_offset));
            hi.saturating_sub(lo)
        }
    };
    // Consecutive rows of one sequence split their keys as a one-row step does, so that each
    // row sums in the order of the step at its position (a verify step's greedy choices are
    // then those of decoding without drafts, but for the products over several rows).
    let per_row = position.as_ref().is_some_and(|p| p.row_step() > 0);
    let base_cubes = if per_row { kv_heads } else { batch * kv_heads };
    let splits = TARGET_CUBES
        .div_ceil(base_cubes)
        .min(span.div_ceil(tiling.planes * tiling.keys * DECODE_STEPS_PER_PLANE))
        .clamp(1, MAX_SPLITS);
    let split = splits > 1;
    let groups = tiling.groups;
    let (partial, stats) = if split {
        (
            empty(&q, [splits * batch * kv_heads * groups, dim], DType::F32),
            empty(&q, [splits * batch * kv_heads * groups, 2], DType::F32),
        )
    } else {
        (q.clone(), q.clone())
    };
    let dtype: StorageType = q.dtype.into();
    let client = q.client.clone();
    let int8 = matches!(kv, Kv::Int8 { .. });
    let [k, v, k_codes, k_scales, v_codes, v_scales] = kv.args(&q);
    let n = if int8 { 1 } else { kv_vector(&k, tiling.per_lane).min(kv_vector(&v, tiling.per_lane)) };
    let nc = if int8 { load_vector_size(&client, 4, tiling.per_lane / 4, 4) } else { 1 };
    let shape = ShapeSizes { batch, q_heads, q_len, kv_heads, slots };
    let on_device = matches!(position, Some(Position::Device { .. }));
    let step = position.as_ref().map_or_else(|| q.clone(), |p| p.buffer(&q));
    let (table, table_width, block_shift) = table_args(blocks.as_ref(), &q);
    launch!(decode_attention_kernel(
        &client,
        CubeCount::Static(splits as u32, (batch * kv_heads) as u32, 1),
        CubeDim::new_1d((tiling.planes * 32) as u32),
        n,
        nc,
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
        arg(&step),
        arg(&table),
        Strides4::launch(&q),
        Strides4::launch(&k),
        Strides4::launch(&v),
        shape_arg(shape),
        k_len as u32,
        mask.q_offset as u32,
        mask.k_offset as u32,
        position.as_ref().map_or(0, Position::stride),
        position.as_ref().map_or(0, Position::row_step),
        position.as_ref().map_or(1, Position::store_stride),
        mask.window.unwrap_or(0) as u32,
        scale as f32,
        softcap.unwrap_or(1.0) as f32,
        table_width,
        block_shift,
        tiling,
        mask.window.is_some(),
        softcap.is_some(),
        split,
        int8,
        on_device,
        blocks.is_some(),
        dtype,
    ));
    if split {
        merge(partial, stats, &out, splits, shape, dim);
    }
    out
}
