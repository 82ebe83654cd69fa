//! Prefill attention on the matrix units, block of queries by block of queries.
//!
//! For each block of at most [`BLOCK_QUERIES`] query positions, the scores of the block's rows
//! (every query head of a KV head's group, every position) against the keys the block can see
//! come from one batched GEMM ([`crate::gemm`], tensor cores where the device has them), in f32;
//! one kernel masks them (causal and sliding window, from absolute positions), scales and
//! softcaps them and turns each row into probabilities in the compute dtype; a second GEMM over
//! the values gives the block's output. The scores of one block exist at a time: a prompt's
//! attention costs `BLOCK_QUERIES x visible keys` floats per head of memory, not its square.
//!
//! The keys a block cannot see (before a sliding window, after the block's last position) are
//! not multiplied; within the visible range the masked scores are computed and then dropped,
//! which for causal blocks of 512 queries is a quarter of the block's work at most.

// Kernel code cannot call `usize::div_ceil` (not a CubeCL intrinsic).
#![allow(clippy::manual_div_ceil)]

use super::{kernel::Kv, AttentionMask, AttentionOptions};
use crate::cube::{cube_index, cube_max, cube_sum, empty, grid, tanh_f32};
use crate::gemm::{kernel::transposed, kernel::tuned_matmul, GemmError};
use crate::graph::{arg, launch};
use burn::tensor::{DType, Shape};
use burn_cubecl::{
    kernel::{into_contiguous, slice},
    ops::reshape,
    tensor::CubeTensor,
    CubeRuntime,
};
use cubecl::prelude::*;

/// Query positions per block: large enough that both products run at the matrix units' speed
/// (`groups x 512` rows), small enough that a block's f32 scores stay within tens of MB.
pub const BLOCK_QUERIES: usize = 512;

/// Key ranges are widened backwards to multiples of this many keys where they can be.
const KEY_ALIGN: usize = 64;

/// Fewest query positions worth the GEMM path (shorter prompts take the tiled kernel).
pub const MIN_QUERIES: usize = 64;

/// Units per softmax row.
const ROW_UNITS: usize = 256;

/// Masks, scales, softcaps and softmaxes each row of `scores` (`[rows, keys]`, f32) into
/// `probs` (same shape, `F`). Row `r` is query `r % block` of its block; query `i` sees key `j`
/// when `j <= first + i` and, with a window, `first + i - j < window` (`first`: the first
/// query's position minus the first key's). Masked keys get probability 0.
#[allow(clippy::too_many_arguments)]
#[cube(launch)]
fn softmax_rows_kernel<F: Float>(
    scores: &Array<f32>,
    probs: &mut Array<F>,
    keys: u32,
    block: u32,
    first: u32,
    window: u32,
    scale: f32,
    cap: f32,
    #[comptime] has_window: bool,
    #[comptime] has_cap: bool,
    #[define(F)] _dtype: StorageType,
) {
    let row = cube_index();
    let keys = keys as usize;
    let tid = UNIT_POS_X as usize;
    let rel = first as usize + row % block as usize;
    // Visible keys: [lo, hi).
    let hi = min(rel + 1, keys);
    let mut lo = 0usize;
    if has_window && rel + 1 > window as usize {
        lo = rel + 1 - window as usize;
    }
    let base = row * keys;
    let mut scratch = SharedMemory::<f32>::new(ROW_UNITS);

    let mut m = f32::new(-3.0e38);
    let mut j = lo + tid;
    while j < hi {
        m = max(m, score(scores[base + j], scale, cap, has_cap));
        j += ROW_UNITS;
    }
    let m = cube_max(m, &mut scratch);
    let mut z = 0.0f32;
    let mut j = lo + tid;
    while j < hi {
        z += f32::exp(score(scores[base + j], scale, cap, has_cap) - m);
        j += ROW_UNITS;
    }
    let z = cube_sum(z, &mut scratch);
    let inv = 1.0f32 / z;
    let mut j = tid;
    while j < keys {
        let mut p = 0.0f32;
        if j >= lo && j < hi {
            p = f32::exp(score(scores[base + j], scale, cap, has_cap) - m) * inv;
        }
        probs[base + j] = F::cast_from(p);
        j += ROW_UNITS;
    }
}

#[cube]
fn score(s: f32, scale: f32, cap: f32, #[comptime] has_cap: bool) -> f32 {
    let s = s * scale;
    if has_cap {
        tanh_f32(s / cap) * cap
    } else {
        s
    }
}

