//! Matrices in GGUF's own block types (Q4_K, Q5_0, Q6_K, Q8_0, ...): on the host as a file
//! stores them ([`GgmlBlocks`]), and held as they are by backends that multiply them without a
//! conversion ([`GgmlMatrix`]: the Candle backend, through candle's quantized CPU kernels).
//!
//! The GPU backends keep Q4_K, Q5_K and Q6_K as they are ([`super::kquant`]). Backends that read
//! only this crate's formats convert the other types at upload ([`GgmlBlocks::to_quantized`]):
//! Q8_0 and Q5_0 to Q8, Q4_0 and Q4_1 to Q4 exactly, Q4_K to Q4 up to rounding its two-level
//! scales to f16, every other type dequantized and requantized to Q8.
//!
//! The product of a [`GgmlMatrix`] ([`product`]): for decode-sized inputs, candle's block dot
//! products: the activations are quantized per block of the weight's type (to Q8_0, Q8_1 or
//! Q8_K, as llama.cpp does on the CPU), then integer dot products run with AVX2 or NEON where
//! candle has them for the type (Q4_0, Q8_0, Q2_K to Q6_K), with this crate's AVX2 kernel for Q5_0
//! ([`q5_0`]), and scalar code otherwise; their
//! difference to the dequantized dense product is that activation rounding, under 1% of a
//! product's magnitude (tested below). Prompts ([`product::DENSE_ROWS`] rows or more) multiply
//! as int8 tiles on CPUs with AVX-512 VNNI ([`tiles`]), in f32 over the weights dequantized in
//! chunks elsewhere.
//! candle picks its AVX2 code at compile time: the repository's `.cargo/config.toml` builds for
//! x86-64-v3.

pub mod gelu;
pub mod product;
pub mod q5_0;
pub mod q8_0;
pub mod tiles;

use super::{HostQuantized, QuantError, QuantFormat, BLOCK};
use crate::Epilogue;
use burn::{
    module::Module,
    tensor::{backend::Backend, DType, Int, Tensor, TensorData},
};
use candle_core::quantized::{ggml_file::qtensor_from_ggml, GgmlDType, QTensor};
use rayon::prelude::*;
use std::{marker::PhantomData, ops::Range, sync::Arc};

/// A `[rows, cols]` matrix in a GGUF block type, its blocks row-major as the file stores them
/// (a row is `cols / block_size` consecutive blocks).
#[derive(Debug, Clone, PartialEq)]
pub struct GgmlBlocks {
    dtype: GgmlDType,
    rows: usize,
    cols: usize,
    bytes: Vec<u8>,
}

impl GgmlBlocks {
    /// Checks that `dtype` is a block type, that rows split into whole blocks and that `bytes`
    /// holds exactly `rows` rows of them.
    pub fn new(dtype: GgmlDType, rows: usize, cols: usize, bytes: Vec<u8>) -> Result<Self, QuantError> {
        if matches!(dtype, GgmlDType::F32 | GgmlDType::F16 | GgmlDType::BF16) {
            return Err(QuantError::NotBlocks { dtype: format!("{dtype:?}") });
        }
        let block = dtype.block_size();
        if cols == 0 || !cols.is_multiple_of(block) {
            return Err(QuantError::BlockColumns { dtype: format!("{dtype:?}"), cols, block });
        }
        let expected = rows.checked_mul(cols / block).and_then(|b| b.checked_mul(dtype.type_size()));
        if expected != Some(bytes.len()) {
            return Err(QuantError::Bytes {
                dtype: format!("{dtype:?}"),
                rows,
                cols,
                len: bytes.len(),
                expected: expected.unwrap_or(usize::MAX),
            });
        }
        Ok(Self { dtype, rows, cols, bytes })
    }

    /// The block type.
    pub fn dtype(&self) -> GgmlDType {
        self.dtype
    }

    /// `[rows, cols]`.
    pub fn shape(&self) -> [usize; 2] {
        [self.rows, self.cols]
    }

    /// The blocks, row-major.
    pub fn bytes(&self) -> &[u8] {
        &self.bytes
    }

    fn row_bytes(&self) -> usize {
        self.cols / self.dtype.block_size() * self.dtype.type_size()
    }

    /// Rows `range` as a matrix of their own.
    pub fn rows_slice(&self, range: Range<usize>) -> Self {
        let row = self.row_bytes();
        Self {
            dtype: self.dtype,
            rows: range.len(),
            cols: self.cols,
            bytes: self.bytes[range.start * row..range.end * row].to_vec(),
        }
    }

