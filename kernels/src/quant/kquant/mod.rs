//! GGUF's k-quant matrices (Q4_K, Q5_K, Q6_K) on the GPU with the file's own bits: the codes,
//! the 6- or 8-bit sub-block scales and the f16 super-block scales are rearranged at upload so
//! the kernels read them with aligned vector loads, and nothing is rounded or widened, so a
//! token reads exactly the bytes the file holds (4.5, 5.5 and 6.5625 bits per weight where the
//! scales are kept in f16).
//!
//! A super-block is [`SUPER`] consecutive weights of a row. On the device ([`KQuantMatrix`]):
//! - `lo`: the low four bits of every code, eight per `u32` word, lowest bits first, in the
//!   weights' order (GGUF interleaves them by 32s; the upload puts them in order);
//! - `hi`: the fifth bit (Q5_K, 32 codes per word) or the fifth and sixth (Q6_K, 16 per word),
//!   in the same order; none for Q4_K;
//! - `meta`: the sub-block scales as the file packs them: Q4_K and Q5_K's 12 bytes of 6-bit
//!   scales and mins for 8 sub-blocks of 32 (three words), Q6_K's 16 signed bytes for 16
//!   sub-blocks of 16 (four words);
//! - `supers`: per super-block `d` and `dmin` (Q4_K, Q5_K) or `d` (Q6_K), f16 where the device
//!   has it.
//!
//! A weight is `d * sc * q - dmin * m` (Q4_K: `q` the 4-bit code; Q5_K: 5 bits) or
//! `d * sc * (q - 32)` (Q6_K, `sc` signed), as GGUF defines them ([`HostKQuant::value`]).
//!
//! Here: the formats, the host rearrangement and reference, the device form; [`gemv`]: the decode
//! product; [`dequant`]: the dense matrix (prompts) and the embedding gather.
//!
//! Measured on the H200 (`docs/runs/gpu/2026-11-28-kquant.md`), the matrix-vector kernel reads these
//! fewer bytes more slowly than the Q4/Q8 kernel reads the converted matrices (Q4_K 0.90x, Q6_K
//! 0.80x of their decode speed): it is bound by the instructions that decode the scales and join
//! the code bits. So the GPU backends convert by default ([`crate::PreferredBlocks::Converted`]);
//! [`crate::HostMatrix::Ggml`] uploads with `WeightFormat::Native` keep these.

#[cfg(test)]
mod check;
pub mod dequant;
pub mod gemv;

use super::ggml::{f16_at, q4k_scale_min};
use super::{GgmlBlocks, QuantError};
use burn::{
    module::{Module, Param},
    tensor::{backend::Backend, DType, Int, Tensor, TensorData},
};
use candle_core::quantized::GgmlDType;
use rayon::prelude::*;

/// Weights per super-block.
pub const SUPER: usize = 256;

/// Weights per code vector of the kernels: one Q4_K/Q5_K sub-block, two Q6_K ones.
pub const VECTOR: usize = 32;

/// A k-quant block type kept as it is on the GPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum KQuantFormat {
    /// 4-bit codes, 6-bit scale and min per 32 weights, f16 `d` and `dmin` per 256.
    Q4K,
    /// Q4_K with a fifth code bit.
    Q5K,
    /// 6-bit codes, a signed 8-bit scale per 16 weights, f16 `d` per 256.
    Q6K,
}

impl KQuantFormat {
    /// The format of a GGUF block type, where it is one of these.
    pub fn of(dtype: GgmlDType) -> Option<Self> {
        match dtype {
            GgmlDType::Q4K => Some(Self::Q4K),
            GgmlDType::Q5K => Some(Self::Q5K),
            GgmlDType::Q6K => Some(Self::Q6K),
            _ => None,
        }
    }

    /// The GGUF block type.
    pub fn ggml(self) -> GgmlDType {
        match self {
            Self::Q4K => GgmlDType::Q4K,
            Self::Q5K => GgmlDType::Q5K,
            Self::Q6K => GgmlDType::Q6K,
        }
    }

    /// Code bits past the low four: 0, 1 or 2.
    pub fn hi_bits(self) -> usize {
        match self {
            Self::Q4K => 0,
            Self::Q5K => 1,
            Self::Q6K => 2,
        }
    }