/// Reference of [`softmax_rows_kernel`] on host vectors (tests).
#[cfg(test)]
pub(crate) fn softmax_rows_reference(
    scores: &[f32],
    keys: usize,
    block: usize,
    first: usize,
    window: Option<usize>,
    scale: f32,
    cap: Option<f32>,
) -> Vec<f32> {
    scores
        .chunks(keys)
        .enumerate()
        .flat_map(|(row, s)| {
            let rel = first + row % block;
            let visible = |j: usize| j <= rel && window.is_none_or(|w| rel - j < w);
            let val = |x: f32| {
                let x = x as f64 * scale as f64;
                cap.map_or(x, |c| (x / c as f64).tanh() * c as f64)
            };
            let m = (0..keys).filter(|&j| visible(j)).map(|j| val(s[j])).fold(f64::NEG_INFINITY, f64::max);
            let z: f64 = (0..keys).filter(|&j| visible(j)).map(|j| (val(s[j]) - m).exp()).sum();
            (0..keys)
                .map(move |j| if visible(j) { ((val(s[j]) - m).exp() / z) as f32 } else { 0.0 })
                .collect::<Vec<_>>()
        })
        .collect()
}

/// [`softmax_rows_kernel`] over `scores` (`[.., rows, keys]`, contiguous f32): probabilities
/// in `dtype`, same shape.
pub(crate) fn softmax_rows<R: CubeRuntime>(
    scores: &CubeTensor<R>,
    dtype: DType,
    [block, first]: [usize; 2],
    options: &AttentionOptions,
) -> CubeTensor<R> {
    let shape = scores.meta.shape().to_vec();
    let keys = shape[shape.len() - 1];
    let rows = scores.meta.shape().num_elements() / keys.max(1);
    let probs = empty(scores, shape, dtype);
    if rows == 0 || keys == 0 {
        return probs;
    }
    launch!(softmax_rows_kernel(
        &scores.client,
        grid(rows),
        CubeDim::new_1d(ROW_UNITS as u32),
        arg(scores),
        arg(&probs),
        keys as u32,
        block as u32,
        first as u32,
        options.mask.window.unwrap_or(0) as u32,
        options.scale as f32,
        options.softcap.unwrap_or(1.0) as f32,
        options.mask.window.is_some(),
        options.softcap.is_some(),
        dtype.into(),
    ));
    probs
}

/// Whether [`attention`] takes this problem: every query sees its own position among the keys
/// (`k_offset <= q_offset` and the keys reach the last query), so no row is fully masked.
pub(crate) fn applies(q_len: usize, k_len: usize, options: &AttentionOptions) -> bool {
    let mask = options.mask;
    mask.k_offset <= mask.q_offset && mask.k_offset + k_len >= mask.q_offset + q_len
}

/// Attention of `q` (`[batch, q_heads, q_len, dim]`) over dense `k`, `v` (`[batch, kv_heads,
/// k_len, dim]`, any strides) written into `out` (contiguous `[batch, q_heads, q_len, dim]`),
/// block by block. `Err` when the GEMM refuses a product (the caller then runs the tiled
/// kernel); see [`applies`] for what the caller checks first.
pub(crate) fn attention<R: CubeRuntime>(
    q: &CubeTensor<R>,
    k: &CubeTensor<R>,
    v: &CubeTensor<R>,
    out: &CubeTensor<R>,
    options: &AttentionOptions,
) -> Result<(), GemmError> {
    let [batch, q_heads, q_len, dim] = [q.meta.shape()[0], q.meta.shape()[1], q.meta.shape()[2], q.meta.shape()[3]];
    let [kv_heads, k_len] = [k.meta.shape()[1], k.meta.shape()[2]];
    let groups = q_heads / kv_heads;
    let mask = options.mask;
    let dtype = q.dtype;
    for b in 0..batch {
        for i0 in (0..q_len).step_by(BLOCK_QUERIES) {
            let i1 = (i0 + BLOCK_QUERIES).min(q_len);
            let block = i1 - i0;
            // Keys the block sees: [j_lo, j_hi).
            let j_hi = (mask.q_offset + i1 - mask.k_offset).min(k_len);
            let j_lo = mask.window.map_or(0, |w| (mask.q_offset + i0 + 1).saturating_sub(w + mask.k_offset));
            // Whole multiples of 64 keys where the range can grow backwards (the extra keys
            // are masked): fewer shape classes for the GEMM's tuning, none with a ragged `k`.
            let j_lo = j_hi.saturating_sub((j_hi - j_lo).next_multiple_of(KEY_ALIGN));
            let keys = [b..b + 1, 0..kv_heads, j_lo..j_hi, 0..dim];
            if kv_heads * groups * block * dim * (j_hi - j_lo) < crate::gemm::MIN_TUNED_MACS {
                // Too small for the tuned kernels (the last block of a prompt a few tokens past
                // a multiple of the block): CubeCL's per-unit GEMM runs such a product in one
                // cube, 4.3 ms for the last query of a 513-token prompt on the H200
                // (`docs/runs/gpu/2026-11-27-prefill.md`, call 4), where the tiled kernel takes
                // microseconds.
                let qb = slice(q.clone(), &[b..b + 1, 0..q_heads, i0..i1, 0..dim]);
                let kv = Kv::Dense { k: slice(k.clone(), &keys), v: slice(v.clone(), &keys) };
                let mask =
                    AttentionMask { q_offset: mask.q_offset + i0, k_offset: mask.k_offset + j_lo, window: mask.window };
                let ob = empty(q, [1, q_heads, block, dim], dtype);
                let ob = super::tiled::attention(qb, kv, ob, &AttentionOptions { mask, ..*options });
                place_rows(&ob, out, b, i0);
                continue;
            }
            // `[1, kv_heads, groups * block, dim]`: the block's queries, grouped by KV head.
            let qb = into_contiguous(slice(q.clone(), &[b..b + 1, 0..q_heads, i0..i1, 0..dim]));
            let qb = reshape(qb, Shape::new([1, kv_heads, groups * block, dim]));
            let scores = tuned_matmul(qb, transposed(slice(k.clone(), &keys)), DType::F32)?;
            let first = mask.q_offset + i0 - (mask.k_offset + j_lo);
            let probs = softmax_rows(&scores, dtype, [block, first], options);
            drop(scores);
            let ob = tuned_matmul(probs, slice(v.clone(), &keys), dtype)?;
            place_rows(&ob, out, b, i0);
        }
    }
    Ok(())
}

