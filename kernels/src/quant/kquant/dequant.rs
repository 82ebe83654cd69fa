//! K-quant weights made dense: the whole matrix (prompts: once per product, then the backend's
//! matmul) and the scaled embedding gather (only the rows asked for), one `lo` word (8 weights)
//! per unit, reference [`super::HostKQuant::value`].

// Kernel code cannot call `div_ceil` (not a CubeCL intrinsic).
#![allow(clippy::manual_div_ceil)]

use super::gemv::{scale_min, signed_byte, KPacked};
use crate::cube::{cube_index, elementwise, empty, grid, load_vector_size, unit_index};
use crate::graph::{arg, launch};
use burn::tensor::DType;
use burn_cubecl::{tensor::CubeTensor, CubeRuntime};
use cubecl::prelude::*;

/// The 8 weights of `lo` word `w` of `row` into `values` (`words` words per row).
#[allow(clippy::too_many_arguments)]
#[cube]
fn word_values<S: Float>(
    lo: &Array<u32>,
    hi: &Array<u32>,
    meta: &Array<u32>,
    supers: &Array<S>,
    row: usize,
    w: usize,
    words: usize,
    values: &mut Array<f32>,
    #[comptime] kind: u32,
) {
    let hb = comptime!(kind as usize);
    let per_row = words / 32;
    let block = row * per_row + w / 32;
    let word = lo[row * words + w];
    let mut high = 0u32;
    // The high bits of this word's 8 codes start at bit `high_at` of `high`.
    let mut high_at = 0u32;
    if comptime!(hb > 0) {
        // Q5_K: 32 codes (4 words) per high word; Q6_K: 16 (2 words).
        let per = comptime!(32 / hb / 8);
        high = hi[(row * words + w) / per];
        high_at = ((w % per) * 8 * hb) as u32;
    }
    let d = f32::cast_from(supers[block * comptime!(if kind == 2 { 1usize } else { 2usize })]);
    if comptime!(kind == 2) {
        // Weights `8w .. 8w + 8` share the scale of group `(w % 32) / 2` of 16.
        let g = (w % 32) / 2;
        let sc = signed_byte((meta[block * 4 + g / 4] >> ((g % 4) * 8) as u32) & 255u32);
        let scale = d * sc;
        #[unroll]
        for n in 0..8usize {
            let q = ((word >> comptime!(4 * n as u32)) & 15u32)
                | (((high >> (high_at + comptime!(2 * n as u32))) & 3u32) << 4u32);
            values[n] = scale * (f32::cast_from(q) - 32.0f32);
        }
    } else {
        let sm = scale_min(meta[block * 3], meta[block * 3 + 1], meta[block * 3 + 2], (w / 4) % 8);
        let dmin = f32::cast_from(supers[block * 2 + 1]);
        let scale = d * f32::cast_from(sm[0]);
        let min = dmin * f32::cast_from(sm[1]);
        #[unroll]
        for n in 0..8usize {
            let mut q = (word >> comptime!(4 * n as u32)) & 15u32;
            if comptime!(hb > 0) {
                q |= ((high >> (high_at + comptime!(n as u32))) & 1u32) << 4u32;
            }
            values[n] = scale * f32::cast_from(q) - min;
        }
    }
}

/// Dequantizes `total` `lo` words from row `first` on (`out` starts at that row), each unit
/// writing its word's 8 values as vectors of `N`.
#[allow(clippy::too_many_arguments)]
#[cube(launch)]
fn kdequantize_kernel<F: Float, S: Float, N: Size>(
    lo: &Array<u32>,
    hi: &Array<u32>,
    meta: &Array<u32>,
    supers: &Array<S>,
    out: &mut Array<Vector<F, N>>,
    words: u32,
    first: u32,
    total: u32,
    #[comptime] kind: u32,
    #[define(F, S)] _dtypes: [StorageType; 2],
) {
    let width = out.vector_size();
    let vectors = comptime!(8usize / width);
    let idx = unit_index();
    if idx >= total as usize {
        terminate!();
    }
    let words = words as usize;
    let at = first as usize * words + idx;
    let mut values = Array::<f32>::new(8usize);
    word_values::<S>(lo, hi, meta, supers, at / words, at % words, words, &mut values, kind);
    #[unroll]
    for j in 0..vectors {
        let mut v = Vector::<F, N>::empty();
        #[unroll]
        for n in 0..width {
            v[n] = F::cast_from(values[comptime!(j * width + n)]);
        }
        out[idx * vectors + j] = v;
    }
}

