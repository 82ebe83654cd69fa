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

/// How queries attend: which keys they see, the score scale and the optional logit softcap (as
/// `tanh(s / cap) * cap`, Gemma 2).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AttentionOptions {
    pub mask: AttentionMask,
    pub scale: f64,
    pub softcap: Option<f64>,
}

/// Reference attention. KV heads are shared by reshaping the queries into groups, so the
/// repeated KV heads are never materialized.
///
/// - `q`: `[batch, q_heads, q_len, head_dim]`; `k`, `v`: `[batch, kv_heads, k_len, head_dim]` with
///   `q_heads % kv_heads == 0`; returns `[batch, q_heads, q_len, head_dim]` in `q`'s dtype.
pub fn reference<B: Backend>(
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    v: Tensor<B, 4>,
    options: &AttentionOptions,
) -> Tensor<B, 4> {
    let AttentionOptions { mask, scale, softcap } = *options;
    let [batch, q_heads, q_len, head_dim] = q.dims();
    let [_, kv_heads, k_len, _] = k.dims();
    let groups = q_heads / kv_heads;
    let dtype = q.dtype();
    let device = q.device();

    let q = q.reshape([batch, kv_heads, groups * q_len, head_dim]);
    // The same products either way; with fewer query rows than keys (decode) as `k @ q^T`,
    // transposed after: backends whose matmul wants contiguous operands (Candle) then copy the
    // few query rows and the small result, not every key of the cache at every token.
    let scores =
        if groups * q_len < k_len { k.matmul(q.swap_dims(2, 3)).swap_dims(2, 3) } else { q.matmul(k.swap_dims(2, 3)) };
    let mut scores = scores.cast(DType::F32).mul_scalar(scale);
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
        // The hidden pairs as one additive bias of `q_len x k_len` (f32::MIN where hidden),
        // broadcast over the heads: the scores `mask_fill` on the expanded mask gave (a visible
        // score plus 0 is itself; a hidden one plus f32::MIN rounds to f32::MIN), in one pass
        // over them instead of the booleans' expansion and a select (on Candle that took 4% of a
        // 512-token prompt, docs/runs/cpu/2026-11-30-prompt-profile.md).
        let bias = Tensor::<B, 2>::zeros([q_len, k_len], (&device, DType::F32)).mask_fill(hidden, f32::MIN);
        scores = scores + bias.reshape([1, 1, 1, q_len, k_len]);
    }
    let probs = softmax(scores, 4).cast(dtype).reshape([batch, kv_heads, groups * q_len, k_len]);
    probs.matmul(v).reshape([batch, q_heads, q_len, head_dim])
}

/// Decode attention one row at a time, row `b` at `positions[b]` over its store row
/// (`at.store_row(b)`: its own sequence, or the first for consecutive rows of one sequence) of
/// `store` ([`KvView::Decode`] at a host position): for rows at positions of their own where
/// one launch cannot serve them all (the references, and head sizes without a decode kernel).
///
/// - `q`: `[positions.len(), q_heads, 1, head_dim]`; returns the same shape.
pub(crate) fn decode_each_sequence<B: crate::GemmaBackend>(
    q: Tensor<B, 4>,
    store: &crate::KvStore<B>,
    (at, positions): (&crate::StepPosition<B>, &[usize]),
    options: &AttentionOptions,
) -> Result<Tensor<B, 4>, crate::ReadBackError> {
    let rows = positions.iter().enumerate().map(|(b, &p)| {
        let row = at.store_row(b);
        let rows = store.rows(row..row + 1);
        let view = crate::KvView::Decode { store: &rows, position: crate::StepPosition::Host(p), blocks: None };
        B::grouped_attention(q.clone().slice(burn::tensor::s![b..b + 1, .., .., ..]), view, options)
    });
    Ok(Tensor::cat(rows.collect::<Result<Vec<_>, _>>()?, 0))
}

/// Largest head size the kernels take: the tiled kernel stages a key and a value row (f32) per
/// key of its tile in shared memory (about 17 KiB at one key per tile for this size).
pub const MAX_HEAD_DIM: usize = 2048;

/// Whether the attention kernels (and RoPE, which rotates pairs) take heads of `dim` elements;
/// the reason where not.
pub fn check_head_dim(dim: usize) -> Result<(), String> {
    if dim == 0 || !dim.is_multiple_of(2) {
        return Err(format!("must be positive and even for rotary embeddings, found {dim}"));
    }
    if dim > MAX_HEAD_DIM {
        return Err(format!("({dim}) is larger than the attention kernels take ({MAX_HEAD_DIM})"));
    }
    Ok(())
}

