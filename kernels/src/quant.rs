//! Block-quantized weight matrices: the formats, host-side quantization, and the device form.
//!
//! Two formats, both with blocks of [`BLOCK`] consecutive weights along a row:
//! - [`QuantFormat::Q8`]: symmetric int8, `w = scale * q` with `q` in `-128..=127` (GGUF's Q8_0
//!   maps onto it exactly; our quantizer uses `-127..=127`);
//! - [`QuantFormat::Q4`]: asymmetric 4-bit, `w = scale * q + offset` with `q` in `0..=15`
//!   (GGUF's Q4_0 and Q4_1 map onto it exactly, Q4_K up to rounding its two-level scales).
//!
//! Scales and offsets are rounded to f16 on the host (as GGUF stores them), so a backend that
//! keeps them in f16 and one that keeps them in f32 compute with the same numbers.
//!
//! On the device a [`QuantizedMatrix`] holds the codes in a layout the backend chooses
//! ([`crate::GemmaBackend::upload_quantized`]): the reference (CPU backends) keeps one `U8` code
//! per weight; the CubeCL backends pack them into `u32` words (4 int8 or 8 nibbles, the lowest
//! bits first), so Q8 costs 8.5 bits per weight and Q4 5 bits on the GPU.

use burn::{
    module::{Module, Param},
    tensor::{backend::Backend, DType, Int, Tensor, TensorData},
};

/// Weights per quantization block.
pub const BLOCK: usize = 32;

/// A block-quantized weight format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum QuantFormat {
    /// Symmetric int8 per block of 32 (as GGUF Q8_0).
    Q8,
    /// Asymmetric 4-bit per block of 32 (scale and offset).
    Q4,
}

impl QuantFormat {
    /// Bits per code.
    pub fn bits(self) -> usize {
        match self {
            Self::Q8 => 8,
            Self::Q4 => 4,
        }
    }

    /// Codes per packed `u32` word.
    pub fn codes_per_word(self) -> usize {
        32 / self.bits()
    }

    /// Largest code.
    fn max_code(self) -> u8 {
        match self {
            Self::Q8 => 255,
            Self::Q4 => 15,
        }
    }
}

impl std::fmt::Display for QuantFormat {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Q8 => "q8",
            Self::Q4 => "q4",
        })
    }
}

/// Why a matrix cannot be quantized.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum QuantError {
    /// Rows must split into whole blocks.
    #[error("cannot quantize a [{rows}, {cols}] matrix: {cols} columns are not a multiple of the block size {BLOCK}")]
    Columns { rows: usize, cols: usize },
    /// The value count disagrees with the shape.
    #[error("{len} values for a [{rows}, {cols}] matrix")]
    Length { rows: usize, cols: usize, len: usize },
    /// A value is NaN or infinite.
    #[error("value {index} is not finite ({value})")]
    NotFinite { index: usize, value: f32 },
    /// A code is past the format's range.
    #[error("code {index} is {code}, past the largest {format} code")]
    Code { index: usize, code: u8, format: QuantFormat },
    /// Scales or offsets are not one per block.
    #[error("{what}: {len} values for {blocks} blocks")]
    Blocks { what: &'static str, len: usize, blocks: usize },
}

/// A quantized matrix on the host: one code per weight (row-major, unsigned: Q8 stores
/// `q + 128`), and one scale (and for Q4 one offset) per block, row-major `[rows, cols / 32]`.
#[derive(Debug, Clone, PartialEq)]
pub struct HostQuantized {
    pub format: QuantFormat,
    pub rows: usize,
    pub cols: usize,
    pub codes: Vec<u8>,
    pub scales: Vec<f32>,
    /// Q4 only (empty for Q8).
    pub offsets: Vec<f32>,
}

/// Rounds to the nearest f16, as scales are stored.
fn f16_round(x: f32) -> f32 {
    half::f16::from_f32(x).to_f32()
}