    /// Columns `range` as a matrix of their own (a tensor-parallel shard of a matrix split by
    /// its inputs); the range must start and end on the type's block boundaries.
    pub fn cols_slice(&self, range: Range<usize>) -> Result<Self, QuantError> {
        let block = self.dtype.block_size();
        if !range.start.is_multiple_of(block) || !range.end.is_multiple_of(block) || range.end > self.cols {
            return Err(QuantError::ColumnSlice { cols: self.cols, start: range.start, end: range.end, block });
        }
        let size = self.dtype.type_size();
        let (row, from, to) = (self.row_bytes(), range.start / block * size, range.end / block * size);
        let bytes = self.bytes.chunks_exact(row.max(1)).flat_map(|r| &r[from..to]).copied().collect();
        Ok(Self { dtype: self.dtype, rows: self.rows, cols: range.len(), bytes })
    }

    /// Appends `other`'s rows below this matrix's when both have the same type and width (one
    /// product then serves both); gives `other` back otherwise.
    pub fn append_rows(&mut self, other: GgmlBlocks) -> Result<(), GgmlBlocks> {
        if other.dtype != self.dtype || other.cols != self.cols {
            return Err(other);
        }
        self.rows += other.rows;
        self.bytes.extend(other.bytes);
        Ok(())
    }

    /// `gate` and `up` (same type and shape, rows a multiple of `block`) joined with their rows
    /// interleaved in blocks of `block`, as [`HostQuantized::interleave_pairs`] does; both given
    /// back when they do not match.
    #[allow(clippy::result_large_err)] // The caller keeps the two matrices on a mismatch.
    pub fn interleave_pairs(gate: Self, up: Self, block: usize) -> Result<Self, (Self, Self)> {
        if gate.dtype != up.dtype || gate.shape() != up.shape() || block == 0 || !gate.rows.is_multiple_of(block) {
            return Err((gate, up));
        }
        let span = block * gate.row_bytes();
        let mut bytes = Vec::with_capacity(2 * gate.bytes.len());
        for (g, u) in gate.bytes.chunks_exact(span).zip(up.bytes.chunks_exact(span)) {
            bytes.extend_from_slice(g);
            bytes.extend_from_slice(u);
        }
        Ok(Self { dtype: gate.dtype, rows: 2 * gate.rows, cols: gate.cols, bytes })
    }

    /// The blocks as a candle tensor (a copy).
    pub fn qtensor(&self) -> Result<QTensor, QuantError> {
        qtensor_from_ggml(self.dtype, &self.bytes, vec![self.rows, self.cols], &candle_core::Device::Cpu)
            .map_err(candle_error)
    }

    /// All weights, row-major.
    pub fn dequantize(&self) -> Result<Vec<f32>, QuantError> {
        dequantize(&self.qtensor()?)
    }

    /// This crate's format closest to the block type: Q4 for Q4_0, Q4_1 and Q4_K, Q8 otherwise.
    pub fn closest_format(&self) -> QuantFormat {
        match self.dtype {
            GgmlDType::Q4_0 | GgmlDType::Q4_1 | GgmlDType::Q4K => QuantFormat::Q4,
            _ => QuantFormat::Q8,
        }
    }

    /// In [`Self::closest_format`] (see the module docs for which conversions are exact).
    pub fn to_quantized(&self) -> Result<HostQuantized, QuantError> {
        self.to_format(self.closest_format())
    }

    /// In `format`: converted block by block where the type maps onto it, else dequantized and
    /// quantized with [`HostQuantized::quantize`].
    pub fn to_format(&self, format: QuantFormat) -> Result<HostQuantized, QuantError> {
        let (rows, cols, raw) = (self.rows, self.cols, &self.bytes[..]);
        match (self.dtype, format) {
            (GgmlDType::Q8_0, QuantFormat::Q8) => from_q8_0(raw, rows, cols),
            (GgmlDType::Q5_0, QuantFormat::Q8) => from_q5_0(raw, rows, cols),
            (GgmlDType::Q4_0 | GgmlDType::Q4_1 | GgmlDType::Q4K, QuantFormat::Q4) => {
                from_q4(self.dtype, raw, rows, cols)
            }
            _ => HostQuantized::quantize(&self.dequantize()?, rows, cols, format),
        }
    }