mod blocked;
pub(crate) mod choice;
mod decode;
pub(crate) mod flash;
mod merge;
mod tiled;

pub use choice::{FlashLayout, Prefetch, PrefillAttention, DEFAULT_LAYOUTS};
pub use flash::FlashTiling;

/// Multiply-adds of one block's score product (every KV head) from which
/// [`PrefillAttention::Auto`] takes the blocked GEMM path over flash attention for dense,
/// global layers: there the product runs through cuBLASLt near the bf16 rate (H200, bf16,
/// `docs/runs/gpu/2026-11-28-flash.md` call 3: Gemma 3 12B's global layer over 16k keys, 34G per
/// block, 129 TFLOP/s blocked against 89 flash; at 8k keys, 17G, both 80; Gemma 3 4B at 16k,
/// 17G, 67 blocked against 83 flash).
pub const BLOCKED_MIN_MACS: usize = 32_000_000_000;

/// Keys beyond which [`PrefillAttention::Auto`] leaves a launch of fewer flash cubes than an
/// eighth of the multiprocessors to the other kernels: flash attention does not split the keys over
/// cubes, so a short chunk after a long cache (a prompt continuing a cached prefix) would walk
/// them on a few multiprocessors, where the tiled kernel splits them and the blocked path's
/// products spread them.
pub const FLASH_FEW_CUBES_KEYS: usize = 2048;

/// What [`flash_by_default`] decides on: a prompt's sizes and its keys' format and mask.
#[derive(Debug, Clone, Copy)]
struct PromptShape {
    batch: usize,
    q_heads: usize,
    kv_heads: usize,
    q_len: usize,
    k_len: usize,
    dim: usize,
    dense: bool,
    window: Option<usize>,
}

/// Whether [`PrefillAttention::Auto`] runs `shape` in flash attention with `tiling` on a device
/// of `sms` multiprocessors: at least [`FLASH_MIN_QUERIES`] positions, enough cubes or few keys
/// ([`FLASH_FEW_CUBES_KEYS`]), and not a dense global layer whose score products reach
/// [`BLOCKED_MIN_MACS`].
fn flash_by_default(shape: PromptShape, tiling: &FlashTiling, sms: usize) -> bool {
    let PromptShape { batch, q_heads, kv_heads, q_len, k_len, dim, dense, window } = shape;
    let cubes = (q_heads / kv_heads * q_len).div_ceil(tiling.bq()) * batch * kv_heads * (tiling.dim / tiling.dv);
    let block = q_len.min(blocked::BLOCK_QUERIES);
    let blocked = dense && window.is_none() && q_heads * block * k_len * dim >= BLOCKED_MIN_MACS;
    q_len >= FLASH_MIN_QUERIES && (8 * cubes >= sms || k_len <= FLASH_FEW_CUBES_KEYS) && !blocked
}

/// [`flash_by_default`] for `q` over `kv` on `q`'s device.
fn flash_by_default_for<R: burn_cubecl::CubeRuntime>(
    q: &burn_cubecl::tensor::CubeTensor<R>,
    kv: &kernel::Kv<R>,
    options: &AttentionOptions,
    tiling: &FlashTiling,
) -> bool {
    let [batch, q_heads, q_len, dim] = [q.meta.shape()[0], q.meta.shape()[1], q.meta.shape()[2], q.meta.shape()[3]];
    let (kv_heads, k_len, _) = kv.sizes();
    let dense = matches!(kv, kernel::Kv::Dense { .. });
    let shape = PromptShape { batch, q_heads, kv_heads, q_len, k_len, dim, dense, window: options.mask.window };
    flash_by_default(shape, tiling, crate::quant::mma::multiprocessors(&q.client))
}

/// Fewest query positions [`PrefillAttention::Auto`] gives flash attention (fewer take the
/// tiled kernel, which also splits the keys over cubes).
pub const FLASH_MIN_QUERIES: usize = flash::MIN_QUERIES;

/// What every attention kernel shares: the launch sizes, the keys and values as kernels read them,
/// the int8 code decoding and the dispatch between the decode and tiled kernels.
pub(crate) mod kernel {
    use super::AttentionOptions;
    use crate::cube::empty;
    pub use crate::kv::paged::kernel::Table;
    use crate::step::kernel::Position;
    use burn_cubecl::{tensor::CubeTensor, CubeRuntime};
    use cubecl::prelude::*;