    /// `u32` words of sub-block scales per super-block.
    pub fn meta_words(self) -> usize {
        match self {
            Self::Q4K | Self::Q5K => 3,
            Self::Q6K => 4,
        }
    }

    /// Super-block scales per super-block (`d` and `dmin`, or `d`).
    pub fn supers(self) -> usize {
        match self {
            Self::Q4K | Self::Q5K => 2,
            Self::Q6K => 1,
        }
    }

    /// The kernels' compile-time tag (0, 1, 2).
    pub(crate) fn tag(self) -> u32 {
        self.hi_bits() as u32
    }
}

impl std::fmt::Display for KQuantFormat {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Q4K => "q4_k",
            Self::Q5K => "q5_k",
            Self::Q6K => "q6_k",
        })
    }
}

/// A k-quant matrix on the host in the device's arrangement (see the module docs), row-major.
#[derive(Debug, Clone, PartialEq)]
pub struct HostKQuant {
    pub format: KQuantFormat,
    pub rows: usize,
    pub cols: usize,
    /// `[rows, cols / 8]`.
    pub lo: Vec<u32>,
    /// `[rows, cols * hi_bits / 32]` (empty for Q4_K).
    pub hi: Vec<u32>,
    /// `[rows, cols / 256 * meta_words]`.
    pub meta: Vec<u32>,
    /// `[rows, cols / 256 * supers]`, each an f16 value.
    pub supers: Vec<f32>,
}

fn word_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

/// One super-block's codes (`0..16`, `0..32` or `0..64`) in the weights' order, from GGUF's
/// interleaved layout.
fn codes_of(format: KQuantFormat, block: &[u8]) -> [u8; SUPER] {
    let mut q = [0u8; SUPER];
    match format {
        KQuantFormat::Q4K | KQuantFormat::Q5K => {
            // Q4_K: d, dmin, 12 scale bytes, 128 code bytes; Q5_K: the 32 high-bit bytes first.
            let (qh, qs) =
                if format == KQuantFormat::Q5K { (&block[16..48], &block[48..]) } else { (&[][..], &block[16..]) };
            for chunk in 0..4 {
                for l in 0..32 {
                    let byte = qs[32 * chunk + l];
                    for (half, nibble) in [(0, byte & 0xF), (1, byte >> 4)] {
                        let high = if qh.is_empty() { 0 } else { (qh[l] >> (2 * chunk + half)) & 1 };
                        q[64 * chunk + 32 * half + l] = nibble | high << 4;
                    }
                }
            }
        }
        KQuantFormat::Q6K => {
            let (ql, qh) = (&block[..128], &block[128..192]);
            for n in 0..2 {
                let (ql, qh) = (&ql[64 * n..], &qh[32 * n..]);
                for l in 0..32 {
                    let at = 128 * n + l;
                    q[at] = (ql[l] & 0xF) | (qh[l] & 3) << 4;
                    q[at + 32] = (ql[l + 32] & 0xF) | ((qh[l] >> 2) & 3) << 4;
                    q[at + 64] = (ql[l] >> 4) | ((qh[l] >> 4) & 3) << 4;
                    q[at + 96] = (ql[l + 32] >> 4) | ((qh[l] >> 6) & 3) << 4;
                }
            }
        }
    }
    q
}

/// One super-block's share of the device arrays.
struct Rearranged<'a> {
    lo: &'a mut [u32],
    hi: Option<&'a mut [u32]>,
    meta: &'a mut [u32],
    supers: &'a mut [f32],
}

impl Rearranged<'_> {
    /// Writes the super-block `block` (GGUF bytes) of `format`.
    fn fill(self, format: KQuantFormat, block: &[u8]) {
        let q = codes_of(format, block);
        for (w, word) in self.lo.iter_mut().enumerate() {
            *word = (0..8).fold(0, |acc, n| acc | ((q[8 * w + n] & 0xF) as u32) << (4 * n));
        }
        if let Some(hi) = self.hi {
            let hb = format.hi_bits();
            let per = 32 / hb;
            for (w, word) in hi.iter_mut().enumerate() {
                *word = (0..per).fold(0, |acc, n| acc | ((q[per * w + n] >> 4) as u32) << (hb * n));
            }
        }
        let (supers_at, meta_at) = match format {
            KQuantFormat::Q4K | KQuantFormat::Q5K => (&[0, 2][..], 4),
            KQuantFormat::Q6K => (&[208][..], 192),
        };
        for (value, &at) in self.supers.iter_mut().zip(supers_at) {
            *value = f16_at(block, at);
        }
        for (k, word) in self.meta.iter_mut().enumerate() {
            *word = word_at(block, meta_at + 4 * k);
        }
    }
}

