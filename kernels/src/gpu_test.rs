//! Harness for the kernel tests: every CubeCL kernel is compared with its plain-Burn reference
//! on the GPU backends compiled in (`wgpu`: f32, which lavapipe runs in CI; `cuda`: f32 and
//! bf16), on random inputs from a fresh seed that is printed so a failure can be replayed with
//! `BURN_GEMMA_TEST_SEED`.

use burn::tensor::{backend::Backend, DType, Tensor};

/// A fresh seed per test run (or `BURN_GEMMA_TEST_SEED`), printed and installed on the backend.
pub fn seed<B: Backend>(device: &B::Device, test: &str) -> u64 {
    let seed = host_seed(test);
    B::seed(device, seed);
    seed
}

/// A fresh seed per test run, or `BURN_GEMMA_TEST_SEED` (CI runs the kernel tests once with a
/// fixed one and once fresh); printed so that a failure can be replayed.
pub fn host_seed(test: &str) -> u64 {
    let seed = std::env::var("BURN_GEMMA_TEST_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or_else(|| {
        let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
        (nanos as u64) ^ (test.len() as u64).rotate_left(17)
    });
    println!("{test}: seed {seed} (replay with BURN_GEMMA_TEST_SEED={seed})");
    seed
}

/// Tolerance for comparing a kernel computed in `dtype` against the f32 reference.
pub fn tolerance(dtype: DType) -> f32 {
    match dtype {
        DType::F32 => 2e-4,
        DType::F16 => 4e-3,
        _ => 3e-2,
    }
}

/// Asserts that `got` is finite and within `tol * (1 + |expected|)` of `expected` everywhere.
pub fn assert_close<B: Backend, const D: usize>(got: Tensor<B, D>, expected: Tensor<B, D>, tol: f32, what: &str) {
    assert_eq!(got.dims(), expected.dims(), "{what}: shape");
    let got = got.cast(DType::F32).into_data().to_vec::<f32>().expect("f32 data");
    let expected = expected.cast(DType::F32).into_data().to_vec::<f32>().expect("f32 data");
    assert!(got.iter().all(|v| v.is_finite()), "{what}: non-finite output");
    assert!(expected.iter().all(|v| v.is_finite()), "{what}: non-finite reference");
    let (mut worst, mut at) = (0.0f32, 0);
    for (i, (g, e)) in got.iter().zip(&expected).enumerate() {
        let err = (g - e).abs() / (1.0 + e.abs());
        if err > worst {
            worst = err;
            at = i;
        }
    }
    println!("{what}: max scaled error {worst:.3e}");
    assert!(worst <= tol, "{what}: error {worst:.3e} > {tol:.1e} at {at} (got {}, expected {})", got[at], expected[at]);
}

/// Instantiates `super::$check::<B>(&device, dtype)` as one test per GPU backend and dtype.
macro_rules! gpu_tests {
    ($($name:ident => $check:ident),* $(,)?) => {
        $(
            #[allow(non_snake_case)]
            mod $name {
                #[cfg(feature = "wgpu")]
                #[test]
                fn wgpu_f32() {
                    super::$check::<burn::backend::Wgpu>(&Default::default(), burn::tensor::DType::F32);
                }
                #[cfg(feature = "cuda")]
                #[test]
                fn cuda_f32() {
                    super::$check::<burn::backend::Cuda>(&Default::default(), burn::tensor::DType::F32);
                }
                #[cfg(feature = "cuda")]
                #[test]
                fn cuda_bf16() {
                    super::$check::<burn::backend::Cuda>(&Default::default(), burn::tensor::DType::BF16);
                }
            }
        )*
    };
}