    /// The blocks in the type the CPU product ([`product`]) multiplies fastest among those that
    /// hold them exactly: every type as it is, except Q5_0 on a CPU without AVX2 and FMA, widened
    /// to Q8_0 (the same scales, the 5-bit codes as int8): there the Q5_0 dot product is the scalar
    /// one ([`q5_0`]), several times slower than candle's Q8_0 one despite reading 5.5 bits per
    /// weight instead of 8.5.
    pub fn for_candle(self) -> Result<Self, QuantError> {
        match self.dtype {
            GgmlDType::Q5_0 if !q5_0::simd() => Ok(Self::from_quantized(&self.to_format(QuantFormat::Q8)?)),
            _ => Ok(self),
        }
    }

    /// `q` in the GGUF type that holds it exactly: Q8 as Q8_0, Q4 (`scale * q + offset`) as Q4_1.
    pub fn from_quantized(q: &HostQuantized) -> Self {
        let blocks = q.codes.chunks_exact(BLOCK).enumerate();
        let f16 = |v: f32| half::f16::from_f32(v).to_le_bytes();
        let (dtype, bytes) = match q.format {
            QuantFormat::Q8 => {
                let mut bytes = Vec::with_capacity(q.codes.len() / BLOCK * 34);
                for (b, codes) in blocks {
                    bytes.extend_from_slice(&f16(q.scales[b]));
                    bytes.extend(codes.iter().map(|&c| (c as i16 - 128) as i8 as u8));
                }
                (GgmlDType::Q8_0, bytes)
            }
            QuantFormat::Q4 => {
                let mut bytes = Vec::with_capacity(q.codes.len() / BLOCK * 20);
                for (b, codes) in blocks {
                    bytes.extend_from_slice(&f16(q.scales[b]));
                    bytes.extend_from_slice(&f16(q.offsets[b]));
                    // Byte j: element j in the low nibble, element j + 16 in the high one.
                    bytes.extend((0..BLOCK / 2).map(|j| codes[j] | codes[j + BLOCK / 2] << 4));
                }
                (GgmlDType::Q4_1, bytes)
            }
        };
        Self { dtype, rows: q.rows, cols: q.cols, bytes }
    }
}

/// A candle failure on blocks already checked by [`GgmlBlocks::new`].
fn candle_error(e: candle_core::Error) -> QuantError {
    QuantError::Candle(e.to_string())
}

/// A `[rows, cols]` block matrix in f32, rows in parallel ([`product::dequantize`]).
pub(crate) fn dequantize(q: &QTensor) -> Result<Vec<f32>, QuantError> {
    product::dequantize(q).map_err(|e| QuantError::Candle(e.to_string()))
}

pub(crate) fn f16_at(b: &[u8], at: usize) -> f32 {
    half::f16::from_le_bytes([b[at], b[at + 1]]).to_f32()
}

/// Rows converted per task of [`convert_rows`].
const ROWS_PER_TASK: usize = 64;

/// Converts the blocks of `rows` whole rows (`raw`) with `fill` (some rows' bytes, then their
/// codes, scales and offsets to write), tasks of [`ROWS_PER_TASK`] rows on rayon's pool (the
/// one the CPU products use), each writing its own slices of the outputs (the 26B-A4B's 27 GB
/// of experts convert in seconds, not minutes).
fn convert_rows(
    raw: &[u8],
    rows: usize,
    cols: usize,
    format: QuantFormat,
    fill: impl Fn(&[u8], &mut [u8], &mut [f32], &mut [f32]) + Sync,
) -> Result<HostQuantized, QuantError> {
    // `GgmlBlocks::new` checked the byte count; a stray caller gets the same error.
    if rows > 0 && !raw.len().is_multiple_of(rows) {
        let dtype = format!("{format} source");
        return Err(QuantError::Bytes { dtype, rows, cols, len: raw.len(), expected: 0 });
    }
    let (blocks, row_blocks) = (rows * cols / BLOCK, cols / BLOCK);
    let mut codes = vec![0u8; rows * cols];
    let mut scales = vec![0f32; blocks];
    let mut offsets = vec![0f32; if format == QuantFormat::Q4 { blocks } else { 0 }];
    if let Some(row_bytes) = raw.len().checked_div(rows).filter(|&b| b > 0 && row_blocks > 0) {
        let tasks = raw
            .par_chunks(ROWS_PER_TASK * row_bytes)
            .zip(codes.par_chunks_mut(ROWS_PER_TASK * cols))
            .zip(scales.par_chunks_mut(ROWS_PER_TASK * row_blocks));
        if offsets.is_empty() {
            tasks.for_each(|((raw, codes), scales)| fill(raw, codes, scales, &mut []));
        } else {
            let offsets = offsets.par_chunks_mut(ROWS_PER_TASK * row_blocks);
            tasks.zip(offsets).for_each(|(((raw, codes), scales), offsets)| fill(raw, codes, scales, offsets));
        }
    }
    HostQuantized::from_parts(format, rows, cols, codes, scales, offsets)
}

