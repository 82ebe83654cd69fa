//! Attention with grouped KV heads, causal and sliding-window masks, and logit softcapping.

use burn::tensor::{activation::softmax, backend::Backend, DType, Int, Tensor};

/// Which keys each query may attend to, from absolute positions.
///
/// Query `i` sits at position `q_offset + i` and key `j` at `k_offset + j`. A key is visible when
/// it is not in the future and, with a sliding window of `W`, when `q_pos - k_pos < W` (the window
/// covers `W` keys including the current one).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AttentionMask {
    /// Absolute position of the first query.
    pub q_offset: usize,
    /// Absolute position of the first key.
    pub k_offset: usize,
    /// Sliding-window size, `None` for global attention.
    pub window: Option<usize>,
}

impl AttentionMask {
    /// Whether the key at absolute position `k_pos` is visible from the query at `q_pos`.
    pub fn visible(&self, q_pos: usize, k_pos: usize) -> bool {
        k_pos <= q_pos && self.window.is_none_or(|w| q_pos - k_pos < w)
    }

    /// Whether any (query, key) pair of a `q_len` x `k_len` block is hidden.
    pub fn masks_anything(&self, q_len: usize, k_len: usize) -> bool {
        if q_len == 0 || k_len == 0 {
            return false;
        }
        let last_key = self.k_offset + k_len - 1;
        let last_query = self.q_offset + q_len - 1;
        last_key > self.q_offset || self.window.is_some_and(|w| last_query - self.k_offset >= w)
    }
}

/// Reference attention. KV heads are shared by reshaping the queries into groups, so the
/// repeated KV heads are never materialized.
pub fn reference<B: Backend>(
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    v: Tensor<B, 4>,
    mask: AttentionMask,
    scale: f64,
    softcap: Option<f64>,
) -> Tensor<B, 4> {
    let [batch, q_heads, q_len, head_dim] = q.dims();
    let [_, kv_heads, k_len, _] = k.dims();
    let groups = q_heads / kv_heads;
    let dtype = q.dtype();
    let device = q.device();

    let q = q.reshape([batch, kv_heads, groups * q_len, head_dim]);
    let mut scores = q.matmul(k.swap_dims(2, 3)).cast(DType::F32).mul_scalar(scale);
    if let Some(cap) = softcap {
        scores = crate::softcap::reference(scores, cap);
    }
    let mut scores = scores.reshape([batch, kv_heads, groups, q_len, k_len]);
    if mask.masks_anything(q_len, k_len) {
        let q_pos = Tensor::<B, 1, Int>::arange(mask.q_offset as i64..(mask.q_offset + q_len) as i64, &device)
            .reshape([q_len, 1])
            .expand([q_len, k_len]);
        let k_pos = Tensor::<B, 1, Int>::arange(mask.k_offset as i64..(mask.k_offset + k_len) as i64, &device)
            .reshape([1, k_len])
            .expand([q_len, k_len]);
        let distance = q_pos - k_pos;
        let mut hidden = distance.clone().lower_elem(0);
        if let Some(window) = mask.window {
            hidden = hidden.bool_or(distance.greater_equal_elem(window as i64));
        }
        let hidden = hidden.reshape([1, 1, 1, q_len, k_len]).expand([batch, kv_heads, groups, q_len, k_len]);
        scores = scores.mask_fill(hidden, f32::MIN);
    }
    let probs = softmax(scores, 4).cast(dtype).reshape([batch, kv_heads, groups * q_len, k_len]);
    probs.matmul(v).reshape([batch, q_heads, q_len, head_dim])
}

/// CubeCL flash attention (prefill and decode share one kernel).
///
/// Each cube owns one KV head of one sequence and `BQ` consecutive rows of the `[groups * q_len]`
/// query rows that share that KV head (GQA/MQA: the query heads of a group read the same K/V
/// tiles, repeated KV heads are never materialized). It walks the key tiles its rows can see
/// (causal and sliding-window bounds skip whole tiles), staging `BK` keys and values in shared
/// memory, and keeps an online softmax (running max and sum per row) in f32 with the output
/// accumulators in registers. For decode and short prompts the key range is also split across
/// cubes (`splits` along the grid's z axis); a second kernel merges the partial results.
/// Only shared memory and barriers are used (no plane operations), so lavapipe runs it.
// Kernel code cannot call `usize::div_ceil` (not a CubeCL intrinsic).
#[allow(clippy::manual_div_ceil)]
pub(crate) mod kernel {
    use super::AttentionMask;
    use crate::cube::{elementwise, empty, load_vector_size, planes_of_32, pow2_ceil, tanh_f32, unit_index, Strides4};
    use burn::tensor::DType;
    use burn_cubecl::{tensor::CubeTensor, CubeRuntime};
    use cubecl::prelude::*;

