//! Float tensors converted between f32, f16 and bf16 on every core, straight from a file's
//! bytes.
//!
//! Loading a 12B checkpoint converts 12 billion values: Burn's `TensorData::convert_dtype` takes
//! them one at a time on one thread and candle's dequantization copies them three times, which
//! made a 24 GB F16 GGUF take over two minutes to load onto an H200. Here each task converts a
//! run of values from the source bytes into the output in one pass, on rayon's pool. Rounding is
//! the `half` crate's (nearest, ties to even), as Burn's conversion rounds.

use burn::tensor::DType;
use half::{bf16, f16};
use rayon::prelude::*;

/// Values per task: 64 Ki (256 KiB of f32).
const TASK: usize = 1 << 16;

/// The float types converted here.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Float {
    F32,
    F16,
    Bf16,
}

impl Float {
    /// `dtype` as one of the converted types, if it is one.
    pub(crate) fn of(dtype: DType) -> Option<Self> {
        match dtype {
            DType::F32 => Some(Self::F32),
            DType::F16 => Some(Self::F16),
            DType::BF16 => Some(Self::Bf16),
            _ => None,
        }
    }

    pub(crate) fn size(self) -> usize {
        match self {
            Self::F32 => 4,
            Self::F16 | Self::Bf16 => 2,
        }
    }

    fn read(self, bytes: &[u8], out: &mut [f32]) {
        match self {
            Self::F32 => {
                for (o, b) in out.iter_mut().zip(bytes.chunks_exact(4)) {
                    *o = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
                }
            }
            Self::F16 => {
                for (o, b) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                    *o = f16::from_le_bytes([b[0], b[1]]).to_f32();
                }
            }
            Self::Bf16 => {
                for (o, b) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                    *o = bf16::from_le_bytes([b[0], b[1]]).to_f32();
                }
            }
        }
    }

    fn write(self, values: &[f32], bytes: &mut [u8]) {
        match self {
            Self::F32 => {
                for (v, b) in values.iter().zip(bytes.chunks_exact_mut(4)) {
                    b.copy_from_slice(&v.to_le_bytes());
                }
            }
            Self::F16 => {
                for (v, b) in values.iter().zip(bytes.chunks_exact_mut(2)) {
                    b.copy_from_slice(&f16::from_f32(*v).to_le_bytes());
                }
            }
            Self::Bf16 => {
                for (v, b) in values.iter().zip(bytes.chunks_exact_mut(2)) {
                    b.copy_from_slice(&bf16::from_f32(*v).to_le_bytes());
                }
            }
        }
    }
}

/// `src` (little-endian values of `from`; a trailing partial value is ignored) as little-endian
/// values of `to`. The same type is a copy.
pub(crate) fn convert(src: &[u8], from: Float, to: Float) -> Vec<u8> {
    let n = src.len() / from.size();
    let src = &src[..n * from.size()];
    let mut out = vec![0u8; n * to.size()];
    if from == to {
        out.par_chunks_mut(TASK * to.size())
            .zip(src.par_chunks(TASK * from.size()))
            .for_each(|(o, s)| o.copy_from_slice(s));
        return out;
    }
    out.par_chunks_mut(TASK * to.size()).zip(src.par_chunks(TASK * from.size())).for_each(|(o, s)| {
        let mut values = vec![0.0f32; s.len() / from.size()];
        from.read(s, &mut values);
        to.write(&values, o);
    });
    out
}

/// `src` (little-endian values of `from`) as f32.
pub(crate) fn to_f32(src: &[u8], from: Float) -> Vec<f32> {
    let n = src.len() / from.size();
    let mut out = vec![0.0f32; n];
    out.par_chunks_mut(TASK)
        .zip(src[..n * from.size()].par_chunks(TASK * from.size()))
        .for_each(|(o, s)| from.read(s, o));
    out
}

/// `values` as little-endian values of `to`.
pub(crate) fn from_f32(values: &[f32], to: Float) -> Vec<u8> {
    let mut out = vec![0u8; values.len() * to.size()];
    out.par_chunks_mut(TASK * to.size()).zip(values.par_chunks(TASK)).for_each(|(o, v)| to.write(v, o));
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::tensor::TensorData;

    /// Values of every kind the conversions meet: normal, subnormal in f16, past f16's range,
    /// signed zeros, infinities, NaN, and values halfway between two bf16 or f16 neighbours.
    fn values(seed: u64) -> Vec<f32> {
        let mut s = seed | 1;
        let mut v: Vec<f32> = (0..TASK * 2 + 37)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                f32::from_bits(s as u32)
            })
            .filter(|x| x.is_finite())
            .collect();
        v.extend([0.0, -0.0, f32::INFINITY, f32::NEG_INFINITY, 1e-6, 7e4, -1e5, 1.0 + 1.0 / 256.0, 1.0 + 1.0 / 2048.0]);
        v.extend((0..1000).map(|i| (i as f32 - 500.0) * 0.0137));
        v
    }

    /// A fresh seed per run, or `BURN_GEMMA_TEST_SEED` (CI runs the tests once with a fixed
    /// one), printed so that a failure can be replayed.
    fn seed() -> u64 {
        let seed = std::env::var("BURN_GEMMA_TEST_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or_else(|| {
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(1, |d| d.as_nanos() as u64)
        });
        println!("floats: seed {seed} (replay with BURN_GEMMA_TEST_SEED={seed})");
        seed
    }

    /// Every pair of types converts as Burn's one-at-a-time `convert_dtype` does, bit for bit
    /// (NaN compared as NaN), over more values than one task takes.
    #[test]
    fn conversions_match_burns() {
        let seed = seed();
        let base = values(seed);
        let types = [(Float::F32, DType::F32), (Float::F16, DType::F16), (Float::Bf16, DType::BF16)];
        for (from, from_dtype) in types {
            // The source values as `from` holds them (Burn's conversion from f32).
            let src = TensorData::new(base.clone(), [base.len()]).convert_dtype(from_dtype);
            for (to, to_dtype) in types {
                let ours = convert(src.as_bytes(), from, to);
                let burns = src.clone().convert_dtype(to_dtype);
                let expected = burns.as_bytes();
                assert_eq!(ours.len(), expected.len(), "{from:?} -> {to:?}");
                let size = to.size();
                for (i, (a, b)) in ours.chunks_exact(size).zip(expected.chunks_exact(size)).enumerate() {
                    let (mut x, mut y) = ([0.0f32], [0.0f32]);
                    to.read(a, &mut x);
                    to.read(b, &mut y);
                    let both_nan = x[0].is_nan() && y[0].is_nan();
                    assert!(
                        a == b || both_nan,
                        "{from:?} -> {to:?} value {i}: {} against Burn's {} (seed {seed})",
                        x[0],
                        y[0]
                    );
                }
                let widened = to_f32(&ours, to);
                let narrowed = from_f32(&widened, to);
                assert_eq!(narrowed, ours, "{to:?}: to f32 and back is not the identity (seed {seed})");
            }
        }
    }
}
