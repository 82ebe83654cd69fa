//! The device form of a quantized matrix: its upload in the backend's code layout, the
//! reference dequantization and product, and the dequantize kernel (prefill: the matrix in the
//! activation dtype once, then the backend's matmul).

// Kernel code cannot call `usize::div_ceil` (not a CubeCL intrinsic).
#![allow(clippy::manual_div_ceil)]

use super::{HostQuantized, QuantFormat, BLOCK};
use crate::cube::{elementwise, empty, load_vector_size, unit_index};
use crate::graph::{arg, launch};
use burn::{
    module::{Module, Param},
    tensor::{backend::Backend, DType, Int, Tensor, TensorData},
};
use burn_cubecl::{tensor::CubeTensor, CubeRuntime};
use cubecl::prelude::*;

/// How codes sit in device memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CodeLayout {
    /// One `U8` per code (the reference).
    Bytes,
    /// Packed into `U32` words, the lowest bits first (the CubeCL kernels).
    Words,
}

/// A block-quantized `[rows, cols]` matrix on the device.
#[derive(Module, Debug)]
pub struct QuantizedMatrix<B: Backend> {
    /// Codes in the backend's layout (see the module docs), an int tensor.
    pub codes: Param<Tensor<B, 2, Int>>,
    /// `[rows, cols / 32]`, f16 or f32.
    pub scales: Param<Tensor<B, 2>>,
    /// `[rows, cols / 32]`, Q4 only.
    pub offsets: Option<Param<Tensor<B, 2>>>,
    #[module(skip)]
    pub format: QuantFormat,
    #[module(skip)]
    pub shape: [usize; 2],
}

impl<B: Backend> QuantizedMatrix<B> {
    /// Bytes the matrix occupies on the device.
    pub fn device_bytes(&self) -> usize {
        let size = |t: &Tensor<B, 2>| t.shape().num_elements() * t.dtype().size();
        let codes = self.codes.val();
        codes.shape().num_elements() * codes.dtype().size()
            + size(&self.scales.val())
            + self.offsets.as_ref().map_or(0, |o| size(&o.val()))
    }

    /// Uploads `host` with its codes in `layout`.
    ///
    /// Each tensor is uploaded flat and viewed as a matrix: a 2-D upload may pad every row to an
    /// aligned pitch (CubeCL does for rows of e.g. 72 or 1,152 bytes), and a padded weight would
    /// be copied to a contiguous one by every kernel call that reads it.
    pub fn upload(host: &HostQuantized, layout: CodeLayout, scale_dtype: DType, device: &B::Device) -> Self {
        let blocks = [host.rows, host.cols / BLOCK];
        let codes = if layout == CodeLayout::Words {
            let words = host.packed_words();
            let shape = [host.rows, host.cols / host.format.codes_per_word()];
            Tensor::<B, 1, Int>::from_data(TensorData::new(words, [shape[0] * shape[1]]), (device, DType::U32))
                .reshape(shape)
        } else {
            Tensor::<B, 1, Int>::from_data(
                TensorData::new(host.codes.clone(), [host.rows * host.cols]),
                (device, DType::U8),
            )
            .reshape([host.rows, host.cols])
        };
        let floats = |v: &[f32]| {
            Tensor::<B, 1>::from_data(TensorData::new(v.to_vec(), [v.len()]), (device, scale_dtype)).reshape(blocks)
        };
        Self {
            codes: int_param(codes),
            scales: Param::from_tensor(floats(&host.scales)),
            offsets: (host.format == QuantFormat::Q4).then(|| Param::from_tensor(floats(&host.offsets))),
            format: host.format,
            shape: [host.rows, host.cols],
        }
    }
}

/// An int tensor as a (never trained) parameter.
pub(crate) fn int_param<B: Backend>(t: Tensor<B, 2, Int>) -> Param<Tensor<B, 2, Int>> {
    Param::initialized(burn::module::ParamId::new(), t)
}

/// Reference dequantization of a matrix with one `U8` code per weight, to `dtype`.
pub fn dequantize_reference<B: Backend>(w: &QuantizedMatrix<B>, dtype: DType) -> Tensor<B, 2> {
    let [rows, cols] = w.shape;
    let blocks = cols / BLOCK;
    let codes = w.codes.val().float().cast(DType::F32).reshape([rows, blocks, BLOCK]);
    let scales = w.scales.val().cast(DType::F32).reshape([rows, blocks, 1]);
    let values = match (&w.offsets, w.format) {
        (Some(offsets), QuantFormat::Q4) => codes * scales + offsets.val().cast(DType::F32).reshape([rows, blocks, 1]),
        _ => codes.sub_scalar(128.0) * scales,
    };
    values.reshape([rows, cols]).cast(dtype)
}

/// Reference: `x [n, in] @ dequantize(w)^T -> [n, out]` in `x`'s dtype.
pub fn project_reference<B: Backend>(x: Tensor<B, 2>, w: &QuantizedMatrix<B>) -> Tensor<B, 2> {
    let dense = dequantize_reference(w, x.dtype());
    crate::linear::reference(x, dense)
}

/// Weight `n` of a packed word, before scaling: Q8 `q`, Q4 the unsigned code. The code's bits
/// become the low mantissa bits of 2^23 (the float `2^23 + code`, exact), then 2^23 (and Q8's
/// 128) is subtracted: a mask, an or and an add at full rate, where an integer-to-float
/// conversion runs at a fraction of it.
#[cube]
pub(crate) fn code(word: u32, #[comptime] n: usize, #[comptime] q4: bool) -> f32 {
    if q4 {
        f32::reinterpret(((word >> (n as u32 * 4)) & 15u32) | 0x4B00_0000u32) - 8_388_608.0f32
    } else {
        f32::reinterpret(((word >> (n as u32 * 8)) & 255u32) | 0x4B00_0000u32) - 8_388_736.0f32
    }
}