impl HostKQuant {
    /// Rearranges `blocks` (Q4_K, Q5_K or Q6_K) for the device; other types are refused.
    pub fn from_blocks(blocks: &GgmlBlocks) -> Result<Self, QuantError> {
        let dtype = blocks.dtype();
        let format = KQuantFormat::of(dtype).ok_or_else(|| QuantError::NotKQuant { dtype: format!("{dtype:?}") })?;
        let [rows, cols] = blocks.shape();
        let (size, hb) = (dtype.type_size(), format.hi_bits());
        let per_row = cols / SUPER;
        let (mw, sw) = (format.meta_words(), format.supers());
        let mut out = Self {
            format,
            rows,
            cols,
            lo: vec![0; rows * cols / 8],
            hi: vec![0; rows * cols * hb / 32],
            meta: vec![0; rows * per_row * mw],
            supers: vec![0.0; rows * per_row * sw],
        };
        let hi_words = SUPER * hb / 32;
        // One task per super-block column range of a row (on rayon's pool: a 12B's matrices
        // are gigabytes).
        let lo = out.lo.par_chunks_mut(SUPER / 8);
        let hi = out.hi.par_chunks_mut(hi_words.max(1));
        let meta = out.meta.par_chunks_mut(mw);
        let supers = out.supers.par_chunks_mut(sw);
        let raw = blocks.bytes().par_chunks_exact(size);
        if hb == 0 {
            raw.zip(lo).zip(meta).zip(supers).for_each(|(((block, lo), meta), supers)| {
                Rearranged { lo, hi: None, meta, supers }.fill(format, block)
            });
        } else {
            raw.zip(lo).zip(meta).zip(supers).zip(hi).for_each(|((((block, lo), meta), supers), hi)| {
                Rearranged { lo, hi: Some(hi), meta, supers }.fill(format, block)
            });
        }
        Ok(out)
    }

    /// The code of weight `i` (row-major).
    fn code(&self, i: usize) -> u32 {
        let lo = (self.lo[i / 8] >> (4 * (i % 8))) & 0xF;
        match self.format.hi_bits() {
            0 => lo,
            hb => {
                let per = 32 / hb;
                lo | ((self.hi[i / per] >> (hb * (i % per))) & ((1 << hb) - 1)) << 4
            }
        }
    }

    /// Weight `i` (row-major), computed as GGUF's dequantization does.
    pub fn value(&self, i: usize) -> f32 {
        let sb = i / SUPER;
        let within = i % SUPER;
        let words = self.format.meta_words();
        let mut bytes = [0u8; 16];
        for (k, word) in self.meta[sb * words..(sb + 1) * words].iter().enumerate() {
            bytes[4 * k..4 * k + 4].copy_from_slice(&word.to_le_bytes());
        }
        let q = self.code(i) as f32;
        match self.format {
            KQuantFormat::Q4K | KQuantFormat::Q5K => {
                let (d, dmin) = (self.supers[2 * sb], self.supers[2 * sb + 1]);
                let (sc, m) = q4k_scale_min(within / 32, &bytes);
                d * sc as f32 * q - dmin * m as f32
            }
            KQuantFormat::Q6K => self.supers[sb] * bytes[within / 16] as i8 as f32 * (q - 32.0),
        }
    }

    /// All weights, row-major.
    pub fn dequantize(&self) -> Vec<f32> {
        (0..self.rows * self.cols).into_par_iter().map(|i| self.value(i)).collect()
    }
}

/// A k-quant `[rows, cols]` matrix on the device (see the module docs).
#[derive(Module, Debug)]
pub struct KQuantMatrix<B: Backend> {
    /// `[rows, cols / 8]` `u32`.
    pub lo: Param<Tensor<B, 2, Int>>,
    /// `[rows, cols * hi_bits / 32]` `u32` (Q5_K, Q6_K).
    pub hi: Option<Param<Tensor<B, 2, Int>>>,
    /// `[rows, cols / 256 * meta_words]` `u32`.
    pub meta: Param<Tensor<B, 2, Int>>,
    /// `[rows, cols / 256 * supers]`, f16 or f32.
    pub supers: Param<Tensor<B, 2>>,
    #[module(skip)]
    pub format: KQuantFormat,
    #[module(skip)]
    pub shape: [usize; 2],
}