    /// Sizes the attention kernels read (their tensors are passed as arrays).
    #[derive(CubeLaunch, CubeType, Clone, Copy)]
    pub struct AttentionShape {
        pub batch: usize,
        pub q_heads: usize,
        pub q_len: usize,
        pub kv_heads: usize,
        /// Slots per KV head of an int8 cache (unused for dense keys and values): per block
        /// of a paged one.
        pub slots: usize,
    }

    /// The host side of an [`AttentionShape`].
    #[derive(Clone, Copy, Debug)]
    pub struct ShapeSizes {
        pub batch: usize,
        pub q_heads: usize,
        pub q_len: usize,
        pub kv_heads: usize,
        pub slots: usize,
    }

    /// `sizes` as a launch argument for runtime `L` (the tensor's own, or the graph recorder).
    pub fn shape_arg<L: Runtime>(sizes: ShapeSizes) -> AttentionShapeLaunch<L> {
        let ShapeSizes { batch, q_heads, q_len, kv_heads, slots } = sizes;
        AttentionShapeLaunch::new(batch, q_heads, q_len, kv_heads, slots)
    }

    /// Byte `n` of an int8 KV word as the signed code (`stored - 128`, exact through the
    /// mantissa of 2^23).
    #[cube]
    pub(super) fn int8_code(word: u32, #[comptime] n: usize) -> f32 {
        f32::reinterpret(((word >> comptime!((n * 8) as u32)) & 255u32) | 0x4B00_0000u32) - 8_388_736.0f32
    }

    /// Whole tiles of keys `[lo, hi)`.
    #[derive(CubeType)]
    pub(super) struct TileRange {
        pub lo: usize,
        pub hi: usize,
    }

    /// The tiles of `bk` keys holding every key visible from query positions `i_min..=i_max`
    /// (indices from `q_offset`; keys from `k_offset`, `k_len` of them): the causal bound of
    /// the last position and, with a window, the window of the first.
    // Kernel code cannot call `usize::div_ceil` (not a CubeCL intrinsic).
    #[allow(clippy::too_many_arguments, clippy::manual_div_ceil)]
    #[cube]
    pub(super) fn visible_tiles(
        i_min: usize,
        i_max: usize,
        k_len: usize,
        q_offset: u32,
        k_offset: u32,
        window: u32,
        #[comptime] has_window: bool,
        #[comptime] bk: usize,
    ) -> TileRange {
        let mut j_hi = i64::cast_from(q_offset as usize + i_max) - i64::cast_from(k_offset) + 1;
        j_hi = min(j_hi, i64::cast_from(k_len));
        let mut j_lo = 0i64;
        if has_window {
            j_lo = max(
                i64::cast_from(q_offset as usize + i_min) + 1 - i64::cast_from(window) - i64::cast_from(k_offset),
                0i64,
            );
        }
        let mut lo = 0usize;
        let mut hi = 0usize;
        if j_hi > j_lo {
            lo = usize::cast_from(j_lo) / bk;
            hi = (usize::cast_from(j_hi) + bk - 1) / bk;
        }
        TileRange { lo, hi }
    }

    /// Cubes that keep a GPU busy; fewer than this and the key range is split.
    pub(super) const TARGET_CUBES: usize = 512;
    pub(super) const MAX_SPLITS: usize = 256;

    /// Keys and values as the kernels read them (built per launch, never stored).
    #[allow(clippy::large_enum_variant)]
    #[derive(Clone)]
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

    impl<R: CubeRuntime> Kv<R> {
        /// `(kv_heads, keys attended, slots per head)`.
        pub(super) fn sizes(&self) -> (usize, usize, usize) {
            match self {
                Kv::Dense { k, .. } => (k.meta.shape()[1], k.meta.shape()[2], k.meta.shape()[2]),
                Kv::Int8 { k_scales, len, .. } => (k_scales.meta.shape()[1], *len, k_scales.meta.shape()[2]),
            }
        }

        /// The kernels' six key/value arguments `[k, v, k_codes, k_scales, v_codes, v_scales]`;
        /// the ones the format does not use get `stand_in` (never read or written, and an array
        /// argument is only a buffer: its element type does not have to match).
        pub(super) fn args(self, stand_in: &CubeTensor<R>) -> [CubeTensor<R>; 6] {
            let s = || stand_in.clone();
            match self {
                Kv::Dense { k, v } => [k, v, s(), s(), s(), s()],
                Kv::Int8 { k_codes, k_scales, v_codes, v_scales, .. } => {
                    [s(), s(), k_codes, k_scales, v_codes, v_scales]
                }
            }
        }
    }