/// Q8_0 (blocks of 34 bytes: f16 scale, 32 int8) as Q8, exactly.
fn from_q8_0(raw: &[u8], rows: usize, cols: usize) -> Result<HostQuantized, QuantError> {
    convert_rows(raw, rows, cols, QuantFormat::Q8, |raw, codes, scales, _| {
        for ((block, codes), scale) in raw.chunks_exact(34).zip(codes.chunks_exact_mut(BLOCK)).zip(scales) {
            *scale = f16_at(block, 0);
            for (c, &q) in codes.iter_mut().zip(&block[2..]) {
                *c = (q as i8 as i16 + 128) as u8;
            }
        }
    })
}

/// Q5_0 (blocks of 22 bytes: f16 scale, the 32 fifth bits, 16 bytes of nibbles; `d * (q - 16)`)
/// as Q8, exactly.
fn from_q5_0(raw: &[u8], rows: usize, cols: usize) -> Result<HostQuantized, QuantError> {
    convert_rows(raw, rows, cols, QuantFormat::Q8, |raw, codes, scales, _| {
        for ((block, codes), scale) in raw.chunks_exact(22).zip(codes.chunks_exact_mut(BLOCK)).zip(scales) {
            *scale = f16_at(block, 0);
            let high = u32::from_le_bytes([block[2], block[3], block[4], block[5]]);
            let qs = &block[6..];
            // Element j: low nibble of byte j, fifth bit j; element j + 16: high nibble, bit j + 16.
            for (j, c) in codes.iter_mut().enumerate() {
                let nibble = if j < 16 { qs[j] & 15 } else { qs[j - 16] >> 4 };
                *c = ((nibble | (((high >> j) & 1) as u8) << 4) as i16 - 16 + 128) as u8;
            }
        }
    })
}

/// Q4_0/Q4_1 nibbles: byte j holds element j (low nibble) and element j + 16 (high nibble).
fn nibbles(qs: &[u8], codes: &mut [u8]) {
    let (low, high) = codes.split_at_mut(qs.len());
    for ((l, h), &q) in low.iter_mut().zip(high).zip(qs) {
        *l = q & 15;
        *h = q >> 4;
    }
}

/// Q4_0 (`d * (q - 8)`), Q4_1 (`d * q + m`) and Q4_K (super-blocks of 256 with 6-bit
/// per-32 scales and mins: `d * sc * q - dmin * m`) as Q4. Q4_0 and Q4_1 convert exactly; Q4_K's
/// products `d * sc` and `dmin * m` are rounded to f16.
fn from_q4(dtype: GgmlDType, raw: &[u8], rows: usize, cols: usize) -> Result<HostQuantized, QuantError> {
    convert_rows(raw, rows, cols, QuantFormat::Q4, |raw, codes, scales, offsets| match dtype {
        GgmlDType::Q4_0 => {
            let blocks = raw.chunks_exact(18).zip(codes.chunks_exact_mut(BLOCK));
            for ((block, codes), (scale, offset)) in blocks.zip(scales.iter_mut().zip(offsets.iter_mut())) {
                let d = f16_at(block, 0);
                (*scale, *offset) = (d, -8.0 * d);
                nibbles(&block[2..], codes);
            }
        }
        GgmlDType::Q4_1 => {
            let blocks = raw.chunks_exact(20).zip(codes.chunks_exact_mut(BLOCK));
            for ((block, codes), (scale, offset)) in blocks.zip(scales.iter_mut().zip(offsets.iter_mut())) {
                (*scale, *offset) = (f16_at(block, 0), f16_at(block, 2));
                nibbles(&block[4..], codes);
            }
        }
        _ => {
            let supers = raw.chunks_exact(144).zip(codes.chunks_exact_mut(256));
            for ((block, codes), (scales, offsets)) in
                supers.zip(scales.chunks_exact_mut(8).zip(offsets.chunks_exact_mut(8)))
            {
                let (d, dmin) = (f16_at(block, 0), f16_at(block, 2));
                let packed = &block[4..16];
                for j in 0..8 {
                    let (sc, m) = q4k_scale_min(j, packed);
                    scales[j] = d * sc as f32;
                    offsets[j] = -dmin * m as f32;
                }
                // 64 elements per 32 bytes: sub-block 2c in the low nibbles, 2c + 1 in the high.
                for (chunk, codes) in block[16..].chunks_exact(32).zip(codes.chunks_exact_mut(64)) {
                    nibbles(chunk, codes);
                }
            }
        }
    })
}