/// Copies `block` (contiguous `[1, q_heads, rows, dim]` laid out as the GEMM wrote it) into
/// `out[b, :, first.., :]` (contiguous `[batch, q_heads, q_len, dim]`).
#[cube(launch)]
fn place_rows_kernel<F: Float>(
    block: &Array<F>,
    out: &mut Array<F>,
    rows: u32,
    q_len: u32,
    dim: u32,
    offset: u32,
    #[define(F)] _dtype: StorageType,
) {
    let idx = crate::cube::unit_index();
    if idx >= block.len() {
        terminate!();
    }
    let dim = dim as usize;
    let rows = rows as usize;
    let c = idx % dim;
    let r = (idx / dim) % rows;
    let h = idx / (dim * rows);
    out[offset as usize + (h * q_len as usize + r) * dim + c] = block[idx];
}

fn place_rows<R: CubeRuntime>(block: &CubeTensor<R>, out: &CubeTensor<R>, b: usize, first: usize) {
    let [q_heads, q_len, dim] = [out.meta.shape()[1], out.meta.shape()[2], out.meta.shape()[3]];
    let elements = block.meta.shape().num_elements();
    let rows = elements / (q_heads * dim);
    let (count, cube_dim) = crate::cube::elementwise(elements, 256);
    launch!(place_rows_kernel(
        &out.client,
        count,
        cube_dim,
        arg(block),
        arg(out),
        rows as u32,
        q_len as u32,
        dim as u32,
        ((b * q_heads * q_len + first) * dim) as u32,
        out.dtype.into(),
    ));
}

#[cfg(test)]
mod gpu {
    use super::{softmax_rows, softmax_rows_reference};
    use crate::attention::{naive, AttentionMask, AttentionOptions};
    use crate::cube::{float, float_strided, tensor, Cb};
    use crate::gpu_test::{assert_close, seed, tolerance};
    use burn::tensor::{DType, Distribution, Tensor, TensorData};
    use burn_cubecl::{BoolElement, CubeRuntime, FloatElement, IntElement};

    /// The softmax kernel on random scores, odd sizes, with and without window and softcap,
    /// against its host reference.
    fn softmax<R: CubeRuntime, F: FloatElement, I: IntElement, BT: BoolElement>(device: &R::Device, dtype: DType) {
        seed::<Cb<R, F, I, BT>>(device, "blocked softmax_rows");
        // (rows, keys, block, first, window, softcap)
        for (rows, keys, block, first, window, cap) in [
            (7, 13, 7, 6, None, None),
            (24, 300, 12, 200, Some(77), Some(30.0f64)),
            (9, 1025, 3, 1020, None, None),
            (40, 57, 20, 37, Some(5), None),
        ] {
            let scores = Tensor::<Cb<R, F, I, BT>, 2>::random([rows, keys], Distribution::Normal(0.0, 8.0), device);
            let host: Vec<f32> = scores.clone().into_data().to_vec().expect("f32");
            let mask = AttentionMask { q_offset: 0, k_offset: 0, window };
            let options = AttentionOptions { mask, scale: 0.7, softcap: cap };
            let got = tensor::<R, F, I, BT, 2>(softmax_rows(&float(scores), dtype, [block, first], &options));
            let expected = softmax_rows_reference(&host, keys, block, first, window, 0.7, cap.map(|c| c as f32));
            let expected = Tensor::<Cb<R, F, I, BT>, 2>::from_data(TensorData::new(expected, [rows, keys]), device);
            let what = format!("softmax_rows {rows}x{keys} block {block} first {first} window {window:?} cap {cap:?}");
            assert_close(got, expected, tolerance(dtype), &what);
        }
    }

