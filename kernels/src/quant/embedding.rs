//! The scaled gather of token rows out of a quantized table in row blocks: reference and kernel.

use super::device::{code, dequantize_reference, int_param, Packed};
use super::QuantizedMatrix;
use crate::cube::{cube_index, empty, grid};
use crate::graph::{arg, launch};
use burn::{
    module::Param,
    tensor::{backend::Backend, DType, Tensor},
};
use burn_cubecl::{tensor::CubeTensor, CubeRuntime};
use cubecl::prelude::*;

/// Reference: the scaled embedding gather over a table of quantized row blocks, in `dtype`.
pub fn embed_reference<B: Backend>(
    table: &[&QuantizedMatrix<B>],
    ids: Tensor<B, 2, burn::tensor::Int>,
    scale: f64,
    dtype: DType,
) -> Tensor<B, 3> {
    // Gather codes and scales of the requested rows, then dequantize only those rows.
    let [batch, seq] = ids.dims();
    let flat = ids.reshape([batch * seq]);
    let mut start = 0i64;
    let mut out: Option<Tensor<B, 2>> = None;
    for block in table {
        let [rows, cols] = block.shape;
        let local = flat.clone().sub_scalar(start);
        let inside = local.clone().greater_equal_elem(0).bool_and(local.clone().lower_elem(rows as i64));
        let local = local.clamp(0, rows as i64 - 1);
        let gathered = QuantizedMatrix::<B> {
            codes: int_param(block.codes.val().select(0, local.clone())),
            scales: Param::from_tensor(block.scales.val().select(0, local.clone())),
            offsets: block.offsets.as_ref().map(|o| Param::from_tensor(o.val().select(0, local.clone()))),
            format: block.format,
            shape: [batch * seq, cols],
        };
        let keep = inside.float().reshape([batch * seq, 1]).expand([batch * seq, cols]);
        let rows_here = dequantize_reference(&gathered, DType::F32) * keep;
        out = Some(match out {
            Some(acc) => acc + rows_here,
            None => rows_here,
        });
        start += rows as i64;
    }
    let device = flat.device();
    let Some(out) = out else {
        return Tensor::zeros([batch, seq, 0], (&device, dtype));
    };
    let cols = out.dims()[1];
    out.cast(dtype).reshape([batch, seq, cols]).mul_scalar(crate::dtype::scale_in(scale, dtype))
}

/// Writes the rows of the tokens whose id falls in `[start, start + rows)`; the launch with
/// `zero_others` also zeroes the rows of ids outside `[0, vocab)`.
#[allow(clippy::too_many_arguments)]
#[cube(launch)]
fn qembed_kernel<F: Float, S: Float, I: Int>(
    codes: &Array<u32>,
    scales: &Array<S>,
    offsets: &Array<S>,
    ids: &Array<I>,
    out: &mut Array<F>,
    words: u32,
    blocks: u32,
    start: u32,
    vocab: u32,
    scale: f32,
    #[comptime] zero_others: bool,
    #[comptime] q4: bool,
    #[define(F, S, I)] _dtypes: [StorageType; 3],
) {
    let per_word = comptime!(if q4 { 8usize } else { 4usize });
    let words_per_block = comptime!(32usize / per_word);
    let token = cube_index();
    if token >= ids.len() {
        terminate!();
    }
    let words = words as usize;
    let rows = codes.len() / words;
    let hidden = words * per_word;
    let id = i64::cast_from(ids[token]);
    let base = token * hidden;
    if id >= i64::cast_from(start) && id < i64::cast_from(start as usize + rows) {
        let row = (id - i64::cast_from(start)) as usize;
        // Rounded to the activation dtype first, as in the dense gather.
        let scale = f32::cast_from(F::cast_from(scale));
        let mut w = UNIT_POS_X as usize;
        while w < words {
            let block = row * blocks as usize + w / words_per_block;
            let s = f32::cast_from(scales[block]);
            let mut offset = 0.0f32;
            if q4 {
                offset = f32::cast_from(offsets[block]);
            }
            let word = codes[row * words + w];
            #[unroll]
            for n in 0..per_word {
                // Dequantized value rounded to the activation dtype, then scaled.
                let value = f32::cast_from(F::cast_from(code(word, n, q4) * s + offset));
                out[base + w * per_word + n] = F::cast_from(value * scale);
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

/// Scaled gather of `ids` (`[batch, seq]`) out of a table in row blocks, in `dtype`.
pub fn embed<R: CubeRuntime>(blocks: &[Packed<R>], ids: CubeTensor<R>, scale: f64, dtype: DType) -> CubeTensor<R> {
    let [batch, seq] = [ids.meta.shape()[0], ids.meta.shape()[1]];
    let hidden = blocks.first().map_or(0, |b| b.cols());
    let vocab: usize = blocks.iter().map(|b| b.codes.meta.shape()[0]).sum();
    let out = empty(&ids, [batch, seq, hidden], dtype);
    if batch * seq == 0 || hidden == 0 {
        return out;
    }
    let mut start = 0usize;
    for (i, block) in blocks.iter().enumerate() {
        let (codes, scales, offsets, q4) = block.args();
        let (row_words, row_blocks) = block.row_sizes();
        let dtypes = [dtype.into(), scales.dtype.into(), ids.dtype.into()];
        let rows = codes.meta.shape()[0];
        launch!(qembed_kernel(
            &ids.client,
            grid(batch * seq),
            CubeDim::new_1d(128),
            arg(&codes),
            arg(&scales),
            arg(&offsets),
            arg(&ids),
            arg(&out),
            row_words,
            row_blocks,
            start as u32,
            vocab as u32,
            scale as f32,
            i == 0,
            q4,
            dtypes,
        ));
        start += rows;
    }
    out
}
