//! The dot product of a row of Q8_0 weight blocks with a row of Q8_0 activation blocks, with
//! AVX2 where the CPU has it: the LM head of Gemma's GGUFs (the tied embedding table, Q8_0 in
//! Gemma 3 270M's Q4_K_M file) is most of a decode token on the CPU.
//!
//! Why not candle's: candle's AVX2 Q8_0 dot converts each block's two f16 scales through
//! `half`, which outside code compiled for F16C checks the CPU and calls its converter, two
//! calls a block beside about eight vector instructions; here one F16C instruction converts
//! both ([`super::q5_0`] does the same). A Q8_0 block is 34 bytes: the f16 scale and 32 `i8`
//! codes.

#[cfg(any(target_arch = "x86_64", test))]
use super::q5_0::bytes;
use candle_core::quantized::k_quants::{BlockQ8_0, GgmlType};

#[cfg(any(target_arch = "x86_64", test))]
const BLOCK: usize = 32;
#[cfg(any(target_arch = "x86_64", test))]
const Q8_0_BYTES: usize = 34;

/// The dot product of two block rows, as [`GgmlType::vec_dot`] takes it.
pub type DotFn = fn(usize, &[BlockQ8_0], &[BlockQ8_0]) -> f32;

/// The fastest dot product this CPU runs: the AVX2 kernel where [`super::q5_0::simd`] finds
/// AVX2, FMA and F16C, else candle's.
pub fn dot_fn() -> DotFn {
    #[cfg(target_arch = "x86_64")]
    if super::q5_0::simd() {
        return avx2_dot;
    }
    BlockQ8_0::vec_dot
}

#[cfg(target_arch = "x86_64")]
fn avx2_dot(_n: usize, w: &[BlockQ8_0], x: &[BlockQ8_0]) -> f32 {
    // SAFETY: `dot_fn` hands this function out only after `simd()` found AVX2, FMA and F16C.
    unsafe { avx2::dot(bytes(w), bytes(x)) }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::{BLOCK, Q8_0_BYTES};
    use std::arch::x86_64::*;

    /// Per block: the weight codes' magnitudes times the activation codes carrying the weights'
    /// signs (`maddubs`, unsigned times signed), the pair sums widened to eight `i32`, converted
    /// and accumulated with both scales in eight f32 lanes (candle's arithmetic, with the scales
    /// by F16C).
    ///
    /// # Safety
    /// The CPU must have AVX2, FMA and F16C.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn dot(w: &[u8], x: &[u8]) -> f32 {
        let ones = _mm256_set1_epi16(1);
        let mut acc = _mm256_setzero_ps();
        for (w, x) in w.chunks_exact(Q8_0_BYTES).zip(x.chunks_exact(Q8_0_BYTES)) {
            let d = super::super::q5_0::avx2::scales(w, x);
            let a = _mm256_loadu_si256(w.as_ptr().add(Q8_0_BYTES - BLOCK).cast());
            let b = _mm256_loadu_si256(x.as_ptr().add(Q8_0_BYTES - BLOCK).cast());
            let pairs = _mm256_maddubs_epi16(_mm256_sign_epi8(a, a), _mm256_sign_epi8(b, a));
            acc = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, ones)), acc);
        }
        let half = _mm_add_ps(_mm256_extractf128_ps::<1>(acc), _mm256_castps256_ps128(acc));
        let quarter = _mm_add_ps(half, _mm_movehl_ps(half, half));
        _mm_cvtss_f32(_mm_add_ss(quarter, _mm_shuffle_ps::<1>(quarter, quarter)))
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::seed;
    use super::*;

    /// Rows of `blocks` Q8_0 blocks quantized from seeded values of magnitude up to `range`.
    fn row(blocks: usize, seed: u64, range: f32) -> Vec<BlockQ8_0> {
        let mut s = seed;
        let values: Vec<f32> = (0..blocks * BLOCK)
            .map(|_| {
                s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                ((s >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 2.0 * range
            })
            .collect();
        let mut out = vec![BlockQ8_0::zeros(); blocks];
        BlockQ8_0::from_float(&values, &mut out);
        out
    }

    /// The AVX2 kernel against the f64 dot product of the same blocks, on odd block counts:
    /// equal up to the f32 rounding of the scales' product and of summing the blocks in eight
    /// lanes (n + 8 roundings of terms bounded by the sum of their magnitudes).
    #[test]
    fn simd_dot_matches_f64() {
        let seed = seed();
        if !super::super::q5_0::simd() {
            println!("this CPU has no AVX2, FMA and F16C: dot_fn() is candle's own");
        }
        let dot = dot_fn();
        for blocks in [1, 3, 7, 20, 81] {
            let w = row(blocks, seed ^ (blocks as u64) << 8, 0.1);
            let x = row(blocks, seed ^ 0x5eed ^ blocks as u64, 3.0);
            let got = dot(blocks * BLOCK, &w, &x);
            let (mut want, mut magnitude) = (0f64, 0f64);
            for (w, x) in bytes(&w).chunks_exact(Q8_0_BYTES).zip(bytes(&x).chunks_exact(Q8_0_BYTES)) {
                let scale = |b: &[u8]| half::f16::from_le_bytes([b[0], b[1]]).to_f64();
                let products = w[2..].iter().zip(&x[2..]).map(|(&a, &b)| a as i8 as i64 * b as i8 as i64);
                let ints: i64 = products.clone().sum();
                let abs: i64 = products.map(i64::abs).sum();
                let d = scale(w) * scale(x);
                want += ints as f64 * d;
                magnitude += abs as f64 * d.abs();
            }
            let bound = 2.0 * (blocks + 8) as f64 * f32::EPSILON as f64 * magnitude;
            assert!(got.is_finite(), "{blocks} blocks: {got}");
            assert!((got as f64 - want).abs() <= bound, "{blocks} blocks: {got} vs f64 {want} (bound {bound:e})");
            // And candle's own, within the same bound.
            let candle = BlockQ8_0::vec_dot(blocks * BLOCK, &w, &x);
            assert!((candle as f64 - want).abs() <= bound, "{blocks} blocks: candle's {candle} vs f64 {want}");
        }
    }
}