    /// `q`: `[batch, q_heads, q_len, dim]` (any strides) over `kv`. Returns a contiguous `[batch,
    /// q_heads, q_len, dim]` in `q`'s dtype: through the decode kernel where it applies (one
    /// query position, see [`super::decode::tiling`]), else the tiled kernel.
    ///
    /// With `position` on the device (one decode query over a whole store, see
    /// [`crate::StepPosition`]), the decode kernel reads it and derives the visible slots and
    /// the mask offsets; only `options.mask.window` is used. Shapes the decode kernel does not
    /// take read the position back to the host (which a recorded step cannot replay), and fail
    /// only where that read fails.
    pub fn attention<R: CubeRuntime>(
        q: CubeTensor<R>,
        kv: Kv<R>,
        options: &AttentionOptions,
        position: Option<Position<R>>,
        blocks: Option<Table<R>>,
    ) -> Result<CubeTensor<R>, crate::ReadBackError> {
        let [batch, q_heads, q_len, dim] = [q.meta.shape()[0], q.meta.shape()[1], q.meta.shape()[2], q.meta.shape()[3]];
        let out = empty(&q, [batch, q_heads, q_len, dim], q.dtype);
        if batch * q_heads * q_len * dim == 0 {
            return Ok(out);
        }
        let shared = q.client.properties().hardware.max_shared_memory_size;
        let tiling = super::decode::tiling(&q, &kv, shared);
        if blocks.is_some() && (tiling.is_none() || position.is_none()) {
            // The caller gathers such sequences first ([`decode_kernel_applies`]).
            return Err(crate::ReadBackError {
                what: "a block table",
                reason: format!(
                    "a paged store needs the decode attention kernel at a device position (head size {dim})"
                ),
            });
        }
        Ok(match (tiling, position) {
            (Some(tiling), position) => super::decode::attention(q, kv, out, tiling, options, position, blocks),
            (None, None | Some(Position::Host(_))) => {
                prefill(q, kv, out, options, crate::tuning::current(|t| t.prefill_attention))
            }
            (None, Some(position @ Position::Device { .. })) if position.per_row() => {
                // The caller runs such sequences one at a time ([`decode_kernel_applies`]).
                return Err(crate::ReadBackError {
                    what: "the step's positions",
                    reason: format!("positions per sequence need the decode attention kernel (head size {dim})"),
                });
            }
            (None, Some(Position::Device { values, .. })) => {
                crate::graph::unsupported(|| format!("no decode attention kernel for head size {dim}"));
                let p = read_position(&values)?;
                let (_, k_len, _) = kv.sizes();
                // The causal mask of the position hides the slots past the visible ones.
                let (_, mask) = crate::step::decode_visible(p, k_len, options.mask.window);
                super::tiled::attention(q, kv, out, &AttentionOptions { mask, ..*options })
            }
        })
    }

    /// Attention of `q` over `kv` with one mask for every sequence (a prompt, or decode shapes
    /// the decode kernel does not take) into `out`, by `choice` where the kernel it names
    /// takes the shapes, else by the next one that does: flash attention on the matrix units,
    /// the blocked GEMM path (dense keys and values), the tiled kernel (everything).
    pub(crate) fn prefill<R: CubeRuntime>(
        q: CubeTensor<R>,
        kv: Kv<R>,
        out: CubeTensor<R>,
        options: &AttentionOptions,
        choice: super::PrefillAttention,
    ) -> CubeTensor<R> {
        use super::PrefillAttention as P;
        let q_len = q.meta.shape()[2];
        let flash = match choice {
            P::Auto | P::Flash => super::flash::tiling(&q, &kv),
            P::Blocked | P::Tiled => None,
        };
        let flash = flash.filter(|t| choice == P::Flash || super::flash_by_default_for(&q, &kv, options, t));
        if let Some(tiling) = flash {
            super::flash::attention(&q, kv, &out, options, tiling);
            return out;
        }
        match kv {
            // Prefill-sized blocks of dense keys on matrix units: the GEMM path.
            Kv::Dense { k, v }
                if choice != P::Tiled
                    && q_len >= super::blocked::MIN_QUERIES
                    && crate::gemm::kernel::has_matrix_units(&q.client, q.dtype)
                    && super::blocked::applies(q_len, k.meta.shape()[2], options)
                    && super::blocked::attention(&q, &k, &v, &out, options).is_ok() =>
            {
                out
            }
            kv => super::tiled::attention(q, kv, out, options),
        }
    }