    // Scores of masked (query, key) pairs are -3e38; anything below -1e38 counts as masked.
    // The running maximum starts at -1e30: finite, so `exp(m_old - m_new)` never sees inf - inf.

    /// Sizes the attention kernels read (their tensors are passed as arrays).
    #[derive(CubeLaunch, CubeType, Clone, Copy)]
    pub struct AttentionShape {
        pub batch: usize,
        pub q_heads: usize,
        pub q_len: usize,
        pub kv_heads: usize,
        /// Slots per KV head of an int8 cache (unused for dense keys and values).
        pub slots: usize,
    }

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
        // Visible key range [j_lo, j_hi), as key indices.
        let mut j_hi = i64::cast_from(q_offset as usize + i_max) - i64::cast_from(k_offset) + 1;
        j_hi = min(j_hi, i64::cast_from(k_len));
        let mut j_lo = 0i64;
        if has_window {
            j_lo = max(
                i64::cast_from(q_offset as usize + i_min) + 1 - i64::cast_from(window) - i64::cast_from(k_offset),
                0i64,
            );
        }
        let mut t_lo = 0usize;
        let mut t_hi = 0usize;
        if j_hi > j_lo {
            t_lo = usize::cast_from(j_lo) / bk;
            t_hi = (usize::cast_from(j_hi) + bk - 1) / bk;
        }
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
                        scratch[i * threads + unit] =
                            scratch[i * threads + unit] + scratch[i * threads + unit + stride];
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
        #[comptime] tiling: DecodeTiling,
        #[comptime] has_window: bool,
        #[comptime] has_cap: bool,
        #[comptime] split: bool,
        #[comptime] int8: bool,
        #[define(F)] _dtype: StorageType,
    ) {
        let dim = tiling.dim;
        let groups = tiling.groups;
        let per_lane = tiling.per_lane;
        let planes = tiling.planes;
        let n = k.vector_size();
        let nc = k_codes.vector_size();
        let kv_heads = shape.kv_heads;
        let b = CUBE_POS_Y as usize / kv_heads;
        let kvh = CUBE_POS_Y as usize % kv_heads;
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
        let steps = (end - begin + planes - 1) / planes;

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
        let mut dots = Array::<f32>::new(groups);
        #[unroll]
        for g in 0..groups {
            m[g] = f32::new(-1.0e30);
            l[g] = 0.0f32;
        }
        let mut scratch =
            SharedMemory::<f32>::new(comptime!(if tiling.plane_ops { 1usize } else { groups * planes * 32 }));

        for step in 0..steps {
            let j = begin + step * planes + plane_index;
            let valid = j < end;
            // Planes past the end re-read the last key and discard it.
            let key = min(j, end - 1);
            if active {
                if int8 {
                    let slot = (b * kv_heads + kvh) * shape.slots + key;
                    let k_scale = k_scales[slot];
                    let v_scale = v_scales[slot];
                    let first = (slot * (dim / 4) + c0 / 4) / nc;
                    #[unroll]
                    for u in 0..comptime!(per_lane / 4 / nc) {
                        let kw = k_codes[first + u];
                        let vw = v_codes[first + u];
                        #[unroll]
                        for i in 0..nc {
                            #[unroll]
                            for byte in 0..4usize {
                                let e = comptime!((u * nc + i) * 4 + byte);
                                kf[e] = int8_code(kw[i], byte) * k_scale;
                                vf[e] = int8_code(vw[i], byte) * v_scale;
                            }
                        }
                    }
                } else {
                    let k_first = k_strides.at(b, kvh, key, c0) / n;
                    let v_first = v_strides.at(b, kvh, key, c0) / n;
                    #[unroll]
                    for u in 0..comptime!(per_lane / n) {
                        let kv = k[k_first + u];
                        let vv = v[v_first + u];
                        #[unroll]
                        for i in 0..n {
                            kf[comptime!(u * n + i)] = f32::cast_from(kv[i]);
                            vf[comptime!(u * n + i)] = f32::cast_from(vv[i]);
                        }
                    }
                }
            }
            #[unroll]
            for g in 0..groups {
                let mut dot = 0.0f32;
                #[unroll]
                for e in 0..per_lane {
                    dot += qr[g * per_lane + e] * kf[e];
                }
                dots[g] = dot;
            }
            lanes_sum(&mut dots, &mut scratch, groups, planes, tiling.plane_ops);
            if valid {
                #[unroll]
                for g in 0..groups {
                    let mut score = dots[g];
                    if has_cap {
                        score = tanh_f32(score / cap) * cap;
                    }
                    let m_new = max(m[g], score);
                    let correction = f32::exp(m[g] - m_new);
                    let p = f32::exp(score - m_new);
                    l[g] = l[g] * correction + p;
                    #[unroll]
                    for e in 0..per_lane {
                        acc[g * per_lane + e] = acc[g * per_lane + e] * correction + p * vf[e];
                    }
                    m[g] = m_new;
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

    /// Byte `n` of an int8 KV word as the signed code (`stored - 128`, exact through the
    /// mantissa of 2^23).
    #[cube]
    fn int8_code(word: u32, #[comptime] n: usize) -> f32 {
        f32::reinterpret(((word >> comptime!((n * 8) as u32)) & 255u32) | 0x4B00_0000u32) - 8_388_736.0f32
    }

    /// Merges the per-split partial results: one unit per output element.
    #[cube(launch)]
    fn merge_splits_kernel<F: Float>(
        partial: &Array<f32>,
        stats: &Array<f32>,
        out: &mut Array<F>,
        splits: u32,
        shape: AttentionShape,
        #[comptime] dim: usize,
        #[define(F)] _dtype: StorageType,
    ) {
        let idx = unit_index();
        if idx >= out.len() {
            terminate!();
        }
        let q_heads = shape.q_heads;
        let batch = shape.batch;
        let kv_heads = shape.kv_heads;
        let q_len = shape.q_len;
        let groups = q_heads / kv_heads;
        let rows = groups * q_len;
        let c = idx % dim;
        let i = (idx / dim) % q_len;
        let h = (idx / (dim * q_len)) % q_heads;
        let b = idx / (dim * q_len * q_heads);
        let kvh = h / groups;
        let r = (h % groups) * q_len + i;
        let mut m = f32::new(-1.0e30);
        for s in 0..splits as usize {
            let slot = ((s * batch + b) * kv_heads + kvh) * rows + r;
            m = m.max(stats[slot * 2]);
        }
        let mut l = 0.0f32;
        let mut o = 0.0f32;
        for s in 0..splits as usize {
            let slot = ((s * batch + b) * kv_heads + kvh) * rows + r;
            let w = f32::exp(stats[slot * 2] - m);
            l += stats[slot * 2 + 1] * w;
            o += partial[slot * dim + c] * w;
        }
        let mut value = 0.0f32;
        if l > 0.0f32 {
            value = o / l;
        }
        out[idx] = F::cast_from(value);
    }

    /// Cubes that keep a GPU busy; fewer than this and the key range is split.
    const TARGET_CUBES: usize = 512;
    const MAX_SPLITS: usize = 256;

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

    /// Planes per decode cube at most, and keys each plane walks at least per split.
    const DECODE_PLANES: usize = 4;
    const DECODE_KEYS_PER_PLANE: usize = 4;

    /// The decode kernel's configuration where it applies: one query position, a head dimension
    /// that splits evenly over 32 lanes (whole int8 words per lane for an int8 cache), keys and
    /// values contiguous along the head dimension, and the group's accumulators within the
    /// shared-memory budget. Other shapes (prefill, odd head sizes) take the tiled kernel.
    fn decode_tiling<R: CubeRuntime>(q: &CubeTensor<R>, kv: &Kv<R>, shared_bytes: usize) -> Option<DecodeTiling> {
        let [_, q_heads, q_len, dim] = [q.meta.shape()[0], q.meta.shape()[1], q.meta.shape()[2], q.meta.shape()[3]];
        let kv_heads = match kv {
            Kv::Dense { k, .. } => k.meta.shape()[1],
            Kv::Int8 { k_scales, .. } => k_scales.meta.shape()[1],
        };
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
        let bytes = |planes: usize| planes * groups * (dim + 2) * 4 + groups * planes * 32 * 4;
        let mut planes = DECODE_PLANES;
        while planes > 1 && bytes(planes) > budget {
            planes /= 2;
        }
        (bytes(planes) <= budget).then_some(DecodeTiling {
            dim,
            groups,
            per_lane,
            planes,
            plane_ops: planes_of_32(&q.client),
        })
    }

    /// The widest load (elements) dividing `per_lane` and every stride but the last of `t`.
    fn kv_vector<R: CubeRuntime>(t: &CubeTensor<R>, per_lane: usize) -> usize {
        let s = t.meta.strides();
        let mut n = load_vector_size(&t.client, t.dtype.size(), per_lane, 8);
        while n > 1 && (s[0] % n != 0 || s[1] % n != 0 || s[2] % n != 0) {
            n /= 2;
        }
        n
    }

    /// Launches [`decode_attention_kernel`] (and the split merge) into `out`.
    fn decode_attention<R: CubeRuntime>(
        q: CubeTensor<R>,
        kv: Kv<R>,
        out: CubeTensor<R>,
        tiling: DecodeTiling,
        mask: AttentionMask,
        scale: f64,
        softcap: Option<f64>,
    ) -> CubeTensor<R> {
        let [batch, q_heads, q_len, dim] = [q.meta.shape()[0], q.meta.shape()[1], q.meta.shape()[2], q.meta.shape()[3]];
        let (kv_heads, k_len, slots) = match &kv {
            Kv::Dense { k, .. } => (k.meta.shape()[1], k.meta.shape()[2], k.meta.shape()[2]),
            Kv::Int8 { k_scales, len, .. } => (k_scales.meta.shape()[1], *len, k_scales.meta.shape()[2]),
        };
        // Visible keys, as the kernel computes them, to size the splits.
        let hi = (mask.q_offset + 1).saturating_sub(mask.k_offset).min(k_len);
        let lo = mask.window.map_or(0, |w| (mask.q_offset + 1).saturating_sub(w + mask.k_offset));
        let span = hi.saturating_sub(lo);
        let base_cubes = batch * kv_heads;
        let splits = TARGET_CUBES
            .div_ceil(base_cubes)
            .min(span.div_ceil(tiling.planes * DECODE_KEYS_PER_PLANE))
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
        // Unused arguments get `q` as a stand-in (see `attention_kv`).
        let (k, v, k_codes, k_scales, v_codes, v_scales) = match kv {
            Kv::Dense { k, v } => (k, v, q.clone(), q.clone(), q.clone(), q.clone()),
            Kv::Int8 { k_codes, k_scales, v_codes, v_scales, .. } => {
                (q.clone(), q.clone(), k_codes, k_scales, v_codes, v_scales)
            }
        };
        let n = if int8 { 1 } else { kv_vector(&k, tiling.per_lane).min(kv_vector(&v, tiling.per_lane)) };
        let nc = if int8 { load_vector_size(&client, 4, tiling.per_lane / 4, 4) } else { 1 };
        let shape = || AttentionShapeLaunch::new(batch, q_heads, q_len, kv_heads, slots);
        decode_attention_kernel::launch::<R>(
            &client,
            CubeCount::Static(splits as u32, (batch * kv_heads) as u32, 1),
            CubeDim::new_1d((tiling.planes * 32) as u32),
            n,
            nc,
            q.clone().into_array_arg(),
            k.clone().into_array_arg(),
            v.clone().into_array_arg(),
            out.clone().into_array_arg(),
            partial.clone().into_array_arg(),
            stats.clone().into_array_arg(),
            k_codes.into_array_arg(),
            k_scales.into_array_arg(),
            v_codes.into_array_arg(),
            v_scales.into_array_arg(),
            Strides4::launch(&q),
            Strides4::launch(&k),
            Strides4::launch(&v),
            shape(),
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
        );
        if split {
            let (count, cube_dim) = elementwise(batch * q_heads * dim, 256);
            merge_splits_kernel::launch::<R>(
                &client,
                count,
                cube_dim,
                partial.into_array_arg(),
                stats.into_array_arg(),
                out.clone().into_array_arg(),
                splits as u32,
                shape(),
                dim,
                dtype,
            );
        }
        out
    }

    /// Keys and values as the kernel reads them.
    pub enum Kv<R: CubeRuntime> {
        /// `[batch, kv_heads, k_len, dim]` each, any strides.
        Dense { k: CubeTensor<R>, v: CubeTensor<R> },
        /// Packed int8 codes `[batch, kv_heads, slots, dim / 4]` and f32 scales `[batch,
        /// kv_heads, slots]`; the first `len` slots are attended.
        Int8 {
            k_codes: CubeTensor<R>,
            k_scales: CubeTensor<R>,
            v_codes: CubeTensor<R>,
            v_scales: CubeTensor<R>,
            len: usize,
        },
    }

    /// `q`: `[batch, q_heads, q_len, dim]`, `k`/`v`: `[batch, kv_heads, k_len, dim]`, any
    /// strides. Returns a contiguous `[batch, q_heads, q_len, dim]` in `q`'s dtype.
    pub fn attention<R: CubeRuntime>(
        q: CubeTensor<R>,
        k: CubeTensor<R>,
        v: CubeTensor<R>,
        mask: AttentionMask,
        scale: f64,
        softcap: Option<f64>,
    ) -> CubeTensor<R> {
        attention_kv(q, Kv::Dense { k, v }, mask, scale, softcap)
    }

    /// Attention over dense or int8 keys and values.
    pub fn attention_kv<R: CubeRuntime>(
        q: CubeTensor<R>,
        kv: Kv<R>,
        mask: AttentionMask,
        scale: f64,
        softcap: Option<f64>,
    ) -> CubeTensor<R> {
        let [batch, q_heads, q_len, dim] = [q.meta.shape()[0], q.meta.shape()[1], q.meta.shape()[2], q.meta.shape()[3]];
        let (kv_heads, k_len, slots) = match &kv {
            Kv::Dense { k, .. } => (k.meta.shape()[1], k.meta.shape()[2], k.meta.shape()[2]),
            Kv::Int8 { k_scales, len, .. } => (k_scales.meta.shape()[1], *len, k_scales.meta.shape()[2]),
        };
        let out = empty(&q, [batch, q_heads, q_len, dim], q.dtype);
        if batch * q_heads * q_len * dim == 0 {
            return out;
        }
        let rows = (q_heads / kv_heads) * q_len;
        let shared = q.client.properties().hardware.max_shared_memory_size;
        if let Some(tiling) = decode_tiling(&q, &kv, shared) {
            return decode_attention(q, kv, out, tiling, mask, scale, softcap);
        }
        let tiling = tiling(rows, dim, shared);
        let row_blocks = rows.div_ceil(tiling.bq);
        let base_cubes = row_blocks * batch * kv_heads;
        let tiles = k_len.div_ceil(tiling.bk);
        // Down to one tile per split: a decode step has one cube per KV head otherwise, and
        // each tile is a chain of dependent loads and barriers.
        let splits = TARGET_CUBES.div_ceil(base_cubes).min(tiles).clamp(1, MAX_SPLITS);
        let split = splits > 1;
        // Unused arguments get `q` as a stand-in (never read or written, and an array argument
        // is only a buffer: its element type does not have to match).
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
        let (k, v, k_codes, k_scales, v_codes, v_scales) = match kv {
            Kv::Dense { k, v } => (k, v, q.clone(), q.clone(), q.clone(), q.clone()),
            Kv::Int8 { k_codes, k_scales, v_codes, v_scales, .. } => {
                (q.clone(), q.clone(), k_codes, k_scales, v_codes, v_scales)
            }
        };
        let shape = || AttentionShapeLaunch::new(batch, q_heads, q_len, kv_heads, slots);
        flash_attention_kernel::launch::<R>(
            &client,
            CubeCount::Static(row_blocks as u32, (batch * kv_heads) as u32, splits as u32),
            CubeDim::new_1d((tiling.bq * tiling.tpr) as u32),
            q.clone().into_array_arg(),
            k.clone().into_array_arg(),
            v.clone().into_array_arg(),
            out.clone().into_array_arg(),
            partial.clone().into_array_arg(),
            stats.clone().into_array_arg(),
            k_codes.into_array_arg(),
            k_scales.into_array_arg(),
            v_codes.into_array_arg(),
            v_scales.into_array_arg(),
            Strides4::launch(&q),
            Strides4::launch(&k),
            Strides4::launch(&v),
            shape(),
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
        );
        if split {
            let (count, cube_dim) = elementwise(batch * q_heads * q_len * dim, 256);
            merge_splits_kernel::launch::<R>(
                &client,
                count,
                cube_dim,
                partial.into_array_arg(),
                stats.into_array_arg(),
                out.clone().into_array_arg(),
                splits as u32,
                shape(),
                dim,
                dtype,
            );
        }
        out
    }
}

/// Naive attention on host vectors in f64 (`[batch, heads, len, dim]`, contiguous), for checking
/// the reference and the kernel without depending on any backend's matmul precision.
#[cfg(test)]
#[allow(clippy::too_many_arguments)]
pub(crate) fn naive(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    [batch, hq, hkv, tq, tk, d]: [usize; 6],
    mask: AttentionMask,
    scale: f64,
    softcap: Option<f64>,
) -> Vec<f32> {
    let mut out = vec![0.0; batch * hq * tq * d];
    for b in 0..batch {
        for h in 0..hq {
            let kh = h / (hq / hkv);
            let qb = (b * hq + h) * tq;
            let kb = (b * hkv + kh) * tk;
            for i in 0..tq {
                let s: Vec<Option<f64>> = (0..tk)
                    .map(|j| {
                        if !mask.visible(mask.q_offset + i, mask.k_offset + j) {
                            return None;
                        }
                        let dot: f64 = (0..d).map(|c| q[(qb + i) * d + c] as f64 * k[(kb + j) * d + c] as f64).sum();
                        let s = dot * scale;
                        Some(softcap.map_or(s, |cap| (s / cap).tanh() * cap))
                    })
                    .collect();
                let m = s.iter().flatten().cloned().fold(f64::NEG_INFINITY, f64::max);
                let p: Vec<f64> = s.iter().map(|x| x.map_or(0.0, |x| (x - m).exp())).collect();
                let z: f64 = p.iter().sum();
                for c in 0..d {
                    let o: f64 = (0..tk).map(|j| p[j] * v[(kb + j) * d + c] as f64).sum();
                    out[(qb + i) * d + c] = (o / z) as f32;
                }
            }
        }
    }
    out
}

#[cfg(all(test, feature = "ndarray"))]
mod tests {
    use super::*;
    use crate::test_util::TestBackend;
    use burn::tensor::{Distribution, TensorData};

    #[test]
    fn reference_matches_naive_with_gqa_and_window() {
        let device = Default::default();
        for (hq, hkv, tq, tk, d, q_offset, k_offset, window) in
            [(4, 2, 5, 9, 8, 4, 0, Some(3)), (3, 1, 7, 7, 5, 0, 0, None), (2, 2, 1, 6, 4, 9, 4, Some(6))]
        {
            let q = Tensor::<TestBackend, 4>::random([1, hq, tq, d], Distribution::Normal(0.0, 1.0), &device);
            let k = Tensor::<TestBackend, 4>::random([1, hkv, tk, d], Distribution::Normal(0.0, 1.0), &device);
            let v = Tensor::<TestBackend, 4>::random([1, hkv, tk, d], Distribution::Normal(0.0, 1.0), &device);
            let mask = AttentionMask { q_offset, k_offset, window };
            let scale = 0.37;
            let got = reference(q.clone(), k.clone(), v.clone(), mask, scale, None).into_data();
            let vec = |t: Tensor<TestBackend, 4>| t.into_data().to_vec::<f32>().unwrap();
            let expected = super::naive(&vec(q), &vec(k), &vec(v), [1, hq, hkv, tq, tk, d], mask, scale, None);
            assert!(got.to_vec::<f32>().unwrap().iter().all(|x| x.is_finite()));
            got.assert_approx_eq::<f32>(&TensorData::new(expected, [1, hq, tq, d]), Default::default());
        }
    }

    #[test]
    fn mask_window_covers_current_key() {
        let m = AttentionMask { q_offset: 0, k_offset: 0, window: Some(3) };
        assert!(m.visible(5, 3) && m.visible(5, 5) && !m.visible(5, 2) && !m.visible(5, 6));
        assert!(!AttentionMask { q_offset: 10, k_offset: 8, window: Some(3) }.masks_anything(1, 3));
        assert!(AttentionMask { q_offset: 10, k_offset: 7, window: Some(3) }.masks_anything(1, 4));
    }
}

#[cfg(test)]
mod gpu {
    use super::AttentionMask;
    use crate::gpu_test::{assert_close, seed, tolerance};
    use crate::GemmaBackend;
    use burn::tensor::{DType, Distribution, Tensor, TensorData};

    /// `(batch, q_heads, kv_heads, q_len, k_len, head_dim, q_offset, k_offset, window, softcap)`.
    type Case = (usize, usize, usize, usize, usize, usize, usize, usize, Option<usize>, Option<f64>);

    const CASES: [Case; 13] = [
        // Prefill, Gemma 3 270M heads (4 query heads on 1 KV head), odd length.
        (1, 4, 1, 37, 37, 256, 0, 0, None, None),
        // Sliding window smaller than the prompt, crossing tile edges.
        (1, 8, 8, 45, 45, 64, 0, 0, Some(16), None),
        (2, 4, 2, 19, 19, 128, 0, 0, Some(7), Some(50.0)),
        // Gemma 2 attention softcap, batch 2.
        (2, 8, 4, 23, 23, 256, 0, 0, None, Some(50.0)),
        // Decode over a long cache (split over the sequence), global and sliding.
        (1, 4, 1, 1, 1000, 256, 999, 0, None, None),
        (1, 8, 2, 1, 512, 128, 1300, 789, Some(512), None),
        (2, 16, 16, 1, 77, 128, 76, 0, None, Some(50.0)),
        // Decode with head sizes of one and three elements per lane, batch 2 in a window.
        (2, 4, 2, 1, 45, 16, 44, 0, Some(8), None),
        (1, 8, 1, 1, 300, 96, 299, 0, None, Some(30.0)),
        // Chunked prefill continuing a cache; head_dim not a power of two.
        (1, 4, 2, 5, 45, 96, 40, 0, None, None),
        // Multi-query attention with a tiny window, and a long window-bound chunk.
        (1, 8, 1, 9, 9, 256, 0, 0, Some(4), None),
        (1, 4, 1, 70, 582, 256, 530, 18, Some(512), None),
        // 16 KV heads, several query rows.
        (1, 16, 16, 3, 70, 128, 67, 0, None, None),
    ];

    pub fn attention<B: GemmaBackend>(device: &B::Device, dtype: DType) {
        seed::<B>(device, "attention");
        let normal = Distribution::Normal(0.0, 1.0);
        for (batch, hq, hkv, tq, tk, dim, q_offset, k_offset, window, softcap) in CASES {
            // Projections come out as [batch, seq, heads, dim]; attention sees them swapped.
            let q = Tensor::<B, 4>::random([batch, tq, hq, dim], normal, device).cast(dtype).swap_dims(1, 2);
            let k = Tensor::<B, 4>::random([batch, tk, hkv, dim], normal, device).cast(dtype).swap_dims(1, 2);
            let v = Tensor::<B, 4>::random([batch, hkv, tk, dim], normal, device).cast(dtype);
            let mask = AttentionMask { q_offset, k_offset, window };
            let scale = 1.0 / (dim as f64).sqrt() * 2.0;
            let got = B::grouped_attention(q.clone(), k.clone(), v.clone(), mask, scale, softcap);
            assert_eq!(got.dtype(), dtype);
            // Against f64 host attention on the same (rounded) inputs: a reference through the
            // backend's matmul would inherit its precision (TF32-class on CUDA).
            let host = |t: Tensor<B, 4>| t.cast(DType::F32).into_data().to_vec::<f32>().expect("f32");
            let dims = [batch, hq, hkv, tq, tk, dim];
            let expected = super::naive(&host(q), &host(k), &host(v), dims, mask, scale, softcap);
            let expected =
                Tensor::<B, 4>::from_data(TensorData::new(expected, [batch, hq, tq, dim]), (device, DType::F32));
            let what = format!("attention b{batch} hq{hq} hkv{hkv} tq{tq} tk{tk} d{dim} {mask:?} softcap {softcap:?}");
            assert_close(got, expected, tolerance(dtype), &what);
        }
    }

    gpu_tests!(attention_matches_reference => attention);
}