    /// The whole blocked path (both GEMMs through the device's kernel, several blocks, GQA,
    /// window, softcap, a chunk continuing a cache) against f64 host attention.
    fn blocked<R: CubeRuntime, F: FloatElement, I: IntElement, BT: BoolElement>(device: &R::Device, dtype: DType) {
        seed::<Cb<R, F, I, BT>>(device, "blocked attention");
        let normal = Distribution::Normal(0.0, 1.0);
        // (batch, q_heads, kv_heads, q_len, k_len, dim, q_offset, k_offset, window, softcap)
        for (batch, hq, hkv, tq, tk, dim, q_offset, k_offset, window, softcap) in [
            (1, 4, 1, 70, 70, 64, 0, 0, None, None),
            (1, 4, 2, 530, 530, 32, 0, 0, Some(100), None),
            (2, 2, 1, 75, 120, 48, 45, 0, None, Some(30.0)),
            (1, 2, 2, 600, 650, 16, 600, 550, Some(70), None),
        ] {
            let q =
                Tensor::<Cb<R, F, I, BT>, 4>::random([batch, tq, hq, dim], normal, device).cast(dtype).swap_dims(1, 2);
            let k =
                Tensor::<Cb<R, F, I, BT>, 4>::random([batch, tk, hkv, dim], normal, device).cast(dtype).swap_dims(1, 2);
            let v = Tensor::<Cb<R, F, I, BT>, 4>::random([batch, hkv, tk, dim], normal, device).cast(dtype);
            let mask = AttentionMask { q_offset, k_offset, window };
            let options = AttentionOptions { mask, scale: 1.0 / (dim as f64).sqrt() * 2.0, softcap };
            assert!(super::applies(tq, tk, &options));
            let out = crate::cube::empty(&float(q.clone()), [batch, hq, tq, dim], dtype);
            super::attention(
                &float_strided(q.clone()),
                &float_strided(k.clone()),
                &float_strided(v.clone()),
                &out,
                &options,
            )
            .expect("blocked attention launches");
            let got = tensor::<R, F, I, BT, 4>(out);
            let host = |t: Tensor<Cb<R, F, I, BT>, 4>| t.cast(DType::F32).into_data().to_vec::<f32>().expect("f32");
            let expected = naive(&host(q), &host(k), &host(v), [batch, hq, hkv, tq, tk, dim], &options);
            let expected =
                Tensor::<Cb<R, F, I, BT>, 4>::from_data(TensorData::new(expected, [batch, hq, tq, dim]), device);
            let what = format!("blocked b{batch} hq{hq} hkv{hkv} tq{tq} tk{tk} d{dim} {mask:?} softcap {softcap:?}");
            assert_close(got, expected, tolerance(dtype), &what);
        }
    }

    #[cfg(feature = "wgpu")]
    mod wgpu {
        use burn::tensor::DType;
        use cubecl::wgpu::WgpuRuntime;

        #[test]
        fn softmax_rows_matches_reference_f32() {
            super::softmax::<WgpuRuntime, f32, i32, u32>(&Default::default(), DType::F32);
        }

        #[test]
        fn blocked_attention_matches_reference_f32() {
            super::blocked::<WgpuRuntime, f32, i32, u32>(&Default::default(), DType::F32);
        }
    }

    #[cfg(feature = "cuda")]
    mod cuda {
        use burn::tensor::DType;
        use cubecl::cuda::CudaRuntime;

        #[test]
        fn softmax_rows_matches_reference() {
            for dtype in [DType::F32, DType::BF16] {
                super::softmax::<CudaRuntime, f32, i32, u8>(&Default::default(), dtype);
            }
        }

        #[test]
        fn blocked_attention_matches_reference() {
            for dtype in [DType::F32, DType::BF16] {
                super::blocked::<CudaRuntime, f32, i32, u8>(&Default::default(), dtype);
            }
        }
    }
}