impl HostQuantized {
    /// Quantizes a row-major `[rows, cols]` matrix block by block (Q8: `scale = max|w| / 127`;
    /// Q4: `scale = (max - min) / 15`, `offset = min`), rounding to the nearest code.
    pub fn quantize(values: &[f32], rows: usize, cols: usize, format: QuantFormat) -> Result<Self, QuantError> {
        Self::check_shape(rows, cols, values.len())?;
        if let Some((index, &value)) = values.iter().enumerate().find(|(_, v)| !v.is_finite()) {
            return Err(QuantError::NotFinite { index, value });
        }
        let blocks = rows * cols / BLOCK;
        let mut out = Self {
            format,
            rows,
            cols,
            codes: vec![0; values.len()],
            scales: Vec::with_capacity(blocks),
            offsets: Vec::with_capacity(if format == QuantFormat::Q4 { blocks } else { 0 }),
        };
        for (src, dst) in values.chunks_exact(BLOCK).zip(out.codes.chunks_exact_mut(BLOCK)) {
            match format {
                QuantFormat::Q8 => {
                    let amax = src.iter().fold(0.0f32, |m, v| m.max(v.abs()));
                    let scale = f16_round(amax / 127.0);
                    let inv = if scale > 0.0 { 1.0 / scale } else { 0.0 };
                    for (d, &v) in dst.iter_mut().zip(src) {
                        *d = ((v * inv).round().clamp(-127.0, 127.0) + 128.0) as u8;
                    }
                    out.scales.push(scale);
                }
                QuantFormat::Q4 => {
                    let lo = src.iter().fold(f32::INFINITY, |m, &v| m.min(v));
                    let hi = src.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
                    let offset = f16_round(lo);
                    let scale = f16_round((hi - offset) / 15.0);
                    let inv = if scale > 0.0 { 1.0 / scale } else { 0.0 };
                    for (d, &v) in dst.iter_mut().zip(src) {
                        *d = ((v - offset) * inv).round().clamp(0.0, 15.0) as u8;
                    }
                    out.scales.push(scale);
                    out.offsets.push(offset);
                }
            }
        }
        Ok(out)
    }

    /// Builds a matrix from codes, scales and offsets already in this module's conventions
    /// (for converters of other block formats); checks every length and code.
    pub fn from_parts(
        format: QuantFormat,
        rows: usize,
        cols: usize,
        codes: Vec<u8>,
        scales: Vec<f32>,
        offsets: Vec<f32>,
    ) -> Result<Self, QuantError> {
        Self::check_shape(rows, cols, codes.len())?;
        let blocks = rows * cols / BLOCK;
        let want_offsets = if format == QuantFormat::Q4 { blocks } else { 0 };
        if scales.len() != blocks {
            return Err(QuantError::Blocks { what: "scales", len: scales.len(), blocks });
        }
        if offsets.len() != want_offsets {
            return Err(QuantError::Blocks { what: "offsets", len: offsets.len(), blocks: want_offsets });
        }
        if let Some((index, &code)) = codes.iter().enumerate().find(|(_, &c)| c > format.max_code()) {
            return Err(QuantError::Code { index, code, format });
        }
        let scales = scales.into_iter().map(f16_round).collect();
        let offsets = offsets.into_iter().map(f16_round).collect();
        Ok(Self { format, rows, cols, codes, scales, offsets })
    }

    fn check_shape(rows: usize, cols: usize, len: usize) -> Result<(), QuantError> {
        if cols % BLOCK != 0 || cols == 0 {
            return Err(QuantError::Columns { rows, cols });
        }
        if rows * cols != len {
            return Err(QuantError::Length { rows, cols, len });
        }
        Ok(())
    }

    /// The weight at flat index `i` (row-major).
    pub fn value(&self, i: usize) -> f32 {
        let block = i / BLOCK;
        match self.format {
            QuantFormat::Q8 => self.scales[block] * (self.codes[i] as f32 - 128.0),
            QuantFormat::Q4 => self.scales[block] * self.codes[i] as f32 + self.offsets[block],
        }
    }

    /// All weights, row-major.
    pub fn dequantize(&self) -> Vec<f32> {
        (0..self.codes.len()).map(|i| self.value(i)).collect()
    }

    /// Rows `range` as a matrix of their own.
    pub fn rows_slice(&self, range: std::ops::Range<usize>) -> Self {
        let per_row = self.cols / BLOCK;
        let blocks = range.start * per_row..range.end * per_row;
        Self {
            format: self.format,
            rows: range.len(),
            cols: self.cols,
            codes: self.codes[range.start * self.cols..range.end * self.cols].to_vec(),
            scales: self.scales[blocks.clone()].to_vec(),
            offsets: if self.offsets.is_empty() { Vec::new() } else { self.offsets[blocks].to_vec() },
        }
    }

    /// Appends `other`'s rows below this matrix's when both have the same format and width (one
    /// product then serves both); gives `other` back otherwise.
    pub fn append_rows(&mut self, other: HostQuantized) -> Result<(), HostQuantized> {
        if other.format != self.format || other.cols != self.cols {
            return Err(other);
        }
        self.rows += other.rows;
        self.codes.extend(other.codes);
        self.scales.extend(other.scales);
        self.offsets.extend(other.offsets);
        Ok(())
    }