/// The 6-bit scale and min of Q4_K sub-block `j` from the 12 packed bytes.
pub(crate) fn q4k_scale_min(j: usize, s: &[u8]) -> (u8, u8) {
    if j < 4 {
        (s[j] & 63, s[j + 4] & 63)
    } else {
        ((s[j + 4] & 15) | ((s[j - 4] >> 6) << 4), (s[j + 4] >> 4) | ((s[j] >> 6) << 4))
    }
}

/// A `[rows, cols]` matrix in a GGUF block type, in host memory as candle's quantized tensor:
/// what the Candle backend uploads every block-quantized matrix as (see the module docs).
/// Products and gathers put their results on their input's device.
#[derive(Module, Debug)]
pub struct GgmlMatrix<B: Backend> {
    /// The blocks (shared by clones of the module).
    #[module(skip)]
    pub blocks: Arc<QTensor>,
    #[module(skip)]
    pub shape: [usize; 2],
    backend: PhantomData<B>,
}

impl<B: Backend> GgmlMatrix<B> {
    /// `blocks` as candle's tensor.
    pub fn new(blocks: &GgmlBlocks) -> Result<Self, QuantError> {
        Ok(Self { blocks: Arc::new(blocks.qtensor()?), shape: blocks.shape(), backend: PhantomData })
    }

    /// The block type.
    pub fn dtype(&self) -> GgmlDType {
        self.blocks.dtype()
    }

    /// Bytes the blocks occupy.
    pub fn host_bytes(&self) -> usize {
        self.blocks.storage_size_in_bytes()
    }

    /// The whole matrix dense in `dtype` on `device`.
    pub fn dense(&self, dtype: DType, device: &B::Device) -> Tensor<B, 2> {
        let values = checked(dequantize(&self.blocks), "dequantize");
        Tensor::from_data(TensorData::new(values, self.shape), (device, dtype))
    }

    /// `x [n, cols] @ self^T -> [n, rows]` in `x`'s dtype, then `epilogue`, on the host: the
    /// product by [`product::product`] (see the module docs), the GELU of
    /// [`Epilogue::GeluPairs`] by [`gelu::gelu_pairs`] (one pass over the product, in
    /// parallel, where Burn's elementwise operations would take several).
    pub fn product(&self, x: Tensor<B, 2>, epilogue: Epilogue) -> Tensor<B, 2> {
        let n = x.dims()[0];
        let (dtype, device) = (x.dtype(), x.device());
        let values = checked(x.cast(DType::F32).into_data().convert::<f32>().into_vec::<f32>(), "read activations");
        let out = checked(product::product(&values, &self.blocks), "multiply");
        let (out, width) = match epilogue {
            Epilogue::Identity => (out, self.shape[0]),
            Epilogue::GeluPairs => (gelu::gelu_pairs(&out, self.shape[0]), self.shape[0] / 2),
        };
        Tensor::from_data(TensorData::new(out, [n, width]), (&device, dtype))
    }

    /// Rows `ids` (ids outside `0..rows` give zero rows), dequantized: `[ids.len(), cols]` f32
    /// values, row-major.
    fn gather(&self, ids: &[i64]) -> Vec<f32> {
        let [rows, cols] = self.shape;
        let dtype = self.dtype();
        let row = cols / dtype.block_size() * dtype.type_size();
        let data = checked(self.blocks.data(), "read blocks");
        let mut out = vec![0.0; ids.len() * cols];
        for (&id, dst) in ids.iter().zip(out.chunks_exact_mut(cols)) {
            let Some(r) = usize::try_from(id).ok().filter(|&r| r < rows) else { continue };
            let one = qtensor_from_ggml(dtype, &data[r * row..(r + 1) * row], vec![1, cols], &candle_core::Device::Cpu);
            dst.copy_from_slice(&checked(one.map_err(candle_error).and_then(|q| dequantize(&q)), "dequantize a row"));
        }
        out
    }
}

/// A result of candle on a tensor this module built and checked: candle fails only on
/// mismatched shapes or dtypes, which the callers rule out.
fn checked<T, E: std::fmt::Display>(result: Result<T, E>, what: &str) -> T {
    match result {
        Ok(value) => value,
        Err(e) => unreachable!("candle refused to {what} a checked GGUF block matrix: {e}"),
    }
}

