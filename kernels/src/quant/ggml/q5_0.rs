//! The dot product of a row of Q5_0 weight blocks with a row of Q8_0 activation blocks, with
//! AVX2 where the CPU has it.
//!
//! Why not candle's: candle has SIMD dot products for Q4_0, Q8_0 and the k-quants, but its
//! Q5_0 one is the scalar reference, several times slower than its Q8_0 one. Q5_0 matters for
//! Gemma: Gemma 3 270M's Q4_K_M file keeps 63 M of its 100 M layer weights in Q5_0 (rows of 640
//! are no multiple of the k-quants' 256). Without this kernel they were widened to Q8_0 at load
//! (8.5 bits a weight instead of 5.5). Measured on a 2-core AMD EPYC, real 270M, Candle, 2
//! threads, 128 new tokens, 5 alternating runs: weights 270 -> 246 MB, resident 334 -> 310 MB,
//! decode 27.9 -> 28.6 tok/s (medians; within the runs' spread). The kernel spends about 20
//! instructions a block unpacking the fifth bits and nibbles, against candle's 8 for Q8_0, so on
//! two cores it is bound by instructions, not by the bytes it saves.
//!
//! A Q5_0 block is 22 bytes: the f16 scale `d`, 32 fifth bits (a little-endian `u32`) and 16
//! bytes of nibbles (byte `j`: element `j` in its low nibble, element `j + 16` in its high one);
//! element `j` is `d * ((nibble_j | bit_j << 4) - 16)`. A Q8_0 block is 34 bytes: the f16 scale and
//! 32 `i8` codes.

use candle_core::quantized::k_quants::{BlockQ5_0, BlockQ8_0};

const BLOCK: usize = 32;
const Q5_0_BYTES: usize = 22;
const Q8_0_BYTES: usize = 34;

/// The dot product of two block rows, as [`candle_core::quantized::k_quants::GgmlType::vec_dot`]
/// takes it (`n`, the values per row, is implied by the blocks).
pub type DotFn = fn(usize, &[BlockQ5_0], &[BlockQ8_0]) -> f32;

/// Whether this CPU runs the AVX2 kernel (x86-64 with AVX2, FMA and F16C, checked at run time;
/// every AVX2 CPU has the other two).
pub fn simd() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx2")
            && std::arch::is_x86_feature_detected!("fma")
            && std::arch::is_x86_feature_detected!("f16c")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// The fastest dot product this CPU runs: the AVX2 kernel, else the scalar `reference`.
pub fn dot_fn() -> DotFn {
    #[cfg(target_arch = "x86_64")]
    if simd() {
        return avx2_dot;
    }
    reference_dot
}

/// `blocks` (candle's block types) as the bytes they are stored in; [`super::q8_0`] reads its
/// blocks through it too.
pub(super) fn bytes<T>(blocks: &[T]) -> &[u8] {
    // SAFETY: candle's block types are `#[repr(C)]` plain data (an f16 and byte arrays; candle
    // asserts their sizes, 22 and 34 bytes, so there is no padding): every byte is initialized.
    unsafe { std::slice::from_raw_parts(blocks.as_ptr().cast::<u8>(), std::mem::size_of_val(blocks)) }
}

fn scale(block: &[u8]) -> f32 {
    half::f16::from_le_bytes([block[0], block[1]]).to_f32()
}

fn reference_dot(_n: usize, w: &[BlockQ5_0], x: &[BlockQ8_0]) -> f32 {
    reference(bytes(w), bytes(x))
}

/// The 32 codes `(nibble | fifth bit << 4) - 16` of one raw Q5_0 block (element `j` and `j + 16`
/// from byte `j`'s two nibbles), in a loop that compiles to vector code.
pub(super) fn codes(block: &[u8]) -> [i32; BLOCK] {
    let high = u32::from_le_bytes([block[2], block[3], block[4], block[5]]);
    let mut codes = [0i32; BLOCK];
    let (low_half, high_half) = codes.split_at_mut(16);
    for (j, ((lo, hi), &byte)) in low_half.iter_mut().zip(high_half.iter_mut()).zip(&block[6..Q5_0_BYTES]).enumerate() {
        *lo = ((byte & 15) as u32 | ((high >> j) & 1) << 4) as i32 - 16;
        *hi = ((byte >> 4) as u32 | ((high >> (j + 16)) & 1) << 4) as i32 - 16;
    }
    codes
}

/// The plain dot product over raw blocks: per block the integer sum of code products, times both
/// scales, summed in block order (candle's scalar Q5_0 dot product, bit for bit).
pub fn reference(w: &[u8], x: &[u8]) -> f32 {
    let mut sum = 0f32;
    for (w, x) in w.chunks_exact(Q5_0_BYTES).zip(x.chunks_exact(Q8_0_BYTES)) {
        let int: i32 = codes(w).iter().zip(&x[2..]).map(|(&code, &a)| code * a as i8 as i32).sum();
        sum += int as f32 * scale(w) * scale(x);
    }
    sum
}

