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
//! ([`crate::GemmaBackend::upload_matrix`]): the reference (CPU backends) keeps one `U8` code
//! per weight; the CubeCL backends pack them into `u32` words (4 int8 or 8 nibbles, the lowest
//! bits first), so Q8 costs 8.5 bits per weight and Q4 5 bits on the GPU.

//!
//! Here: the formats and host quantization; [`device`]: the device form; [`gemv`]: the decode
//! product; [`embedding`]: the table gather; [`kquant`]: GGUF's Q4_K, Q5_K and Q6_K kept with
//! their own bits on the GPU; [`ggml`]: GGUF blocks on the host (the Candle backend).

pub mod device;
pub mod embedding;
pub mod gemv;
pub mod ggml;
pub mod kquant;
pub mod mma;

#[cfg(test)]
pub(crate) mod check;

pub use device::{dequantize_reference, project_reference, CodeLayout, QuantizedMatrix};
pub use embedding::embed_reference;
pub use ggml::{GgmlBlocks, GgmlMatrix};
pub use kquant::{HostKQuant, KQuantFormat, KQuantMatrix};
use rayon::prelude::*;

/// The CubeCL launchers, for the backends.
pub(crate) mod kernel {
    pub use super::device::{dequantize, dequantize_rows, Packed};
    pub use super::embedding::embed;
    pub use super::gemv::gemv_into;
}

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
    /// A GGUF tensor type that is not block-quantized, given as blocks.
    #[error("{dtype} is not a block-quantized type")]
    NotBlocks { dtype: String },
    /// Rows that do not split into whole blocks of a GGUF block type.
    #[error("{dtype} rows of {cols} columns do not split into blocks of {block}")]
    BlockColumns { dtype: String, cols: usize, block: usize },
    /// A byte count that does not match the shape.
    #[error("{len} bytes for a [{rows}, {cols}] {dtype} matrix ({expected} expected)")]
    Bytes { dtype: String, rows: usize, cols: usize, len: usize, expected: usize },
    /// A stack of expert matrices whose rows do not split evenly among the experts.
    #[error("a [{rows}, {cols}] stack of matrices does not split into {count} experts")]
    Experts { rows: usize, cols: usize, count: usize },
    /// A column range that does not fall on block boundaries (or is past the matrix).
    #[error("columns {start}..{end} of a matrix of {cols} columns do not fall on blocks of {block}")]
    ColumnSlice { cols: usize, start: usize, end: usize, block: usize },
    /// A GGUF block type that is not a k-quant kept on the GPU (Q4_K, Q5_K, Q6_K).
    #[error("{dtype} is not one of the k-quant types kept as they are (Q4_K, Q5_K, Q6_K)")]
    NotKQuant { dtype: String },
    /// candle-core refused the blocks.
    #[error("candle: {0}")]
    Candle(String),
}

/// The first code past `max` and its index (scanned on rayon's pool: the host checks
/// gigabytes of codes at load); none where every `u8` is in range.
fn first_past(codes: &[u8], max: u8) -> Option<(usize, u8)> {
    if max == u8::MAX {
        return None;
    }
    first_where(codes, |&c| c > max).map(|at| (at, codes[at]))
}