    /// Whether one decode query per sequence of `q` over `kv` runs in the decode kernel, which
    /// reads a position per sequence; the other kernels take one mask for the whole batch.
    pub fn decode_kernel_applies<R: CubeRuntime>(q: &CubeTensor<R>, kv: &Kv<R>) -> bool {
        let shared = q.client.properties().hardware.max_shared_memory_size;
        super::decode::tiling(q, kv, shared).is_some()
    }

    /// `values[0]` (its low 32 bits, as the kernels read it) of a step buffer, read back to the
    /// host.
    fn read_position<R: CubeRuntime>(values: &CubeTensor<R>) -> Result<usize, crate::ReadBackError> {
        let fail = |reason: String| crate::ReadBackError { what: "the step's position", reason };
        let bytes = values.client.read_one(values.handle.clone()).map_err(|e| fail(format!("{e:?}")))?;
        match bytes.get(..4) {
            Some(b) => Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]) as usize),
            None => Err(fail(format!("the buffer holds {} bytes", bytes.len()))),
        }
    }
}

/// Naive attention on host vectors in f64 (`[batch, heads, len, dim]`, contiguous), for checking
/// the reference and the kernel without depending on any backend's matmul precision.
#[cfg(test)]
pub(crate) fn naive(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    [batch, hq, hkv, tq, tk, d]: [usize; 6],
    options: &AttentionOptions,
) -> Vec<f32> {
    let AttentionOptions { mask, scale, softcap } = *options;
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
            let options = AttentionOptions { mask, scale, softcap: None };
            let got = reference(q.clone(), k.clone(), v.clone(), &options).into_data();
            let vec = |t: Tensor<TestBackend, 4>| t.into_data().to_vec::<f32>().unwrap();
            let expected = super::naive(&vec(q), &vec(k), &vec(v), [1, hq, hkv, tq, tk, d], &options);
            assert!(got.to_vec::<f32>().unwrap().iter().all(|x| x.is_finite()));
            got.assert_approx_eq::<f32>(&TensorData::new(expected, [1, hq, tq, d]), Default::default());
        }
    }

    /// The default kernel choice on Gemma's shapes (an H200's 132 multiprocessors, the
    /// measured Hopper layouts): the cases of `docs/runs/gpu/2026-11-28-flash.md`, a short chunk
    /// after a long cache, and a chunk too short for flash.
    #[test]
    fn default_prompt_kernel() {
        let shape = |q_heads, kv_heads, q_len, k_len, dim, window| PromptShape {
            batch: 1,
            q_heads,
            kv_heads,
            q_len,
            k_len,
            dim,
            dense: true,
            window,
        };
        let flash = |s: PromptShape| {
            let tiling = FlashTiling::choose(s.dim, 227 << 10).expect("a Hopper tiling");
            flash_by_default(s, &tiling, 132)
        };
        // Measured faster in flash: 1B and 4B global, 4B local at 16k, 12B global at 8k (a tie).
        assert!(flash(shape(4, 1, 16384, 16384, 256, None)));
        assert!(flash(shape(8, 4, 16384, 16384, 256, None)));
        assert!(flash(shape(8, 4, 16384, 16384, 256, Some(1024))));
        assert!(flash(shape(16, 8, 8192, 8192, 256, None)));
        // Measured faster blocked: 12B global at 16k (34G multiply-adds per block).
        assert!(!flash(shape(16, 8, 16384, 16384, 256, None)));
        // The same layer's int8 cache has no blocked path: flash.
        assert!(flash(PromptShape { dense: false, ..shape(16, 8, 16384, 16384, 256, None) }));
        // A default chunk of 2,048 after 2,048 cached positions on the 1B: 64 cubes.
        assert!(flash(shape(4, 1, 2048, 4096, 256, None)));
        // 64 positions after 30,000 cached ones on one KV head: two cubes would walk them all.
        assert!(!flash(shape(4, 1, 64, 30064, 256, None)));
        assert!(flash(shape(4, 1, 64, 2000, 256, None)));
        assert!(!flash(shape(4, 1, FLASH_MIN_QUERIES - 1, 100, 256, None)));
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
    use super::{AttentionMask, AttentionOptions};
    use crate::gpu_test::{assert_close, seed, tolerance};
    use crate::kv::KvView;
    use crate::GemmaBackend;
    use burn::tensor::{DType, Distribution, Tensor, TensorData};

    /// `(batch, q_heads, kv_heads, q_len, k_len, head_dim, q_offset, k_offset, window, softcap)`.
    type Case = (usize, usize, usize, usize, usize, usize, usize, usize, Option<usize>, Option<f64>);

    const CASES: [Case; 19] = [
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
        // Gemma 4's full layers: head size 512, prefill and decode (8 query heads per KV head).
        (1, 8, 1, 13, 13, 512, 0, 0, None, None),
        (1, 16, 2, 1, 301, 512, 300, 0, None, None),
        // Prefill long enough for the GEMM path where the device has matrix units: several
        // query blocks in a window; a chunk after a cache with softcap; head size 512.
        (1, 8, 4, 600, 600, 256, 0, 0, Some(200), None),
        (2, 8, 2, 130, 330, 128, 200, 0, None, Some(50.0)),
        (1, 8, 1, 96, 96, 512, 0, 0, None, None),
        // SigLIP's heads of 72 (padded to 96 for the flash kernel on CUDA), every query seeing
        // every key.
        (2, 16, 16, 77, 77, 72, 76, 0, None, None),
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
            let options = AttentionOptions { mask, scale, softcap };
            let kv = KvView::Dense { keys: k.clone(), values: v.clone() };
            let got = B::grouped_attention(q.clone(), kv, &options).expect("host positions read nothing back");
            assert_eq!(got.dtype(), dtype);
            // Against f64 host attention on the same (rounded) inputs: a reference through the
            // backend's matmul would inherit its precision (TF32-class on CUDA).
            let host = |t: Tensor<B, 4>| t.cast(DType::F32).into_data().to_vec::<f32>().expect("f32");
            let dims = [batch, hq, hkv, tq, tk, dim];
            let expected = super::naive(&host(q), &host(k), &host(v), dims, &options);
            let expected =
                Tensor::<B, 4>::from_data(TensorData::new(expected, [batch, hq, tq, dim]), (device, DType::F32));
            let what = format!("attention b{batch} hq{hq} hkv{hkv} tq{tq} tk{tk} d{dim} {mask:?} softcap {softcap:?}");
            assert_close(got, expected, tolerance(dtype), &what);
        }
    }

    /// A store of `shape` in `format` with every slot random, `[q_batch, q_heads, 1, dim]`
    /// random queries, and decode options with `window` (the mask offsets follow from the
    /// position).
    fn decode_inputs<B: GemmaBackend>(
        shape: [usize; 4],
        format: crate::KvFormat,
        [q_batch, q_heads]: [usize; 2],
        window: Option<usize>,
        dtype: DType,
        device: &B::Device,
    ) -> (crate::KvStore<B>, Tensor<B, 4>, AttentionOptions) {
        let normal = Distribution::Normal(0.0, 1.0);
        let rows = || Tensor::<B, 4>::random(shape, normal, device).cast(dtype);
        let store = B::kv_write(B::kv_zeros(shape, format, device), rows(), rows(), 0);
        let dim = shape[3];
        let q = Tensor::<B, 4>::random([q_batch, q_heads, 1, dim], normal, device).cast(dtype);
        let mask = AttentionMask { q_offset: 0, k_offset: 0, window };
        (store, q, AttentionOptions { mask, scale: 1.0 / (dim as f64).sqrt(), softcap: None })
    }

    /// `store`'s sequences (`slots` each) copied into a pool of blocks (the largest of 16, 8,
    /// 4, 3, 2 or 1 slots that divides `slots`) in shuffled order with a spare block, and
    /// their table.
    pub(crate) fn paged_copy<B: GemmaBackend>(
        store: &crate::KvStore<B>,
        format: crate::KvFormat,
        slots: usize,
        device: &B::Device,
    ) -> (crate::KvStore<B>, crate::BlockTable<B>) {
        let [sequences, heads, _, dim] = store.shape();
        let block = [16, 8, 4, 3, 2, 1].into_iter().find(|b| slots.is_multiple_of(*b)).unwrap_or(1);
        let width = slots / block;
        let count = sequences * width + 1;
        // A fixed shuffle: block ids stride through the pool (the count is odd for the stride
        // 7 unless it divides it).
        let stride = if count.is_multiple_of(7) { 1 } else { 7 };
        let ids: Vec<u32> = (0..count - 1).map(|i| ((i * stride + 1) % count) as u32).collect();
        let rows: Vec<Vec<u32>> = ids.chunks(width).map(<[u32]>::to_vec).collect();
        let mut pool = B::kv_zeros([count, heads, block, dim], format, device);
        for (b, row) in rows.iter().enumerate() {
            pool = crate::kv::paged::scatter_sequence(pool, &store.rows(b..b + 1), row, block, slots);
        }
        (pool, crate::BlockTable::from_rows(&rows, block, device))
    }

    /// A tensor's values on the host in f32.
    fn host<B: GemmaBackend>(t: Tensor<B, 4>) -> Vec<f32> {
        t.cast(DType::F32).into_data().to_vec::<f32>().expect("f32")
    }

    /// One decode query over a whole store at a position given on the host and read on the
    /// device ([`KvView::Decode`]): full stores and rings that wrapped, dense and int8, bounds
    /// far past the position (the device form sizes its splits for the bound), against f64
    /// attention over the visible slots.
    pub fn decode_at_position<B: GemmaBackend>(device: &B::Device, dtype: DType) {
        use crate::{KvFormat, StepPosition, StepRows};
        seed::<B>(device, "decode_at_position");
        // (batch, q heads, kv heads, slots, dim, position, window, bound)
        let cases = [
            (1, 4, 1, 600, 256, 0, None, 1023),
            (1, 4, 1, 600, 256, 517, None, 599),
            (2, 8, 2, 8, 64, 21, Some(8), 255),
            (1, 2, 2, 33, 128, 32, Some(33), 4095),
            (1, 3, 1, 16, 12, 5, None, 15),
            (1, 8, 1, 40, 512, 37, None, 255),
        ];
        for (batch, hq, hkv, slots, dim, position, window, bound) in cases {
            for format in [KvFormat::Dense(dtype), KvFormat::Int8] {
                if format == KvFormat::Int8 && dim % 4 != 0 {
                    continue;
                }
                let (store, q, options) =
                    decode_inputs::<B>([batch, hkv, slots, dim], format, [batch, hq], window, dtype, device);
                let (visible, mask) = crate::step::decode_visible(position, slots, window);
                let (k, v) = B::kv_read(&store, 0..visible, DType::F32);
                let exact = AttentionOptions { mask, ..options };
                let expected =
                    super::naive(&host(q.clone()), &host(k), &host(v), [batch, hq, hkv, 1, visible, dim], &exact);
                let expected =
                    Tensor::<B, 4>::from_data(TensorData::new(expected, [batch, hq, 1, dim]), (device, DType::F32));
                let values = Tensor::<B, 1, burn::tensor::Int>::from_data([position as i64], device);
                for (how, at) in [
                    ("host", StepPosition::Host(position)),
                    ("device", StepPosition::Device { values, bound, rows: StepRows::Sequences }),
                ] {
                    let view = KvView::Decode { store: &store, position: at, blocks: None };
                    let got = B::grouped_attention(q.clone(), view, &options).expect("the step position reads back");
                    let what = format!(
                        "decode b{batch} hq{hq} hkv{hkv} slots {slots} d{dim} at {position} window {window:?} {format} position on the {how}"
                    );
                    assert_close(got, expected.clone(), tolerance(dtype), &what);
                }
            }
        }
    }

    /// One decode query per sequence, each at its own position read on the device (many
    /// requests served at once), for the first sequences of a larger store: full stores and
    /// rings, some wrapped and some not, dense and int8, head sizes the decode kernel takes and
    /// ones it does not (run one sequence at a time), against f64 attention over each
    /// sequence's own visible slots.
    pub fn decode_per_sequence<B: GemmaBackend>(device: &B::Device, dtype: DType) {
        use crate::{KvFormat, StepPosition, StepRows};
        seed::<B>(device, "decode_per_sequence");
        // (store batch, q heads, kv heads, slots, dim, positions, window, bound)
        type Case = (usize, usize, usize, usize, usize, &'static [usize], Option<usize>, usize);
        let cases: [Case; 5] = [
            (4, 4, 1, 300, 256, &[0, 299, 17], None, 511),
            (3, 8, 2, 8, 64, &[3, 21, 7], Some(8), 255),
            (2, 2, 2, 33, 128, &[40, 1], Some(33), 4095),
            (5, 8, 1, 40, 512, &[37, 2, 39, 11, 20], None, 255),
            // 35 elements per lane do not split over 32 lanes: no decode kernel.
            (3, 4, 2, 20, 70, &[19, 4], None, 31),
        ];
        for (store_batch, hq, hkv, slots, dim, positions, window, bound) in cases {
            let batch = positions.len();
            for format in [KvFormat::Dense(dtype), KvFormat::Int8] {
                if format == KvFormat::Int8 && dim % 4 != 0 {
                    continue;
                }
                let (store, q, options) =
                    decode_inputs::<B>([store_batch, hkv, slots, dim], format, [batch, hq], window, dtype, device);
                let mut expected = Vec::new();
                for (b, &position) in positions.iter().enumerate() {
                    let (visible, mask) = crate::step::decode_visible(position, slots, window);
                    let (k, v) = B::kv_read(&store.rows(b..b + 1), 0..visible, DType::F32);
                    let q = q.clone().slice(burn::tensor::s![b..b + 1, .., .., ..]);
                    let exact = AttentionOptions { mask, ..options };
                    expected.extend(super::naive(&host(q), &host(k), &host(v), [1, hq, hkv, 1, visible, dim], &exact));
                }
                let expected =
                    Tensor::<B, 4>::from_data(TensorData::new(expected, [batch, hq, 1, dim]), (device, DType::F32));
                let own: Vec<i64> = positions.iter().map(|&p| p as i64).collect();
                let values = Tensor::<B, 1, burn::tensor::Int>::from_data(TensorData::new(own, [batch]), device);
                let at = StepPosition::Device { values, bound, rows: StepRows::Sequences };
                let view = KvView::Decode { store: &store, position: at.clone(), blocks: None };
                let got = B::grouped_attention(q.clone(), view, &options).expect("the step positions read back");
                let what = format!(
                    "decode per sequence b{batch}/{store_batch} hq{hq} hkv{hkv} slots {slots} d{dim} at {positions:?} window {window:?} {format}"
                );
                assert_close(got, expected.clone(), tolerance(dtype), &what);
                // The same sequences paged: their slots in shuffled blocks of a pool.
                let (pool, table) = paged_copy(&store, format, slots, device);
                let view = KvView::Decode { store: &pool, position: at, blocks: Some(&table) };
                let got = B::grouped_attention(q.clone(), view, &options).expect("the step positions read back");
                let what = format!("{what}, paged in blocks of {}", table.block_size);
                assert_close(got, expected, tolerance(dtype), &what);
            }
        }
    }

    /// Consecutive rows of one sequence (a verify step): row `b` at `position + b` over the
    /// store's first sequence (of two), a store of a slot per position with and without a
    /// sliding window (the window then cuts each row's keys at its own position), dense and
    /// int8, head sizes the decode kernel takes and one it does not, against f64 attention of
    /// each row over the keys up to its position.
    pub fn decode_consecutive_rows<B: GemmaBackend>(device: &B::Device, dtype: DType) {
        use crate::{KvFormat, StepPosition, StepRows};
        seed::<B>(device, "decode_consecutive_rows");
        // (q heads, kv heads, slots, dim, position, rows, window, bound)
        let cases = [
            (4, 1, 600, 256, 517, 5, None, 1023),
            (8, 2, 64, 64, 40, 7, Some(8), 63),
            (2, 2, 40, 128, 0, 3, Some(33), 255),
            (8, 1, 50, 512, 33, 4, Some(16), 49),
            (4, 2, 30, 70, 19, 5, Some(6), 31),
        ];
        for (hq, hkv, slots, dim, position, rows, window, bound) in cases {
            for format in [KvFormat::Dense(dtype), KvFormat::Int8] {
                if format == KvFormat::Int8 && dim % 4 != 0 {
                    continue;
                }
                let (store, q, options) =
                    decode_inputs::<B>([2, hkv, slots, dim], format, [rows, hq], window, dtype, device);
                let mut expected = Vec::new();
                for b in 0..rows {
                    let p = position + b;
                    let (visible, mask) = crate::step::decode_visible(p, usize::MAX, window);
                    let (k, v) = B::kv_read(&store.rows(0..1), 0..visible, DType::F32);
                    let q = q.clone().slice(burn::tensor::s![b..b + 1, .., .., ..]);
                    let exact = AttentionOptions { mask, ..options };
                    expected.extend(super::naive(&host(q), &host(k), &host(v), [1, hq, hkv, 1, visible, dim], &exact));
                }
                let expected =
                    Tensor::<B, 4>::from_data(TensorData::new(expected, [rows, hq, 1, dim]), (device, DType::F32));
                let values = Tensor::<B, 1, burn::tensor::Int>::from_data([position as i64], device);
                let at = StepPosition::Device { values, bound, rows: StepRows::Consecutive };
                let view = KvView::Decode { store: &store, position: at, blocks: None };
                let got = B::grouped_attention(q.clone(), view, &options).expect("the step position reads back");
                let what = format!(
                    "decode of {rows} consecutive rows hq{hq} hkv{hkv} slots {slots} d{dim} from {position} window {window:?} {format}"
                );
                assert_close(got, expected, tolerance(dtype), &what);
            }
        }
    }

    gpu_tests!(
        attention_matches_reference => attention,
        decode_at_position_matches_reference => decode_at_position,
        decode_per_sequence_matches_reference => decode_per_sequence,
        decode_consecutive_rows_matches_reference => decode_consecutive_rows
    );
}