/// Q5_0 blocks to f32, `d * code` as candle's `to_float` computes them (bit for bit), through
/// [`codes`], whose loop compiles to vector code (fixed-size halves, no indexing past what the
/// compiler can see): candle's `to_float` indexes the output by computed offsets and
/// ran at about 2 cycles a weight, 6% of a 128-token prompt of the real 270M on two cores,
/// whose layers keep 63 M weights in Q5_0 and are dequantized once per prompt chunk.
pub fn dequantize(blocks: &[BlockQ5_0], out: &mut [f32]) {
    for (block, out) in bytes(blocks).chunks_exact(Q5_0_BYTES).zip(out.chunks_exact_mut(BLOCK)) {
        let d = scale(block);
        for (o, code) in out.iter_mut().zip(codes(block)) {
            *o = code as f32 * d;
        }
    }
}

#[cfg(target_arch = "x86_64")]
fn avx2_dot(_n: usize, w: &[BlockQ5_0], x: &[BlockQ8_0]) -> f32 {
    // SAFETY: `dot_fn` hands this function out only after `simd()` found AVX2, FMA and F16C.
    unsafe { avx2::dot(bytes(w), bytes(x)) }
}

#[cfg(target_arch = "x86_64")]
pub(super) mod avx2 {
    use super::{Q5_0_BYTES, Q8_0_BYTES};
    use std::arch::x86_64::*;