/// Dequantizes `total` code words from row `first` on (`out` starts at that row); each unit
/// writes its word's 4 (Q8) or 8 (Q4) values as vectors of `N` (one 16-byte store for Q4 in a
/// 16-bit dtype).
#[allow(clippy::too_many_arguments)]
#[cube(launch)]
fn dequantize_kernel<F: Float, S: Float, N: Size>(
    codes: &Array<u32>,
    scales: &Array<S>,
    offsets: &Array<S>,
    out: &mut Array<Vector<F, N>>,
    words: u32,
    blocks: u32,
    first: u32,
    total: u32,
    #[comptime] q4: bool,
    #[define(F, S)] _dtypes: [StorageType; 2],
) {
    let per_word = comptime!(if q4 { 8usize } else { 4usize });
    let words_per_block = comptime!(32usize / per_word);
    let width = out.vector_size();
    let vectors = comptime!(per_word / width);
    let idx = unit_index();
    if idx >= total as usize {
        terminate!();
    }
    let words = words as usize;
    let at = first as usize * words + idx;
    let row = at / words;
    let w = at % words;
    let block = row * blocks as usize + w / words_per_block;
    let scale = f32::cast_from(scales[block]);
    let mut offset = 0.0f32;
    if q4 {
        offset = f32::cast_from(offsets[block]);
    }
    let word = codes[at];
    #[unroll]
    for j in 0..vectors {
        let mut v = Vector::<F, N>::empty();
        #[unroll]
        for n in 0..width {
            v[n] = F::cast_from(code(word, comptime!(j * width + n), q4) * scale + offset);
        }
        out[idx * vectors + j] = v;
    }
}

/// The packed parts of a quantized matrix: codes `[rows, words]` (u32), scales and offsets
/// `[rows, blocks]` (the scales stand in for the offsets of Q8, which never reads them).
pub struct Packed<R: CubeRuntime> {
    pub codes: CubeTensor<R>,
    pub scales: CubeTensor<R>,
    pub offsets: Option<CubeTensor<R>>,
    pub format: QuantFormat,
}

/// The device tensors of a quantized matrix as kernel arguments.
pub(crate) fn packed<R, F, I, BT>(w: &QuantizedMatrix<burn_cubecl::CubeBackend<R, F, I, BT>>) -> Packed<R>
where
    R: CubeRuntime,
    F: burn_cubecl::FloatElement,
    I: burn_cubecl::IntElement,
    BT: burn_cubecl::BoolElement,
{
    Packed {
        codes: crate::cube::int(w.codes.val()),
        scales: crate::cube::float(w.scales.val()),
        offsets: w.offsets.as_ref().map(|o| crate::cube::float(o.val())),
        format: w.format,
    }
}

impl<R: CubeRuntime> Packed<R> {
    pub(crate) fn args(&self) -> (CubeTensor<R>, CubeTensor<R>, CubeTensor<R>, bool) {
        let offsets = self.offsets.clone().unwrap_or_else(|| self.scales.clone());
        (self.codes.clone(), self.scales.clone(), offsets, self.format == QuantFormat::Q4)
    }

    pub(crate) fn cols(&self) -> usize {
        self.codes.meta.shape()[1] * self.format.codes_per_word()
    }

    /// Vector widths of the matrix-vector kernels: code words per load (at most 4 `u32`, 16
    /// bytes) and activations per load of `x` (the codes one load of words holds, at most 8).
    pub(crate) fn load_vectors(&self, x: &CubeTensor<R>) -> (usize, usize) {
        let nw = load_vector_size(&x.client, 4, self.codes.meta.shape()[1], 4);
        (nw, load_vector_size(&x.client, x.dtype.size(), nw * self.format.codes_per_word(), 8))
    }

    /// Code words and scale blocks per row, as the kernels take them.
    pub(crate) fn row_sizes(&self) -> (u32, u32) {
        (self.codes.meta.shape()[1] as u32, self.scales.meta.shape()[1] as u32)
    }
}

/// The dense `[rows, cols]` matrix in `dtype`.
pub fn dequantize<R: CubeRuntime>(w: &Packed<R>, dtype: DType) -> CubeTensor<R> {
    dequantize_rows(w, 0..w.codes.meta.shape()[0], dtype)
}

/// Rows `range` of the matrix, dense `[range.len(), cols]` in `dtype` (read in place: no
/// view of the packed buffers is made).
pub fn dequantize_rows<R: CubeRuntime>(w: &Packed<R>, range: std::ops::Range<usize>, dtype: DType) -> CubeTensor<R> {
    let rows = w.codes.meta.shape()[0];
    let range = range.start.min(rows)..range.end.min(rows);
    let out = empty(&w.codes, [range.len(), w.cols()], dtype);
    let (row_words, row_blocks) = w.row_sizes();
    let total_words = range.len() * row_words as usize;
    if total_words == 0 {
        return out;
    }
    let (codes, scales, offsets, q4) = w.args();
    let (count, dim) = elementwise(total_words, 256);
    let width = load_vector_size(&codes.client, dtype.size(), w.format.codes_per_word(), 8);
    launch!(dequantize_kernel(
        &codes.client.clone(),
        count,
        dim,
        width,
        arg(&codes),
        arg(&scales),
        arg(&offsets),
        arg(&out),
        row_words,
        row_blocks,
        range.start as u32,
        total_words as u32,
        q4,
        [dtype.into(), scales.dtype.into()],
    ));
    out
}