impl<B: Backend> KQuantMatrix<B> {
    /// Uploads `host` with its super-block scales in `scale_dtype` (each tensor flat, then
    /// viewed as a matrix: see [`super::QuantizedMatrix::upload`]).
    pub fn upload(host: &HostKQuant, scale_dtype: DType, device: &B::Device) -> Self {
        let words = |v: &[u32]| {
            let per_row = v.len() / host.rows.max(1);
            Tensor::<B, 1, Int>::from_data(TensorData::new(v.to_vec(), [v.len()]), (device, DType::U32))
                .reshape([host.rows, per_row])
        };
        let supers =
            Tensor::<B, 1>::from_data(TensorData::new(host.supers.clone(), [host.supers.len()]), (device, scale_dtype))
                .reshape([host.rows, host.supers.len() / host.rows.max(1)]);
        Self {
            lo: super::device::int_param(words(&host.lo)),
            hi: (!host.hi.is_empty()).then(|| super::device::int_param(words(&host.hi))),
            meta: super::device::int_param(words(&host.meta)),
            supers: Param::from_tensor(supers),
            format: host.format,
            shape: [host.rows, host.cols],
        }
    }

    /// Bytes the matrix occupies on the device.
    pub fn device_bytes(&self) -> usize {
        let int = |t: &Tensor<B, 2, Int>| t.shape().num_elements() * t.dtype().size();
        let supers = self.supers.val();
        int(&self.lo.val())
            + self.hi.as_ref().map_or(0, |h| int(&h.val()))
            + int(&self.meta.val())
            + supers.shape().num_elements() * supers.dtype().size()
    }

    /// The matrix read back to the host (the reference's input).
    pub fn to_host(&self) -> HostKQuant {
        let words = |t: Tensor<B, 2, Int>| t.into_data().iter::<u32>().collect::<Vec<u32>>();
        HostKQuant {
            format: self.format,
            rows: self.shape[0],
            cols: self.shape[1],
            lo: words(self.lo.val()),
            hi: self.hi.as_ref().map_or_else(Vec::new, |h| words(h.val())),
            meta: words(self.meta.val()),
            supers: self.supers.val().cast(DType::F32).into_data().iter::<f32>().collect(),
        }
    }

    /// Reference: the dense `[rows, cols]` matrix in `dtype` (read back and dequantized on the
    /// host).
    pub fn dense_reference(&self, dtype: DType) -> Tensor<B, 2> {
        let device = self.lo.val().device();
        Tensor::<B, 2>::from_data(TensorData::new(self.to_host().dequantize(), self.shape), (&device, DType::F32))
            .cast(dtype)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::ggml::tests::random_blocks;

    #[test]
    fn rearranged_blocks_dequantize_as_gguf_does() {
        let seed = crate::gpu_test::host_seed("kquant::rearranged");
        for (i, dtype) in [GgmlDType::Q4K, GgmlDType::Q5K, GgmlDType::Q6K].into_iter().enumerate() {
            let blocks = random_blocks(dtype, 7, 768, seed + i as u64);
            let host = HostKQuant::from_blocks(&blocks).expect("k-quant");
            let reference = blocks.dequantize().expect("candle dequantizes");
            let ours = host.dequantize();
            assert_eq!(ours.len(), reference.len());
            for (at, (a, b)) in ours.iter().zip(&reference).enumerate() {
                assert!((a - b).abs() <= 1e-6 * b.abs().max(1e-3), "{dtype:?} weight {at}: {a} vs {b}");
            }
            // The file's bits, rearranged: the same byte count where the scales are f16.
            let bytes = 4 * (host.lo.len() + host.hi.len() + host.meta.len()) + 2 * host.supers.len();
            assert_eq!(bytes, blocks.bytes().len(), "{dtype:?}");
        }
    }

    #[test]
    fn other_block_types_are_refused() {
        let blocks = random_blocks(GgmlDType::Q8_0, 2, 64, 1);
        assert!(matches!(HostKQuant::from_blocks(&blocks), Err(QuantError::NotKQuant { .. })));
    }
}