/// Rows `range` of the matrix, dense `[range.len(), cols]` in `dtype`.
pub fn dequantize_rows<R: CubeRuntime>(w: &KPacked<R>, range: std::ops::Range<usize>, dtype: DType) -> CubeTensor<R> {
    let [rows, cols] = w.shape();
    let range = range.start.min(rows)..range.end.min(rows);
    let out = empty(&w.lo, [range.len(), cols], dtype);
    let words = cols / 8;
    let total = range.len() * words;
    if total == 0 {
        return out;
    }
    let (count, dim) = elementwise(total, 256);
    let width = load_vector_size(&w.lo.client, dtype.size(), 8, 8);
    let hi = w.hi_arg();
    launch!(kdequantize_kernel(
        &w.lo.client.clone(),
        count,
        dim,
        width,
        arg(&w.lo),
        arg(&hi),
        arg(&w.meta),
        arg(&w.supers),
        arg(&out),
        words as u32,
        range.start as u32,
        total as u32,
        w.format.tag(),
        [dtype.into(), w.supers.dtype.into()],
    ));
    out
}

/// The whole matrix dense in `dtype`.
pub fn dequantize<R: CubeRuntime>(w: &KPacked<R>, dtype: DType) -> CubeTensor<R> {
    dequantize_rows(w, 0..w.shape()[0], dtype)
}

/// Writes the rows of the tokens whose id falls in `[start, start + rows)`; the launch with
/// `zero_others` also zeroes the rows of ids outside `[0, vocab)` (as the Q4/Q8 gather).
#[allow(clippy::too_many_arguments)]
#[cube(launch)]
fn kembed_kernel<F: Float, S: Float, I: Int>(
    lo: &Array<u32>,
    hi: &Array<u32>,
    meta: &Array<u32>,
    supers: &Array<S>,
    ids: &Array<I>,
    out: &mut Array<F>,
    words: u32,
    start: u32,
    vocab: u32,
    scale: f32,
    #[comptime] zero_others: bool,
    #[comptime] kind: u32,
    #[define(F, S, I)] _dtypes: [StorageType; 3],
) {
    let token = cube_index();
    if token >= ids.len() {
        terminate!();
    }
    let words = words as usize;
    let rows = lo.len() / words;
    let hidden = words * 8;
    let id = i64::cast_from(ids[token]);
    let base = token * hidden;
    if id >= i64::cast_from(start) && id < i64::cast_from(start as usize + rows) {
        let row = (id - i64::cast_from(start)) as usize;
        // Rounded to the activation dtype first, as in the dense gather.
        let scale = f32::cast_from(F::cast_from(scale));
        let mut values = Array::<f32>::new(8usize);
        let mut w = UNIT_POS_X as usize;
        while w < words {
            word_values::<S>(lo, hi, meta, supers, row, w, words, &mut values, kind);
            #[unroll]
            for n in 0..8usize {
                let value = f32::cast_from(F::cast_from(values[n]));
                out[base + w * 8 + n] = F::cast_from(value * scale);
            }
            w += CUBE_DIM_X as usize;
        }
    } else if zero_others && (id < 0 || id >= i64::cast_from(vocab)) {
        let mut c = UNIT_POS_X as usize;
        while c < hidden {
            out[base + c] = F::cast_from(0.0f32);
            c += CUBE_DIM_X as usize;
        }
    }
}

/// Scaled gather of `ids` (`[batch, seq]`) out of a k-quant table in row blocks, in `dtype`.
pub fn embed<R: CubeRuntime>(blocks: &[KPacked<R>], ids: CubeTensor<R>, scale: f64, dtype: DType) -> CubeTensor<R> {
    let [batch, seq] = [ids.meta.shape()[0], ids.meta.shape()[1]];
    let hidden = blocks.first().map_or(0, |b| b.shape()[1]);
    let vocab: usize = blocks.iter().map(|b| b.shape()[0]).sum();
    let out = empty(&ids, [batch, seq, hidden], dtype);
    if batch * seq == 0 || hidden == 0 {
        return out;
    }
    let mut start = 0usize;
    for (i, block) in blocks.iter().enumerate() {
        let hi = block.hi_arg();
        launch!(kembed_kernel(
            &ids.client,
            grid(batch * seq),
            CubeDim::new_1d(128),
            arg(&block.lo),
            arg(&hi),
            arg(&block.meta),
            arg(&block.supers),
            arg(&ids),
            arg(&out),
            (hidden / 8) as u32,
            start as u32,
            vocab as u32,
            scale as f32,
            i == 0,
            block.format.tag(),
            [dtype.into(), block.supers.dtype.into(), ids.dtype.into()],
        ));
        start += block.shape()[0];
    }
    out
}
