//! The MLP's `gelu_tanh(gate) * up` on the host (the Candle backend's GELU-pairs epilogue).
//!
//! GELU's tanh form is evaluated as `x * sigmoid(2 z)`, `z = sqrt(2 / pi) (x + 0.044715 x^3)`,
//! which is the same function (`(1 + tanh z) / 2 = 1 / (1 + e^(-2z))`), with `e^t` from
//! [`exp`]: a range reduction and a polynomial in plain arithmetic, so that the loop over a row
//! compiles to vector instructions. Why not `f32::tanh`: it calls libm once per value (`tanhf`,
//! `expm1f`), which was 9% of a 128-token prompt of the real 270M on Candle (2 threads,
//! `perf`), the MLP's GELU over 128 x 2,048 values in each of 18 layers.

use rayon::prelude::*;

/// `gelu_tanh(gate) * up` of a row-major product `y` of `width` columns whose gate and up
/// columns are interleaved in blocks of [`crate::gelu::PAIR_BLOCK`]
/// ([`crate::gelu::pairs_reference`]'s layout): `[rows, width / 2]`, in f32, rows in parallel.
pub fn gelu_pairs(y: &[f32], width: usize) -> Vec<f32> {
    const PAIR: usize = crate::gelu::PAIR_BLOCK;
    let half = width / 2;
    let mut out = vec![0.0f32; y.len() / 2];
    out.par_chunks_mut(half.max(1)).zip(y.par_chunks(width.max(1))).for_each(|(out, y)| {
        for (out, pair) in out.chunks_exact_mut(PAIR).zip(y.chunks_exact(2 * PAIR)) {
            let (gate, up) = pair.split_at(PAIR);
            for ((o, &g), &u) in out.iter_mut().zip(gate).zip(up) {
                *o = gelu_tanh(g) * u;
            }
        }
    });
    out
}

/// The tanh approximation of GELU, `0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3)))`, as
/// `x / (1 + e^(-2z))` (no cancellation where `tanh z` is near -1).
#[inline(always)]
pub fn gelu_tanh(x: f32) -> f32 {
    const SQRT_2_OVER_PI: f32 = 0.797_884_6;
    let z = SQRT_2_OVER_PI * (x + 0.044715 * x * x * x);
    x / (1.0 + exp(-2.0 * z))
}

/// `e^t` for `t` clamped to `[-87, 88]` (the normal range of f32's powers of two; NaN stays NaN),
/// within a few units in the last place: `t = n ln 2 + r` with `n` an integer and `|r| <= ln 2 /
/// 2` (`ln 2` in two parts, so that `r` is exact to f32's precision), `e^r` by Cephes' degree-7
/// polynomial for `expf`, and `2^n` put in the exponent bits. Branch-free so that loops over it
/// vectorize.
#[inline(always)]
pub fn exp(t: f32) -> f32 {
    const LOG2_E: f32 = std::f32::consts::LOG2_E;
    // ln 2 = LN2_HI + LN2_LO, LN2_HI with few mantissa bits so that `n * LN2_HI` is exact.
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    // Adding 1.5 * 2^23 rounds to the nearest integer in f32 arithmetic (|t log2 e| < 2^22).
    const ROUND: f32 = 12_582_912.0;
    let t = t.clamp(-87.0, 88.0);
    let n = (t * LOG2_E + ROUND) - ROUND;
    let r = (t - n * LN2_HI) - n * LN2_LO;
    let mut p = 1.987_569_1e-4f32;
    p = p * r + 1.398_199_9e-3;
    p = p * r + 8.333_452e-3;
    p = p * r + 4.166_579_6e-2;
    p = p * r + 1.666_666_5e-1;
    p = p * r + 0.5;
    let e = p * r * r + r + 1.0;
    // 2^n for n in -126..=127 (normal numbers): the biased exponent in bits 23..31.
    let two_n = f32::from_bits(((n as i32 + 127) as u32) << 23);
    e * two_n
}

#[cfg(test)]
mod tests {
    use super::super::tests::seed;
    use super::*;

    fn uniform(n: usize, lo: f32, hi: f32, seed: u64) -> Vec<f32> {
        let mut s = seed;
        (0..n)
            .map(|_| {
                s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                lo + (hi - lo) * ((s >> 40) as f32 / (1u64 << 24) as f32)
            })
            .collect()
    }

    /// `exp` against f64's over its whole range: within 3 f32 units in the last place.
    #[test]
    fn exp_matches_f64() {
        let seed = seed();
        for t in uniform(100_003, -87.0, 88.0, seed).into_iter().chain([0.0, -87.0, 88.0, 1e-30, -1e-30]) {
            let got = exp(t) as f64;
            let expected = (t as f64).exp();
            assert!(got.is_finite(), "e^{t}");
            assert!((got - expected).abs() <= 3.0 * f32::EPSILON as f64 * expected, "e^{t}: {got} vs {expected}");
        }
        assert!(exp(f32::NAN).is_nan());
        assert_eq!(exp(-1000.0), exp(-87.0));
        assert_eq!(exp(1000.0), exp(88.0));
    }

    /// `gelu_tanh` against the f64 function on the f32 input. Bound: `z` is rounded in f32 (a few
    /// units in the last place of `z`, which move `sigmoid(2z)` by `2 |z| (1 - sigmoid(2z))` times
    /// that), plus `exp`'s 3 units and the division's; past `exp`'s clamp (`-2z > 88`) the result
    /// is `x e^-88` where it should be smaller.
    #[test]
    fn gelu_matches_f64() {
        let seed = seed();
        let xs = uniform(200_001, -12.0, 12.0, seed).into_iter().chain(uniform(1_001, -1e4, 1e4, seed ^ 1));
        for x in xs.chain([0.0, -0.0, 1e-20, -1e-20, 30.0, -30.0]) {
            let xd = x as f64;
            let z = 0.797_884_560_802_865_4 * (xd + 0.044715 * xd * xd * xd);
            // `0.5 x (1 + tanh z)` in its sigmoid form: in f64 too, `1 + tanh z` cancels where
            // `z` is very negative (at z = -14.5 it keeps only 3-4 digits).
            let sigmoid = 1.0 / (1.0 + (-2.0 * z).exp());
            let expected = xd * sigmoid;
            let got = gelu_tanh(x) as f64;
            assert!(got.is_finite(), "gelu({x})");
            let bound =
                (2.0 * z.abs() * (1.0 - sigmoid) * 8.0 + 8.0) * f32::EPSILON as f64 * expected.abs() + xd.abs() * 1e-38;
            assert!((got - expected).abs() <= bound, "gelu({x}): {got} vs {expected} (bound {bound})");
        }
    }

    #[cfg(feature = "ndarray")]
    #[test]
    fn gelu_pairs_match_the_reference() {
        use crate::test_util::TestBackend as B;
        use burn::tensor::{Tensor, TensorData};
        let seed = seed();
        let (rows, width) = (5, 24);
        let y = uniform(rows * width, -4.0, 4.0, seed);
        let got = gelu_pairs(&y, width);
        let device = Default::default();
        let expected =
            crate::gelu::pairs_reference(Tensor::<B, 2>::from_data(TensorData::new(y, [rows, width]), &device))
                .into_data()
                .to_vec::<f32>()
                .expect("f32");
        assert_eq!(got.len(), expected.len());
        for (i, (a, b)) in got.iter().zip(&expected).enumerate() {
            assert!(a.is_finite() && (a - b).abs() <= 1e-5 * (1.0 + b.abs()), "{i}: {a} vs {b}");
        }
    }
}