    /// The joined matrix of `gate` and `up` (same format and shape, rows a multiple of
    /// `block`) with their rows interleaved in blocks of `block`: `block` gate rows, then the
    /// same `block` up rows, and so on ([`crate::gelu::interleave_pairs`] for dense matrices).
    /// Gives both back when they do not match.
    pub fn interleave_pairs(
        gate: HostQuantized,
        up: HostQuantized,
        block: usize,
    ) -> Result<Self, (HostQuantized, HostQuantized)> {
        if gate.format != up.format
            || gate.cols != up.cols
            || gate.rows != up.rows
            || block == 0
            || gate.rows % block != 0
        {
            return Err((gate, up));
        }
        let per_row = gate.cols / BLOCK;
        let mut out = Self {
            format: gate.format,
            rows: 2 * gate.rows,
            cols: gate.cols,
            codes: Vec::with_capacity(2 * gate.codes.len()),
            scales: Vec::with_capacity(2 * gate.scales.len()),
            offsets: Vec::with_capacity(2 * gate.offsets.len()),
        };
        for first in (0..gate.rows).step_by(block) {
            for half in [&gate, &up] {
                let (codes, blocks) =
                    (first * half.cols..(first + block) * half.cols, first * per_row..(first + block) * per_row);
                out.codes.extend_from_slice(&half.codes[codes]);
                out.scales.extend_from_slice(&half.scales[blocks.clone()]);
                if !half.offsets.is_empty() {
                    out.offsets.extend_from_slice(&half.offsets[blocks]);
                }
            }
        }
        Ok(out)
    }

    /// Codes packed into `u32` words, lowest bits first: `[rows, cols / codes_per_word]`.
    pub fn packed_words(&self) -> Vec<u32> {
        let bits = self.format.bits();
        self.codes
            .chunks_exact(self.format.codes_per_word())
            .map(|w| w.iter().enumerate().fold(0u32, |acc, (n, &c)| acc | (c as u32) << (n * bits)))
            .collect()
    }
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