/// The scaled embedding gather over a table of GGUF block matrices in row blocks, in `dtype`:
/// only the rows asked for are dequantized; ids outside the table give zero rows (as
/// [`crate::embedding::reference`]).
pub fn embed_reference<B: Backend>(
    table: &[&GgmlMatrix<B>],
    ids: Tensor<B, 2, Int>,
    scale: f64,
    dtype: DType,
) -> Tensor<B, 3> {
    let [batch, seq] = ids.dims();
    let device = ids.device();
    let ids = checked(ids.into_data().convert::<i64>().into_vec::<i64>(), "read ids");
    let cols = table.first().map_or(0, |t| t.shape[1]);
    let mut out = vec![0.0f32; ids.len() * cols];
    let mut start = 0i64;
    for block in table {
        let local: Vec<i64> = ids.iter().map(|&id| id - start).collect();
        for (acc, v) in out.iter_mut().zip(block.gather(&local)) {
            *acc += v;
        }
        start += block.shape[0] as i64;
    }
    Tensor::<B, 2>::from_data(TensorData::new(out, [batch * seq, cols]), (&device, DType::F32))
        .cast(dtype)
        .reshape([batch, seq, cols])
        .mul_scalar(crate::dtype::scale_in(scale, dtype))
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// xorshift bytes from `seed`.
    fn bytes(n: usize, seed: u64) -> Vec<u8> {
        let mut s = seed | 1;
        (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                s as u8
            })
            .collect()
    }

    /// Random blocks of `dtype` with small f16 scales at the block's scale positions.
    pub(crate) fn random_blocks(dtype: GgmlDType, rows: usize, cols: usize, seed: u64) -> GgmlBlocks {
        let size = dtype.type_size();
        let blocks = rows * cols / dtype.block_size();
        // Offsets of the f16 scale fields (Q6_K's scale is its last two bytes).
        let f16_at: &[usize] = match dtype {
            GgmlDType::Q4_1 | GgmlDType::Q5_1 | GgmlDType::Q4K | GgmlDType::Q5K => &[0, 2],
            // Q2_K's `d` and `dmin` follow its scales and codes.
            GgmlDType::Q2K => &[size - 4, size - 2],
            GgmlDType::Q6K | GgmlDType::Q3K => &[size - 2],
            _ => &[0],
        };
        let mut out = bytes(size * blocks, seed);
        for (b, block) in out.chunks_exact_mut(size).enumerate() {
            for (k, &at) in f16_at.iter().enumerate() {
                let sign = if k == 1 && matches!(dtype, GgmlDType::Q4_1 | GgmlDType::Q5_1) { -3.0 } else { 1.0 };
                let v = half::f16::from_f32(0.001 * (1.0 + (b % 7) as f32) * sign);
                block[at..at + 2].copy_from_slice(&v.to_le_bytes());
            }
        }
        GgmlBlocks::new(dtype, rows, cols, out).expect("whole blocks")
    }

    /// A column slice on the type's block boundaries dequantizes to those columns of the whole
    /// matrix; a slice off them is refused.
    #[test]
    fn column_slices_hold_the_columns() {
        for dtype in [GgmlDType::Q8_0, GgmlDType::Q4_0, GgmlDType::Q4K, GgmlDType::Q6K] {
            let block = dtype.block_size();
            let (rows, cols) = (3, 4 * block);
            let whole = random_blocks(dtype, rows, cols, 17);
            let full = whole.dequantize().expect("dequantizes");
            for range in [0..block, block..3 * block] {
                let part = whole.cols_slice(range.clone()).expect("on block boundaries");
                assert_eq!(part.shape(), [rows, range.len()]);
                let expected: Vec<f32> = full.chunks_exact(cols).flat_map(|r| r[range.clone()].to_vec()).collect();
                assert_eq!(part.dequantize().expect("dequantizes"), expected, "{dtype:?}");
            }
            assert!(matches!(whole.cols_slice(block / 2..block), Err(QuantError::ColumnSlice { .. })));
        }
    }

    /// `x` (rows of `cols`) as the block dot products of `dtype` read it: quantized to the 8-bit
    /// block type candle pairs with it (`GgmlType::VecDotType`) and back to f32.
    #[cfg(feature = "ndarray")]
    fn quantized_activations(dtype: GgmlDType, x: &[f32], cols: usize) -> Vec<f32> {
        use candle_core::quantized::k_quants::{BlockQ8K, BlockQ8_0, GgmlType};
        fn round_trip<T: GgmlType>(x: &[f32], cols: usize) -> Vec<f32> {
            let mut out = vec![0.0; x.len()];
            for (row, dst) in x.chunks(cols).zip(out.chunks_mut(cols)) {
                let mut blocks = vec![T::zeros(); cols / T::BLCK_SIZE];
                T::from_float(row, &mut blocks);
                T::to_float(&blocks, dst);
            }
            out
        }
        // Q8_1 (Q4_1's and Q5_1's partner) quantizes as Q8_0 does, plus the block's sum (an f16,
        // covered by the caller's bound); candle does not dequantize it.
        match dtype {
            GgmlDType::Q2K | GgmlDType::Q3K | GgmlDType::Q4K | GgmlDType::Q5K | GgmlDType::Q6K => {
                round_trip::<BlockQ8K>(x, cols)
            }
            _ => round_trip::<BlockQ8_0>(x, cols),
        }
    }

    pub(crate) fn seed() -> u64 {
        crate::gpu_test::host_seed("quant::ggml")
    }

    #[test]
    fn block_conversions_match_candle_dequantization() {
        // More rows than one conversion task takes (two whole tasks and a part).
        let (rows, cols) = (131, 512);
        let seed = seed();
        for dtype in [GgmlDType::Q8_0, GgmlDType::Q5_0, GgmlDType::Q4_0, GgmlDType::Q4_1, GgmlDType::Q4K] {
            let blocks = random_blocks(dtype, rows, cols, seed);
            let expected = blocks.dequantize().expect("candle dequantizes");
            let ours = blocks.to_quantized().expect("converts");
            let lossless = dtype != GgmlDType::Q4K;
            for (i, (a, b)) in ours.dequantize().iter().zip(&expected).enumerate() {
                // Q4_K: d * sc and dmin * m rounded to f16 (relative 2^-11 of each term).
                let block = i / BLOCK;
                let tol = if lossless {
                    0.0
                } else {
                    1e-3 * (ours.scales[block].abs() * 15.0 + ours.offsets.get(block).map_or(0.0, |o| o.abs()))
                };
                assert!((a - b).abs() <= tol, "{dtype:?} element {i}: {a} vs {b}");
            }
        }
    }

    #[test]
    fn other_block_types_are_requantized_to_q8() {
        let seed = seed();
        let blocks = random_blocks(GgmlDType::Q6K, 2, 256, seed);
        let expected = blocks.dequantize().expect("candle dequantizes");
        let q = blocks.to_quantized().expect("converts");
        assert_eq!(q.format, QuantFormat::Q8);
        for (i, (a, b)) in q.dequantize().iter().zip(&expected).enumerate() {
            assert!((a - b).abs() <= 0.51 * q.scales[i / BLOCK] + 1e-6, "element {i}: {a} vs {b}");
        }
    }

    #[test]
    fn our_formats_convert_to_gguf_blocks_exactly() {
        let seed = seed();
        let values: Vec<f32> = bytes(5 * 96, seed).into_iter().map(|b| (b as f32 - 127.5) * 0.001).collect();
        for format in [QuantFormat::Q8, QuantFormat::Q4] {
            let q = HostQuantized::quantize(&values, 5, 96, format).expect("quantizes");
            let blocks = GgmlBlocks::from_quantized(&q);
            assert_eq!(blocks.dequantize().expect("candle dequantizes"), q.dequantize(), "{format}");
            assert_eq!(blocks.to_quantized().expect("converts back"), q, "{format} round trip");
        }
    }

    #[test]
    fn row_operations_move_whole_rows() {
        let seed = seed();
        let m = random_blocks(GgmlDType::Q5_0, 8, 64, seed);
        let values = m.dequantize().expect("dequantizes");
        let row = |r: usize| values[r * 64..(r + 1) * 64].to_vec();
        assert_eq!(m.rows_slice(2..5).dequantize().expect("dequantizes"), values[2 * 64..5 * 64]);
        let mut top = m.rows_slice(0..3);
        top.append_rows(m.rows_slice(3..8)).expect("same type and width");
        assert_eq!(top, m);
        let other = random_blocks(GgmlDType::Q8_0, 1, 64, seed);
        assert_eq!(top.append_rows(other.clone()), Err(other));
        let (gate, up) = (m.rows_slice(0..4), m.rows_slice(4..8));
        let joined = GgmlBlocks::interleave_pairs(gate.clone(), up.clone(), 2).expect("matching halves");
        let got = joined.dequantize().expect("dequantizes");
        for (at, source) in [0, 1, 4, 5, 2, 3, 6, 7].into_iter().enumerate() {
            assert_eq!(got[at * 64..(at + 1) * 64], row(source), "joined row {at}");
        }
        assert!(GgmlBlocks::interleave_pairs(gate, up.rows_slice(0..2), 2).is_err(), "row counts differ");
    }

    #[test]
    fn bad_blocks_are_refused() {
        assert!(matches!(GgmlBlocks::new(GgmlDType::F32, 1, 4, vec![0; 16]), Err(QuantError::NotBlocks { .. })));
        assert!(matches!(
            GgmlBlocks::new(GgmlDType::Q4K, 1, 320, vec![0; 144]),
            Err(QuantError::BlockColumns { cols: 320, block: 256, .. })
        ));
        assert!(matches!(
            GgmlBlocks::new(GgmlDType::Q8_0, 2, 64, vec![0; 135]),
            Err(QuantError::Bytes { len: 135, expected: 136, .. })
        ));
        assert!(matches!(
            GgmlBlocks::new(GgmlDType::Q8_0, usize::MAX, 64, vec![]),
            Err(QuantError::Bytes { expected: usize::MAX, .. })
        ));
    }

    #[cfg(feature = "ndarray")]
    #[test]
    fn products_and_gathers_match_the_dequantized_matrix() {
        use crate::test_util::TestBackend as B;
        let device = Default::default();
        let seed = seed();
        // Odd row counts; widths of whole Q4_K / Q6_K super-blocks where those are tested.
        for (dtype, rows, cols) in [
            (GgmlDType::Q8_0, 37, 96),
            (GgmlDType::Q5_0, 19, 160),
            (GgmlDType::Q4_0, 5, 64),
            (GgmlDType::Q4_1, 7, 64),
            (GgmlDType::Q4K, 11, 512),
            (GgmlDType::Q6K, 13, 256),
        ] {
            let blocks = random_blocks(dtype, rows, cols, seed);
            let w = GgmlMatrix::<B>::new(&blocks).expect("candle tensor");
            let x_values: Vec<f32> = bytes(3 * cols, seed ^ 5).into_iter().map(|b| (b as f32 - 127.5) / 64.0).collect();
            let x = Tensor::<B, 2>::from_data(TensorData::new(x_values, [3, cols]), &device);
            let got = w.product(x.clone(), Epilogue::Identity).into_data().to_vec::<f32>().expect("f32");
            // Quantization-aware reference: the activations quantized as the block dot products
            // take them (candle's 8-bit blocks for the type), multiplied with the dequantized
            // matrix in f64. What is left is the f32 sums' order and, for the types whose dot
            // adds `min * sum(x)` (Q4_1), that sum kept as an f16 (2^-11 relative): bounded by
            // 2^-8 of the sum of the products' magnitudes.
            let xq = quantized_activations(dtype, &x.to_data().to_vec::<f32>().expect("f32"), cols);
            let dense = w.dense(DType::F32, &device).into_data().to_vec::<f32>().expect("f32");
            for (i, a) in got.iter().enumerate() {
                let (r, c) = (i / rows, i % rows);
                let terms = (0..cols).map(|j| f64::from(xq[r * cols + j]) * f64::from(dense[c * cols + j]));
                let (expected, magnitude) = terms.fold((0.0, 0.0), |(s, m), t| (s + t, m + t.abs()));
                assert!(a.is_finite(), "{dtype:?} {i}: {a}");
                let bound = magnitude / 256.0;
                assert!(
                    (f64::from(*a) - expected).abs() <= bound,
                    "{dtype:?} output {i}: {a} vs {expected} (bound {bound})"
                );
            }
            let ids = Tensor::<B, 2, Int>::from_data(TensorData::new(vec![3i64, -1, rows as i64, 0], [2, 2]), &device);
            let table = [&w];
            let gathered = embed_reference(&table, ids, 2.0, DType::F32).into_data().to_vec::<f32>().expect("f32");
            let dense = blocks.dequantize().expect("dequantizes");
            assert_eq!(gathered[..cols], dense[3 * cols..4 * cols].iter().map(|v| v * 2.0).collect::<Vec<_>>());
            assert!(gathered[cols..3 * cols].iter().all(|&v| v == 0.0), "ids outside the table give zeros");
            assert_eq!(gathered[3 * cols..], dense[..cols].iter().map(|v| v * 2.0).collect::<Vec<_>>());
        }
    }
}