    /// The product of the two blocks' f16 scales (each block's first two bytes), broadcast: both
    /// converted by one F16C instruction. `half`'s conversion, outside code compiled for F16C,
    /// checks the CPU at run time and calls its converter, twice a block: with those calls the
    /// kernel moved the real 270M's Q5_0 bytes at about 60% of the rate of candle's Q8_0 dot.
    ///
    /// # Safety
    /// The CPU must have AVX2, FMA and F16C; both slices hold at least two bytes.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(in super::super) unsafe fn scales(w: &[u8], x: &[u8]) -> __m256 {
        let both = u32::from_le_bytes([w[0], w[1], x[0], x[1]]) as i32;
        let s = _mm_cvtph_ps(_mm_cvtsi32_si128(both));
        _mm256_broadcastss_ps(_mm_mul_ss(s, _mm_movehdup_ps(s)))
    }

    /// Per block: the 32 codes `q - 16` as `i8` in one register, multiplied with the activation
    /// codes by `maddubs` (unsigned times signed, so `|q|` times `x * sign(q)`), the pair sums
    /// widened to eight `i32`, converted and accumulated with both scales in eight f32 lanes.
    ///
    /// # Safety
    /// The CPU must have AVX2, FMA and F16C.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn dot(w: &[u8], x: &[u8]) -> f32 {
        let low_nibbles = _mm_set1_epi8(0x0F);
        // Byte j of the 32 takes byte j / 8 of the fifth bits (a shuffle stays within its
        // 128-bit half: the low half reads bytes 0 and 1, the high half bytes 2 and 3).
        let byte_of_bit = _mm256_set_epi64x(0x0303_0303_0303_0303, 0x0202_0202_0202_0202, 0x0101_0101_0101_0101, 0);
        // Byte k of each eight: every bit but bit k set, so OR gives all ones iff bit k was set.
        let other_bits = _mm256_set1_epi64x(0x7fbf_dfef_f7fb_fdfe);
        let all_ones = _mm256_set1_epi8(-1);
        let minus_16 = _mm256_set1_epi8(0xF0u8 as i8);
        let ones = _mm256_set1_epi16(1);
        let mut acc = _mm256_setzero_ps();
        for (w, x) in w.chunks_exact(Q5_0_BYTES).zip(x.chunks_exact(Q8_0_BYTES)) {
            let d = scales(w, x);
            let high = i32::from_le_bytes([w[2], w[3], w[4], w[5]]);
            let packed = _mm_loadu_si128(w.as_ptr().add(6).cast());
            let nibbles = _mm256_set_m128i(
                _mm_and_si128(_mm_srli_epi16::<4>(packed), low_nibbles),
                _mm_and_si128(packed, low_nibbles),
            );
            let spread = _mm256_shuffle_epi8(_mm256_set1_epi32(high), byte_of_bit);
            let bit_set = _mm256_cmpeq_epi8(_mm256_or_si256(spread, other_bits), all_ones);
            // `(nibble | bit << 4) - 16` as i8: the nibble where the bit is set, `nibble | 0xF0`
            // (that is `nibble - 16`) where it is not.
            let codes = _mm256_or_si256(nibbles, _mm256_andnot_si256(bit_set, minus_16));
            let activations = _mm256_loadu_si256(x.as_ptr().add(2).cast());
            let pairs = _mm256_maddubs_epi16(_mm256_sign_epi8(codes, codes), _mm256_sign_epi8(activations, codes));
            let sums = _mm256_madd_epi16(pairs, ones);
            acc = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(sums), acc);
        }
        let half = _mm_add_ps(_mm256_extractf128_ps::<1>(acc), _mm256_castps256_ps128(acc));
        let quarter = _mm_add_ps(half, _mm_movehl_ps(half, half));
        _mm_cvtss_f32(_mm_add_ss(quarter, _mm_shuffle_ps::<1>(quarter, quarter)))
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::{random_blocks, seed};
    use super::*;
    use candle_core::quantized::{k_quants::GgmlType, GgmlDType};

    /// Weight rows of `blocks` Q5_0 blocks and activation rows quantized to Q8_0 from values of
    /// magnitude up to 3 (seeded).
    fn rows(blocks: usize, seed: u64) -> (Vec<u8>, Vec<BlockQ8_0>) {
        let w = random_blocks(GgmlDType::Q5_0, 1, blocks * BLOCK, seed).bytes().to_vec();
        let mut s = seed ^ 0x5eed;
        let values: Vec<f32> = (0..blocks * BLOCK)
            .map(|_| {
                s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                ((s >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 6.0
            })
            .collect();
        let mut x = vec![BlockQ8_0::zeros(); blocks];
        BlockQ8_0::from_float(&values, &mut x);
        (w, x)
    }

    /// Raw Q5_0 bytes as candle's blocks (owned, aligned copies).
    fn as_blocks(w: &[u8]) -> Vec<BlockQ5_0> {
        w.chunks_exact(Q5_0_BYTES)
            // SAFETY: each chunk is one whole 22-byte Q5_0 block; BlockQ5_0 is `#[repr(C)]` plain
            // data (any bytes are valid), read unaligned into an owned copy.
            .map(|b| unsafe { std::ptr::read_unaligned(b.as_ptr().cast::<BlockQ5_0>()) })
            .collect()
    }

    /// Our dequantization gives candle's `to_float` values, bit for bit (odd row counts).
    #[test]
    fn dequantize_is_candles_to_float() {
        use candle_core::quantized::k_quants::GgmlType;
        for blocks in [1, 3, 37] {
            let (w, _) = rows(blocks, seed() ^ blocks as u64);
            let w = as_blocks(&w);
            let mut ours = vec![f32::NAN; blocks * BLOCK];
            let mut candle = vec![0.0f32; blocks * BLOCK];
            dequantize(&w, &mut ours);
            BlockQ5_0::to_float(&w, &mut candle);
            assert!(ours.iter().all(|v| v.is_finite()));
            assert_eq!(ours, candle, "{blocks} blocks");
        }
    }

    /// The reference is candle's scalar Q5_0 dot product, bit for bit.
    #[test]
    fn reference_is_candles_dot_product() {
        let seed = seed();
        for blocks in [2, 6, 20] {
            let (w, x) = rows(blocks, seed ^ blocks as u64);
            let candle = BlockQ5_0::vec_dot(blocks * BLOCK, &as_blocks(&w), &x);
            let ours = reference(&w, bytes(&x));
            assert!(ours.is_finite());
            assert_eq!(ours.to_bits(), candle.to_bits(), "{blocks} blocks: {ours} vs candle's {candle}");
        }
    }

    /// The AVX2 kernel against the reference, on odd block counts: equal up to the f32 rounding
    /// of summing the blocks in eight lanes instead of one (n + 8 roundings of terms bounded by
    /// the sum of their magnitudes).
    #[test]
    fn simd_dot_matches_the_reference() {
        let seed = seed();
        if !simd() {
            println!("this CPU has no AVX2 and FMA: dot_fn() is the reference itself");
        }
        let dot = dot_fn();
        for blocks in [1, 3, 7, 20, 81] {
            let (w, x) = rows(blocks, seed ^ (blocks as u64) << 8);
            let got = dot(blocks * BLOCK, &as_blocks(&w), &x);
            let want = reference(&w, bytes(&x));
            // Sum of |term| over every code product, in f64.
            let xb = bytes(&x);
            let magnitude: f64 = w
                .chunks_exact(Q5_0_BYTES)
                .zip(xb.chunks_exact(Q8_0_BYTES))
                .map(|(wb, xb)| {
                    let ints: f64 =
                        codes(wb).iter().zip(&xb[2..]).map(|(&code, &a)| (code * a as i8 as i32).abs() as f64).sum();
                    ints * (scale(wb) * scale(xb)).abs() as f64
                })
                .sum();
            let bound = 2.0 * (blocks + 8) as f64 * f32::EPSILON as f64 * magnitude;
            assert!(got.is_finite(), "{blocks} blocks: {got}");
            assert!(
                (got as f64 - want as f64).abs() <= bound,
                "{blocks} blocks: {got} vs the reference's {want} (bound {bound:e})"
            );
        }
    }
}