    /// Uploads `host` with the given code layout: `packed` words (`U32`) or one `U8` per code.
    ///
    /// Each tensor is uploaded flat and viewed as a matrix: a 2-D upload may pad every row to an
    /// aligned pitch (CubeCL does for rows of e.g. 72 or 1,152 bytes), and a padded weight would
    /// be copied to a contiguous one by every kernel call that reads it.
    pub fn upload(host: &HostQuantized, packed: bool, scale_dtype: DType, device: &B::Device) -> Self {
        let blocks = [host.rows, host.cols / BLOCK];
        let codes = if packed {
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
fn int_param<B: Backend>(t: Tensor<B, 2, Int>) -> Param<Tensor<B, 2, Int>> {
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

/// Reference: the scaled embedding gather over a table of quantized row blocks, in `dtype`.
pub fn embed_reference<B: Backend>(
    table: &[QuantizedMatrix<B>],
    ids: Tensor<B, 2, Int>,
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
    // The scale is rounded to the activation dtype first, as in the dense path.
    let scale = match dtype {
        DType::BF16 => half::bf16::from_f64(scale).to_f64(),
        DType::F16 => half::f16::from_f64(scale).to_f64(),
        _ => scale,
    };
    out.cast(dtype).reshape([batch, seq, cols]).mul_scalar(scale)
}

/// CubeCL kernels over packed codes (`u32` words, see the module docs):
/// - `gemv`: decode-sized products (at most [`crate::linear::GEMV_MAX_ROWS`] activation rows).
///   Each cube owns `ROWS` output features, each plane of 32 units one, two or four of them; the
///   units stride over the rows in vectors of up to 4 words (16 bytes: 16 Q8 or 32 Q4 codes, so
///   a plane reads 512 consecutive bytes of each row per step and every code byte once), with
///   the vector's block scale (and offset) per row. The matching activations are loaded in
///   vectors as wide as the runtime allows, converted to f32 and summed once for all the rows of
///   the plane; the codes become floats `1 + code / 2^bits` by a shift and a mask (see
///   `unit_code`), and the activation sum turns their dot products into the weights' (f32
///   throughout). Sums are added as in the dense kernel (`plane_sum` on 32-wide planes, else a
///   shared-memory tree).
/// - `dequantize`: the whole matrix in the activation dtype, for prefill (one unit per word);
///   the backend's matmul then runs on it.
/// - `embed`: the scaled gather of token rows out of a quantized table in row blocks.
#[allow(clippy::manual_div_ceil)]
pub(crate) mod kernel {
    use super::QuantFormat;
    use crate::cube::{cube_index, elementwise, empty, grid, load_vector_size, planes_of_32, unit_index};
    use crate::linear::kernel::{reduce_and_store, LANES, ROWS};
    use burn::tensor::DType;
    use burn_cubecl::{tensor::CubeTensor, CubeRuntime};
    use cubecl::prelude::*;

    /// Weight `n` of a packed word, before scaling: Q8 `q`, Q4 the unsigned code. The code's bits
    /// become the low mantissa bits of 2^23 (the float `2^23 + code`, exact), then 2^23 (and Q8's
    /// 128) is subtracted: a mask, an or and an add at full rate, where an integer-to-float
    /// conversion runs at a fraction of it.
    #[cube]
    fn code(word: u32, #[comptime] n: usize, #[comptime] q4: bool) -> f32 {
        if q4 {
            f32::reinterpret(((word >> (n as u32 * 4)) & 15u32) | 0x4B00_0000u32) - 8_388_608.0f32
        } else {
            f32::reinterpret(((word >> (n as u32 * 8)) & 255u32) | 0x4B00_0000u32) - 8_388_736.0f32
        }
    }

    /// Code `n` of a packed word as the float `1 + code / 2^bits` (exact): the code's bits are
    /// shifted to the top of the mantissa of 1.0 - one shift and one mask-and-or, where [`code`]
    /// also needs a subtraction. A dot product over these values is `sum(x) + sum(x * code) /
    /// 2^bits`; the GEMV subtracts `sum(x)` once per code vector, shared by the rows it serves.
    #[cube]
    fn unit_code(word: u32, #[comptime] n: usize, #[comptime] q4: bool) -> f32 {
        let bits = comptime!(if q4 { 4usize } else { 8usize });
        // Lowest mantissa bit the code lands on, and the code's lowest bit in the word.
        let low = comptime!(23 - bits);
        let at = comptime!(n * bits);
        let mask = comptime!((((1u32 << bits) - 1) << low) as u32);
        let placed = if comptime!(at <= low) {
            word << comptime!((low - at) as u32)
        } else {
            word >> comptime!((at - low) as u32)
        };
        f32::reinterpret((placed & mask) | 0x3F80_0000u32)
    }

    /// Each plane (32 units) computes `per_plane` output features (`ROWS / per_plane` planes per
    /// cube); its units stride over the rows in code vectors of `nw` words, loading the same
    /// vector of every row it serves, so that the activations are loaded, converted to f32 and
    /// summed once for all of them. Rows past `n_out` read the last row and are not stored.
    #[allow(clippy::too_many_arguments)]
    #[cube(launch)]
    fn qgemv_kernel<F: Float, S: Float, NW: Size, NX: Size>(
        x: &Array<Vector<F, NX>>,
        codes: &Array<Vector<u32, NW>>,
        scales: &Array<S>,
        offsets: &Array<S>,
        out: &mut Array<F>,
        words: u32,
        blocks: u32,
        n_out: u32,
        #[comptime] m: usize,
        #[comptime] per_plane: usize,
        #[comptime] q4: bool,
        #[comptime] plane: bool,
        #[comptime] pairs: bool,
        #[define(F, S)] _dtypes: [StorageType; 2],
    ) {
        let per_word = comptime!(if q4 { 8usize } else { 4usize });
        let words_per_block = comptime!(32usize / per_word);
        // `sum(x * code) = 2^bits * (dot - sum(x))` with `dot` over `1 + code / 2^bits`; Q8's
        // stored code is `q + 128`, so `sum(x * q) = 256 * dot - 384 * sum(x)`.
        let unit_scale = comptime!(if q4 { 16.0f32 } else { 256.0f32 });
        let sum_scale = comptime!(if q4 { 16.0f32 } else { 384.0f32 });
        let nw = codes.vector_size();
        let nx = x.vector_size();
        // Activation loads per code vector (`nx` divides the vector's `nw * per_word` codes).
        let loads = comptime!(nw * per_word / nx);
        let vectors = words as usize / nw;
        let n_out = n_out as usize;
        let blocks = blocks as usize;
        let k = words as usize * per_word;
        let unit = UNIT_POS_X as usize;
        let lane = unit % LANES;
        let first = cube_index() * ROWS + (unit / LANES) * per_plane;
        let slots = comptime!(m * per_plane);
        let mut acc = Array::<f32>::new(slots);
        #[unroll]
        for s in 0..slots {
            acc[s] = 0.0f32;
        }
        // The rows this plane serves, clamped to the last row so that every unit runs the same loop and reaches the reduction.
        let mut row_at = Array::<usize>::new(per_plane);
        #[unroll]
        for r in 0..per_plane {
            row_at[r] = min(first + r, n_out - 1);
        }
        let mut cw = Array::<Vector<u32, NW>>::new(per_plane);
        let mut scale = Array::<f32>::new(per_plane);
        let mut offset = Array::<f32>::new(per_plane);
        let mut dots = Array::<f32>::new(slots);
        let mut sx = Array::<f32>::new(m);
        let mut v = lane;
        while v < vectors {
            // A vector never straddles two blocks: one scale (and offset) per row.
            let block = (v * nw) / words_per_block;
            #[unroll]
            for r in 0..per_plane {
                cw[r] = codes[row_at[r] * vectors + v];
                scale[r] = f32::cast_from(scales[row_at[r] * blocks + block]);
                if q4 {
                    offset[r] = f32::cast_from(offsets[row_at[r] * blocks + block]);
                }
            }
            #[unroll]
            for s in 0..slots {
                dots[s] = 0.0f32;
            }
            #[unroll]
            for t in 0..m {
                sx[t] = 0.0f32;
                #[unroll]
                for g in 0..loads {
                    let xv = x[(t * k + v * nw * per_word) / nx + g];
                    #[unroll]
                    for i in 0..nx {
                        let xi = f32::cast_from(xv[i]);
                        sx[t] += xi;
                        let c = comptime!(g * nx + i);
                        #[unroll]
                        for r in 0..per_plane {
                            let word = cw[r][comptime!(c / per_word)];
                            dots[t * per_plane + r] += unit_code(word, comptime!(c % per_word), q4) * xi;
                        }
                    }
                }
            }
            #[unroll]
            for t in 0..m {
                #[unroll]
                for r in 0..per_plane {
                    let s = comptime!(t * per_plane + r);
                    // Q8: scale * sum(x * q); Q4: scale * sum(x * code) + offset * sum(x).
                    let mut shift = scale[r] * sum_scale;
                    if q4 {
                        shift -= offset[r];
                    }
                    acc[s] += scale[r] * unit_scale * dots[s] - shift * sx[t];
                }
            }
            v += LANES;
        }
        reduce_and_store::<F>(&acc, out, first, n_out, m, per_plane, plane, pairs);
    }

    #[cube(launch)]
    fn dequantize_kernel<F: Float, S: Float>(
        codes: &Array<u32>,
        scales: &Array<S>,
        offsets: &Array<S>,
        out: &mut Array<F>,
        words: u32,
        blocks: u32,
        #[comptime] q4: bool,
        #[define(F, S)] _dtypes: [StorageType; 2],
    ) {
        let per_word = comptime!(if q4 { 8usize } else { 4usize });
        let words_per_block = comptime!(32usize / per_word);
        let idx = unit_index();
        if idx >= codes.len() {
            terminate!();
        }
        let words = words as usize;
        let row = idx / words;
        let w = idx % words;
        let block = row * blocks as usize + w / words_per_block;
        let scale = f32::cast_from(scales[block]);
        let mut offset = 0.0f32;
        if q4 {
            offset = f32::cast_from(offsets[block]);
        }
        let word = codes[idx];
        #[unroll]
        for n in 0..per_word {
            out[idx * per_word + n] = F::cast_from(code(word, n, q4) * scale + offset);
        }
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

    /// The packed parts of a quantized matrix: codes `[rows, words]` (u32), scales and offsets
    /// `[rows, blocks]` (the scales stand in for the offsets of Q8, which never reads them).
    pub struct Packed<R: CubeRuntime> {
        pub codes: CubeTensor<R>,
        pub scales: CubeTensor<R>,
        pub offsets: Option<CubeTensor<R>>,
        pub format: QuantFormat,
    }

    impl<R: CubeRuntime> Packed<R> {
        fn args(&self) -> (CubeTensor<R>, CubeTensor<R>, CubeTensor<R>, bool) {
            let offsets = self.offsets.clone().unwrap_or_else(|| self.scales.clone());
            (self.codes.clone(), self.scales.clone(), offsets, self.format == QuantFormat::Q4)
        }

        fn cols(&self) -> usize {
            self.codes.meta.shape()[1] * self.format.codes_per_word()
        }

        /// Code words and scale blocks per row, as the kernels take them.
        fn row_sizes(&self) -> (u32, u32) {
            (self.codes.meta.shape()[1] as u32, self.scales.meta.shape()[1] as u32)
        }
    }

    /// Planes per streaming multiprocessor a quantized GEMV keeps busy before its planes take
    /// several output features each (128 multiprocessors assumed where the runtime does not say).
    const PLANES_PER_SM: usize = 16;

    /// Output features per plane of the quantized GEMV for `n` activation rows: four (two for
    /// three or more rows, whose per-unit sums take `2 * n * features` registers), each
    /// activation then loaded, converted and summed once for all of them - while enough planes
    /// remain; fewer features per plane otherwise. H100, ncu, Q8: 1 x 2560 -> 10240 went from
    /// 20.8 to 18.0 us with four (2,560 planes), 1 x 640 -> 52,428 from 34.9 to 27.7 us, while
    /// 1 x 10240 -> 2560 (640 planes left) went from 27.1 to 35.7 us.
    fn rows_per_plane<R: CubeRuntime>(client: &ComputeClient<R>, n: usize, out_features: usize) -> usize {
        let sms = client.properties().hardware.num_streaming_multiprocessors.map_or(128, |s| s as usize);
        let most = if n <= 2 { 4 } else { 2 };
        [4, 2].into_iter().filter(|&r| r <= most).find(|&r| out_features / r >= PLANES_PER_SM * sms).unwrap_or(1)
    }

    /// `x`: contiguous `[n, in]` with `n <= GEMV_MAX_ROWS`. Returns `[n, out]` in `x`'s dtype, or
    /// with `pairs` (gate and up rows interleaved, `out` a multiple of `ROWS`) `gelu_tanh(gate) *
    /// up`, `[n, out / 2]`.
    pub fn gemv<R: CubeRuntime>(x: CubeTensor<R>, w: &Packed<R>, pairs: bool) -> CubeTensor<R> {
        let n = x.meta.shape()[0];
        let out_features = w.codes.meta.shape()[0];
        let out = empty(&x, [n, if pairs { out_features / 2 } else { out_features }], x.dtype);
        if n == 0 || out_features == 0 {
            return out;
        }
        let (codes, scales, offsets, q4) = w.args();
        let (row_words, row_blocks) = w.row_sizes();
        let dtypes = [x.dtype.into(), scales.dtype.into()];
        // Up to 4 words (16 bytes) per code load: a divisor of the row, and of the block (4 or
        // 8 words); activations in loads of up to 16 bytes dividing the vector's codes.
        let nw = load_vector_size(&x.client, 4, codes.meta.shape()[1], 4);
        let nx = load_vector_size(&x.client, x.dtype.size(), nw * w.format.codes_per_word(), 8);
        let per_plane = rows_per_plane(&x.client, n, out_features);
        qgemv_kernel::launch::<R>(
            &x.client,
            grid(out_features.div_ceil(ROWS)),
            CubeDim::new_1d((ROWS / per_plane * LANES) as u32),
            nw,
            nx,
            x.clone().into_array_arg(),
            codes.into_array_arg(),
            scales.into_array_arg(),
            offsets.into_array_arg(),
            out.clone().into_array_arg(),
            row_words,
            row_blocks,
            out_features as u32,
            n,
            per_plane,
            q4,
            planes_of_32(&x.client),
            pairs,
            dtypes,
        );
        out
    }

    /// The dense `[rows, cols]` matrix in `dtype`.
    pub fn dequantize<R: CubeRuntime>(w: &Packed<R>, dtype: DType) -> CubeTensor<R> {
        let rows = w.codes.meta.shape()[0];
        let out = empty(&w.codes, [rows, w.cols()], dtype);
        let total_words = w.codes.meta.num_elements();
        if total_words == 0 {
            return out;
        }
        let (codes, scales, offsets, q4) = w.args();
        let (row_words, row_blocks) = w.row_sizes();
        let (count, dim) = elementwise(total_words, 256);
        dequantize_kernel::launch::<R>(
            &codes.client.clone(),
            count,
            dim,
            codes.into_array_arg(),
            scales.clone().into_array_arg(),
            offsets.into_array_arg(),
            out.clone().into_array_arg(),
            row_words,
            row_blocks,
            q4,
            [dtype.into(), scales.dtype.into()],
        );
        out
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
            qembed_kernel::launch::<R>(
                &ids.client,
                grid(batch * seq),
                CubeDim::new_1d(128),
                codes.into_array_arg(),
                scales.into_array_arg(),
                offsets.into_array_arg(),
                ids.clone().into_array_arg(),
                out.clone().into_array_arg(),
                row_words,
                row_blocks,
                start as u32,
                vocab as u32,
                scale as f32,
                i == 0,
                q4,
                dtypes,
            );
            start += rows;
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn random(n: usize, seed: u64) -> Vec<f32> {
        let mut s = seed;
        (0..n)
            .map(|_| {
                s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                ((s >> 33) as f32 / (1u64 << 31) as f32 - 0.5) * 0.2
            })
            .collect()
    }

    #[test]
    fn quantization_error_is_within_half_a_step() {
        let (rows, cols) = (7, 96);
        let values = random(rows * cols, 3);
        for format in [QuantFormat::Q8, QuantFormat::Q4] {
            let q = HostQuantized::quantize(&values, rows, cols, format).unwrap();
            for (i, (&v, d)) in values.iter().zip(q.dequantize()).enumerate() {
                let step = q.scales[i / BLOCK];
                // Half a step, plus the f16 rounding of the scale over the largest code.
                assert!((v - d).abs() <= 0.5 * step + 0.003 * v.abs() + 1e-6, "{format} {i}: {v} vs {d}");
            }
        }
    }

    #[test]
    fn packing_puts_low_codes_in_low_bits() {
        let q = HostQuantized::from_parts(
            QuantFormat::Q4,
            1,
            32,
            (0..32).map(|i| (i % 16) as u8).collect(),
            vec![1.0],
            vec![0.0],
        )
        .unwrap();
        assert_eq!(q.packed_words()[0], 0x7654_3210);
        assert_eq!(q.packed_words()[2], 0x7654_3210);
        let q8 =
            HostQuantized::from_parts(QuantFormat::Q8, 1, 32, (0..32).map(|i| i as u8).collect(), vec![1.0], vec![])
                .unwrap();
        assert_eq!(q8.packed_words()[1], 0x0706_0504);
    }

    #[test]
    fn bad_shapes_and_values_are_refused() {
        assert_eq!(
            HostQuantized::quantize(&[0.0; 20], 1, 20, QuantFormat::Q8),
            Err(QuantError::Columns { rows: 1, cols: 20 })
        );
        assert!(matches!(HostQuantized::quantize(&[0.0; 31], 1, 32, QuantFormat::Q8), Err(QuantError::Length { .. })));
        let mut v = vec![0.0; 32];
        v[5] = f32::NAN;
        assert!(matches!(
            HostQuantized::quantize(&v, 1, 32, QuantFormat::Q4),
            Err(QuantError::NotFinite { index: 5, .. })
        ));
        assert!(matches!(
            HostQuantized::from_parts(QuantFormat::Q4, 1, 32, vec![16; 32], vec![1.0], vec![0.0]),
            Err(QuantError::Code { index: 0, .. })
        ));
    }

    #[test]
    fn zero_blocks_stay_zero() {
        let q = HostQuantized::quantize(&[0.0; 64], 2, 32, QuantFormat::Q8).unwrap();
        assert!(q.dequantize().iter().all(|&v| v == 0.0));
        let q = HostQuantized::quantize(&[0.25; 32], 1, 32, QuantFormat::Q4).unwrap();
        assert!(q.dequantize().iter().all(|&v| v == 0.25));
    }

    #[test]
    fn rows_slice_matches_the_rows() {
        let values = random(5 * 64, 9);
        let q = HostQuantized::quantize(&values, 5, 64, QuantFormat::Q4).unwrap();
        let part = q.rows_slice(2..4);
        assert_eq!(part.dequantize(), q.dequantize()[2 * 64..4 * 64]);
    }

    #[test]
    fn interleaved_pairs_alternate_row_blocks() {
        for format in [QuantFormat::Q8, QuantFormat::Q4] {
            let (rows, cols) = (8, 64);
            let gate = HostQuantized::quantize(&random(rows * cols, 21), rows, cols, format).unwrap();
            let up = HostQuantized::quantize(&random(rows * cols, 22), rows, cols, format).unwrap();
            let joined = HostQuantized::interleave_pairs(gate.clone(), up.clone(), 4).unwrap();
            assert_eq!((joined.rows, joined.cols), (16, cols));
            for (at, (half, from)) in [(&gate, 0), (&up, 0), (&gate, 4), (&up, 4)].into_iter().enumerate() {
                assert_eq!(
                    joined.rows_slice(at * 4..at * 4 + 4),
                    half.rows_slice(from..from + 4),
                    "{format} block {at}"
                );
            }
            let odd = HostQuantized::quantize(&random(6 * cols, 23), 6, cols, format).unwrap();
            assert!(HostQuantized::interleave_pairs(odd.clone(), odd, 4).is_err(), "rows not a multiple of the block");
            let short = HostQuantized::quantize(&random(4 * cols, 24), 4, cols, format).unwrap();
            assert!(HostQuantized::interleave_pairs(gate.clone(), short, 4).is_err(), "row counts differ");
        }
    }

    #[test]
    fn appended_rows_stack_and_mismatches_are_given_back() {
        let values = random(5 * 64, 11);
        let q = HostQuantized::quantize(&values, 5, 64, QuantFormat::Q4).unwrap();
        let mut top = q.rows_slice(0..2);
        top.append_rows(q.rows_slice(2..5)).unwrap();
        assert_eq!(top, q);
        let q8 = HostQuantized::quantize(&values[..64], 1, 64, QuantFormat::Q8).unwrap();
        assert_eq!(top.append_rows(q8.clone()), Err(q8));
        let narrow = HostQuantized::quantize(&values[..32], 1, 32, QuantFormat::Q4).unwrap();
        assert_eq!(top.append_rows(narrow.clone()), Err(narrow));
        assert_eq!(top, q);
    }
}

/// Shared by the CPU test of the reference and the GPU tests of the kernels: products and
/// gathers against f64 sums over the host-dequantized matrix.
#[cfg(test)]
pub(crate) mod check {
    use super::*;
    use crate::{gpu_test::assert_close, GemmaBackend};

    /// Host random values with a few outliers per row, as real weights have.
    pub fn values(n: usize, seed: u64) -> Vec<f32> {
        let mut s = seed | 1;
        (0..n)
            .map(|i| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                let u = (s >> 11) as f32 / (1u64 << 53) as f32 - 0.5;
                if i % 97 == 0 {
                    u * 0.8
                } else {
                    u * 0.1
                }
            })
            .collect()
    }

    /// A tensor's values as f32 on the host.
    pub fn host<B: Backend, const D: usize>(t: Tensor<B, D>) -> Vec<f32> {
        t.cast(DType::F32).into_data().to_vec::<f32>().expect("f32 data")
    }

    /// `project_quantized` for 1 to 9 activation rows and `embed_quantized`, with `upload`
    /// choosing the backend's layout (or `layout` = `(packed, scale dtype)` when given).
    pub fn quantized<B: GemmaBackend>(device: &B::Device, dtype: DType, seed: u64, layout: Option<(bool, DType)>) {
        let upload = |h: &HostQuantized| match layout {
            Some((packed, scales)) => QuantizedMatrix::<B>::upload(h, packed, scales, device),
            None => B::upload_quantized(h, device),
        };
        for format in [QuantFormat::Q8, QuantFormat::Q4] {
            for (i, (n, inp, out)) in [
                (1, 640, 1024),
                (3, 2560, 37),
                (8, 96, 1001),
                (5, 32, 3),
                (2, 224, 13),
                (1, 1152, 6912),
                (1, 64, 9000),
                (3, 64, 4500),
                (9, 160, 75),
                (17, 64, 33),
            ]
            .into_iter()
            .enumerate()
            {
                let hq =
                    HostQuantized::quantize(&values(out * inp, seed + i as u64), out, inp, format).expect("quantize");
                let w = upload(&hq);
                let xs = values(n * inp, seed ^ 0xABCD + i as u64);
                let x = Tensor::<B, 2>::from_data(TensorData::new(xs, [n, inp]), (device, DType::F32)).cast(dtype);
                let xs = host(x.clone());
                let ws = hq.dequantize();
                let expected: Vec<f32> = (0..n)
                    .flat_map(|r| {
                        let (xs, ws) = (&xs, &ws);
                        (0..out).map(move |o| {
                            (0..inp).map(|c| xs[r * inp + c] as f64 * ws[o * inp + c] as f64).sum::<f64>() as f32
                        })
                    })
                    .collect();
                let got = B::project_quantized(x, &w);
                assert_eq!(got.dtype(), dtype);
                let expected = Tensor::<B, 2>::from_data(TensorData::new(expected, [n, out]), (device, DType::F32));
                let tol = crate::gpu_test::tolerance(dtype)
                    * if dtype == DType::F32 && n > crate::linear::GEMV_MAX_ROWS { 20.0 } else { 2.0 };
                assert_close(got, expected, tol, &format!("{format} project {n}x{inp} -> {out}"));
            }
            // A table of three row blocks (odd sizes), ids in every block plus out-of-range ones.
            let (vocab, hidden) = (203, 96);
            let hq =
                HostQuantized::quantize(&values(vocab * hidden, seed + 77), vocab, hidden, format).expect("quantize");
            let table: Vec<_> = [0..70, 70..141, 141..203].into_iter().map(|r| upload(&hq.rows_slice(r))).collect();
            let ids: Vec<i64> = vec![0, 69, 70, 140, 141, 202, 5, 150, 99, 1];
            let id_tensor = Tensor::<B, 2, Int>::from_data(TensorData::new(ids.clone(), [2, 5]), device);
            let scale = 25.3;
            let got = B::embed_quantized(&table, id_tensor, scale, dtype);
            assert_eq!(got.dtype(), dtype);
            let round = |v: f32| {
                Tensor::<B, 1>::from_data(TensorData::new(vec![v], [1]), (device, DType::F32))
                    .cast(dtype)
                    .cast(DType::F32)
                    .into_data()
                    .to_vec::<f32>()
                    .expect("f32")[0] as f64
            };
            let s = round(scale as f32);
            let deq = hq.dequantize();
            let expected: Vec<f32> = ids
                .iter()
                .flat_map(|&id| {
                    (0..hidden).map(|c| (deq[id as usize * hidden + c] as f64 * s) as f32).collect::<Vec<_>>()
                })
                .collect();
            let expected = Tensor::<B, 3>::from_data(TensorData::new(expected, [2, 5, hidden]), (device, DType::F32));
            assert_close(got, expected, crate::gpu_test::tolerance(dtype) * 2.0, &format!("{format} embed"));
        }
    }
}

#[cfg(all(test, feature = "ndarray"))]
mod reference_tests {
    use crate::test_util::TestBackend;
    use burn::tensor::DType;

    #[test]
    fn reference_matches_host_dequantization() {
        let seed = std::env::var("BURN_GEMMA_TEST_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or(0x5eed);
        super::check::quantized::<TestBackend>(&Default::default(), DType::F32, seed, None);
    }
}

#[cfg(test)]
mod gpu {
    use crate::gpu_test::seed;
    use crate::GemmaBackend;
    use burn::tensor::DType;

    /// The backend's own layout, and packed codes with f32 scales (what devices without f16
    /// use) where the backend's layout uses f16.
    pub fn quantized<B: GemmaBackend>(device: &B::Device, dtype: DType) {
        let s = seed::<B>(device, "quantized");
        super::check::quantized::<B>(device, dtype, s, None);
        super::check::quantized::<B>(device, dtype, s ^ 1, Some((true, DType::F32)));
    }

    gpu_tests!(quantized_matches_host => quantized);
}
