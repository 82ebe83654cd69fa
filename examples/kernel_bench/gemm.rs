//! `--section gemm`: every CubeCL matmul kernel of [`GemmKernel::candidates`] on the prefill
//! products of Gemma 3 270M, 1B, 4B and 12B and Gemma 4 31B (its sliding layers), TFLOP/s and the largest difference to Burn's
//! matmul (with `--gemm-kernels all`), beside what `GemmaBackend::project` does: the tuned
//! kernel, and for Q8 and Q4 weights the dequantization before it.

use super::{random, time};
use burn::tensor::{DType, ElementConversion, Tensor};
use burn_gemma::GemmaBackend;
use burn_gemma_kernels::{
    gemm::{tune, GemmError, GemmKernel},
    Epilogue, HostMatrix, HostQuantized, QuantFormat,
};

/// `(model, product, n, k)`: each projection's output and input width.
pub const SHAPES: &[(&str, &str, usize, usize)] = &[
    ("270m", "qkv", 1024 + 2 * 256, 640),
    ("270m", "gate|up", 2 * 2048, 640),
    ("270m", "down", 640, 2048),
    ("1b", "qkv", 1024 + 2 * 256, 1152),
    ("1b", "o", 1152, 1024),
    ("1b", "gate|up", 2 * 6912, 1152),
    ("1b", "down", 1152, 6912),
    ("4b", "qkv", 2048 + 2 * 1024, 2560),
    ("4b", "o", 2560, 2048),
    ("4b", "gate|up", 2 * 10240, 2560),
    ("4b", "down", 2560, 10240),
    ("12b", "qkv", 4096 + 2 * 2048, 3840),
    ("12b", "o", 3840, 4096),
    ("12b", "gate|up", 2 * 15360, 3840),
    ("12b", "down", 3840, 15360),
    ("31b", "qkv", 8192 + 2 * 4096, 5376),
    ("31b", "o", 5376, 8192),
    ("31b", "gate|up", 2 * 21504, 5376),
    ("31b", "down", 5376, 21504),
];

/// What the section measures.
pub struct Settings {
    pub dtype: DType,
    pub reps: usize,
    /// Activation rows of each product.
    pub rows: Vec<usize>,
    /// Models whose products are timed (`SHAPES`' first column).
    pub models: Vec<String>,
    /// Also every CubeCL kernel candidate on its own (the batched section: every tiling of the
    /// quantized mma kernel).
    pub all: bool,
}

/// The products table, then the attention table.
pub fn section<B: GemmaBackend>(
    d: &B::Device,
    settings: &Settings,
    product: impl Fn(Tensor<B, 2>, Tensor<B, 2>, GemmKernel) -> Result<Tensor<B, 2>, GemmError>,
) {
    run::<B>(d, settings, product);
    let attention = super::prompt_attention::Settings::defaults(settings.dtype, settings.reps);
    super::prompt_attention::section::<B>(d, &attention);
}

/// Prints one table row per (shape, rows, kernel).
fn run<B: GemmaBackend>(
    d: &B::Device,
    settings: &Settings,
    product: impl Fn(Tensor<B, 2>, Tensor<B, 2>, GemmKernel) -> Result<Tensor<B, 2>, GemmError>,
) {
    let Settings { dtype: dt, reps, ref rows, ref models, all } = *settings;
    println!("| model | product | m x n x k | kernel | ms | TFLOP/s | max abs diff to Burn's matmul |");
    println!("|---|---|---|---|---:|---:|---:|");
    for &(model, what, n, k) in SHAPES.iter().filter(|s| models.iter().any(|m| m == s.0)) {
        for &m in rows.iter() {
            let x = random::<B>(vec![m * k], dt, d).reshape([m, k]).mul_scalar(0.1);
            let w = random::<B>(vec![n * k], dt, d).reshape([n, k]).mul_scalar(0.1);
            let flop = 2.0 * (m * n * k) as f64;
            let shape = format!("{m} x {n} x {k}");
            let expected = burn_gemma_kernels::linear::reference(x.clone(), w.clone()).cast(DType::F32);
            // What prefill runs: `project` (tuned kernel; quantized weights dequantized first).
            let matrix = crate::upload(HostMatrix::Dense(w.clone()), d);
            let host: Vec<f32> = w.clone().cast(DType::F32).into_data().to_vec().unwrap_or_default();
            let mut weights = vec![("project dense", matrix)];
            for format in [QuantFormat::Q8, QuantFormat::Q4] {
                if let Ok(q) = HostQuantized::quantize(&host, n, k, format) {
                    weights.push((
                        if format == QuantFormat::Q8 { "project q8" } else { "project q4" },
                        crate::upload(HostMatrix::Quantized(q), d),
                    ));
                }
            }
            for (label, matrix) in &weights {
                let s = time::<B, _>(d, reps, || B::project(x.clone(), matrix, Epilogue::Identity));
                println!("| {model} | {what} | {shape} | {label} | {:.3} | {:.1} | - |", s * 1e3, flop / s / 1e12);
            }
            for kernel in GemmKernel::candidates().into_iter().filter(|_| all) {
                match product(x.clone(), w.clone(), kernel) {
                    Err(e) => println!("| {model} | {what} | {shape} | {kernel} | - | - | {e} |"),
                    Ok(got) => {
                        let diff: f32 = (got.cast(DType::F32) - expected.clone()).abs().max().into_scalar().elem();
                        let s = time::<B, _>(d, reps, || product(x.clone(), w.clone(), kernel));
                        println!(
                            "| {model} | {what} | {shape} | {kernel} | {:.3} | {:.1} | {diff:.3e} |",
                            s * 1e3,
                            flop / s / 1e12
                        );
                    }
                }
            }
        }
    }
    let t = tune::summary();
    println!(
        "\nprefill kernel tuning: {} shape classes timed in {:.2} s, {} choices read from {}",
        t.tuned,
        t.time.as_secs_f64(),
        t.cached,
        t.path.map_or("(no cache folder)".into(), |p| p.display().to_string())
    );
}