/// The index of the first item of `items` for which `bad` holds, scanned in runs of 64 Ki on
/// rayon's pool (rayon's `position_first` keeps its bookkeeping per item, several times slower
/// than the scan itself).
fn first_where<T: Sync>(items: &[T], bad: impl Fn(&T) -> bool + Sync) -> Option<usize> {
    const RUN: usize = 1 << 16;
    items.par_chunks(RUN).enumerate().find_map_first(|(c, run)| run.iter().position(&bad).map(|at| c * RUN + at))
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

/// `x.round()` (halves away from zero), in operations the compiler vectorizes: `f32::round`
/// is a library call per value, which made quantizing a 1B model take 14 s on two cores. `x -
/// x.trunc()` is exact, so the result is `round`'s for every float.
#[inline]
fn round(x: f32) -> f32 {
    let t = x.trunc();
    let up = if (x - t).abs() >= 0.5 { 1.0f32 } else { 0.0 };
    t + up.copysign(x)
}

/// One block of `BLOCK` values into `dst`'s codes; returns its scale and offset (0 for Q8).
fn quantize_block(format: QuantFormat, src: &[f32], dst: &mut [u8]) -> (f32, f32) {
    match format {
        QuantFormat::Q8 => {
            let amax = src.iter().fold(0.0f32, |m, v| m.max(v.abs()));
            let scale = f16_round(amax / 127.0);
            let inv = if scale > 0.0 { 1.0 / scale } else { 0.0 };
            for (d, &v) in dst.iter_mut().zip(src) {
                *d = (round(v * inv).clamp(-127.0, 127.0) + 128.0) as u8;
            }
            (scale, 0.0)
        }
        QuantFormat::Q4 => {
            let lo = src.iter().fold(f32::INFINITY, |m, &v| m.min(v));
            let hi = src.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
            let offset = f16_round(lo);
            let scale = f16_round((hi - offset) / 15.0);
            let inv = if scale > 0.0 { 1.0 / scale } else { 0.0 };
            for (d, &v) in dst.iter_mut().zip(src) {
                *d = round((v - offset) * inv).clamp(0.0, 15.0) as u8;
            }
            (scale, offset)
        }
    }
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
        // Scanned and quantized on rayon's pool: the host quantizes gigabytes at load.
        if let Some(index) = first_where(values, |v| !v.is_finite()) {
            return Err(QuantError::NotFinite { index, value: values[index] });
        }
        let blocks = rows * cols / BLOCK;
        let mut codes = vec![0u8; values.len()];
        let mut scales = vec![0.0f32; blocks];
        let mut offsets = vec![0.0f32; if format == QuantFormat::Q4 { blocks } else { 0 }];
        // Blocks per task, and each task's (scale, offset) slots; Q8 has no offsets.
        const TASK: usize = 256;
        let offset_slots: Vec<&mut [f32]> = match format {
            QuantFormat::Q4 => offsets.chunks_mut(TASK).collect(),
            QuantFormat::Q8 => (0..blocks.div_ceil(TASK)).map(|_| &mut [][..]).collect(),
        };
        values
            .par_chunks(TASK * BLOCK)
            .zip(codes.par_chunks_mut(TASK * BLOCK))
            .zip(scales.par_chunks_mut(TASK))
            .zip(offset_slots)
            .for_each(|(((values, codes), scales), offsets)| {
                for (b, (src, dst)) in values.chunks_exact(BLOCK).zip(codes.chunks_exact_mut(BLOCK)).enumerate() {
                    let (scale, offset) = quantize_block(format, src, dst);
                    scales[b] = scale;
                    if let Some(slot) = offsets.get_mut(b) {
                        *slot = offset;
                    }
                }
            });
        Ok(Self { format, rows, cols, codes, scales, offsets })
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
        if let Some((index, code)) = first_past(&codes, format.max_code()) {
            return Err(QuantError::Code { index, code, format });
        }
        let scales = scales.into_iter().map(f16_round).collect();
        let offsets = offsets.into_iter().map(f16_round).collect();
        Ok(Self { format, rows, cols, codes, scales, offsets })
    }

    fn check_shape(rows: usize, cols: usize, len: usize) -> Result<(), QuantError> {
        if !cols.is_multiple_of(BLOCK) || cols == 0 {
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

    /// Columns `range` as a matrix of their own (a tensor-parallel shard of a matrix split by
    /// its inputs); the range must start and end on block boundaries.
    pub fn cols_slice(&self, range: std::ops::Range<usize>) -> Result<Self, QuantError> {
        if !range.start.is_multiple_of(BLOCK) || !range.end.is_multiple_of(BLOCK) || range.end > self.cols {
            return Err(QuantError::ColumnSlice { cols: self.cols, start: range.start, end: range.end, block: BLOCK });
        }
        let per_row = self.cols / BLOCK;
        let blocks = range.start / BLOCK..range.end / BLOCK;
        let mut out = Self {
            format: self.format,
            rows: self.rows,
            cols: range.len(),
            codes: Vec::with_capacity(self.rows * range.len()),
            scales: Vec::with_capacity(self.rows * blocks.len()),
            offsets: Vec::new(),
        };
        for row in 0..self.rows {
            out.codes.extend_from_slice(&self.codes[row * self.cols + range.start..row * self.cols + range.end]);
            let row_blocks = row * per_row + blocks.start..row * per_row + blocks.end;
            out.scales.extend_from_slice(&self.scales[row_blocks.clone()]);
            if !self.offsets.is_empty() {
                out.offsets.extend_from_slice(&self.offsets[row_blocks]);
            }
        }
        Ok(out)
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
    #[allow(clippy::result_large_err)] // The caller keeps the two matrices on a mismatch.
    pub fn interleave_pairs(
        gate: HostQuantized,
        up: HostQuantized,
        block: usize,
    ) -> Result<Self, (HostQuantized, HostQuantized)> {
        if gate.format != up.format
            || gate.cols != up.cols
            || gate.rows != up.rows
            || block == 0
            || !gate.rows.is_multiple_of(block)
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
        let (bits, per_word) = (self.format.bits(), self.format.codes_per_word());
        // On rayon's pool: the host packs gigabytes of codes at load.
        self.codes
            .par_chunks_exact(per_word)
            .map(|codes| codes.iter().enumerate().fold(0u32, |acc, (n, &c)| acc | (c as u32) << (n * bits)))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Columns of the dequantized matrix, by row.
    fn columns(values: &[f32], cols: usize, range: std::ops::Range<usize>) -> Vec<f32> {
        values.chunks_exact(cols).flat_map(|row| row[range.clone()].to_vec()).collect()
    }

    /// A column slice on block boundaries holds exactly those columns of the matrix (codes,
    /// scales and offsets alike), in both formats; a slice off the boundaries is refused.
    #[test]
    fn column_slices_hold_the_columns() {
        let (rows, cols) = (5, 4 * BLOCK);
        let values: Vec<f32> = (0..rows * cols).map(|i| ((i * 7919) % 263) as f32 / 131.0 - 1.0).collect();
        for format in [QuantFormat::Q8, QuantFormat::Q4] {
            let whole = HostQuantized::quantize(&values, rows, cols, format).expect("quantizes");
            let full = whole.dequantize();
            for range in [0..BLOCK, BLOCK..3 * BLOCK, 3 * BLOCK..cols] {
                let part = whole.cols_slice(range.clone()).expect("on block boundaries");
                assert_eq!((part.rows, part.cols), (rows, range.len()));
                assert_eq!(part.dequantize(), columns(&full, cols, range), "{format:?}");
            }
            assert!(matches!(whole.cols_slice(1..BLOCK + 1), Err(QuantError::ColumnSlice { .. })));
            assert!(matches!(whole.cols_slice(0..cols + BLOCK), Err(QuantError::ColumnSlice { .. })));
        }
    }

    /// The vectorizable rounding is `f32::round` for every kind of value: halves both ways,
    /// the largest float under a half, integers, huge values, signed zeros.
    #[test]
    fn round_is_std_round() {
        let below_half = f32::from_bits(0.5f32.to_bits() - 1);
        let mut values =
            vec![0.0, -0.0, 0.5, -0.5, 1.5, -1.5, 2.5, -2.5, below_half, -below_half, 126.5, -127.5, 3e9, -3e9];
        values.extend([f32::MAX, f32::MIN, f32::MIN_POSITIVE, 8_388_607.5, -8_388_607.5, 16_777_215.0]);
        let mut s = 0x9E37_79B9u32;
        for _ in 0..100_000 {
            s ^= s << 13;
            s ^= s >> 17;
            s ^= s << 5;
            let v = f32::from_bits(s);
            if v.is_finite() {
                values.push(v);
                values.push((s % 4096) as f32 / 16.0 - 128.0);
            }
        }
        for v in values {
            assert_eq!(round(v).to_bits(), v.round().to_bits(), "round({v})");
        }
    }

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
        // The first bad value or code past several scan runs is the one named.
        let mut v = vec![0.5; 32 * 6_000];
        v[150_001] = f32::INFINITY;
        v[180_000] = f32::NAN;
        assert!(matches!(
            HostQuantized::quantize(&v, 6_000, 32, QuantFormat::Q8),
            Err(QuantError::NotFinite { index: 150_001, .. })
        ));
        let mut codes = vec![3; 32 * 6_000];
        codes[131_073] = 17;
        codes[190_000] = 200;
        assert!(matches!(
            HostQuantized::from_parts(QuantFormat::Q4, 6_000, 32, codes, vec![1.0; 6_000], vec![0.0; 6_000]),
            Err(QuantError::Code { index: 131_073, code: 17, .. })
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
