//! `--section batched`: the products of a batched decode step (one row per sequence) on the
//! projections of Gemma 3 4B and 12B, for the `--rows` counts: what `GemmaBackend::project`
//! does for dense, Q8 and Q4 weights (the matrix-vector kernels up to 8 rows, the quantized
//! mma kernel or the prefill GEMM above), as microseconds and as the weights' bytes per
//! second; with `--gemm-kernels all`, every tiling of the quantized mma kernel too. Timed as
//! the decode table is (calls recorded into a CUDA graph, GPU time of its replays), cycling
//! through copies of the matrix so that the weights come from device memory.

use super::decode::{copies_for, Clock, Timer};
use super::gemm::Settings;
use super::random;
use burn::tensor::{DType, Tensor};
use burn_gemma::GemmaBackend;
use burn_gemma_kernels::{
    quant::mma::{MmaError, MmaTiling},
    Epilogue, HostMatrix, HostQuantized, Matrix, QuantFormat, QuantizedMatrix,
};

/// `(model, product, n, k)`: each projection's output and input width.
const SHAPES: &[(&str, &str, usize, usize)] = &[
    ("4b", "qkv", 2048 + 2 * 1024, 2560),
    ("4b", "o", 2560, 2048),
    ("4b", "gate|up", 2 * 10240, 2560),
    ("4b", "down", 2560, 10240),
    ("4b", "logits", 262_144, 2560),
    ("12b", "qkv", 4096 + 2 * 2048, 3840),
    ("12b", "o", 3840, 4096),
    ("12b", "gate|up", 2 * 15360, 3840),
    ("12b", "down", 3840, 15360),
];

/// The quantized mma kernel with a given tiling (`burn_gemma_kernels::quant::mma::project_with`).
pub type WithTiling<B> = fn(Tensor<B, 2>, &QuantizedMatrix<B>, Epilogue, MmaTiling) -> Result<Tensor<B, 2>, MmaError>;

/// One table row per (shape, rows, weights), then per tiling with `settings.all`; `sms`: the
/// device's multiprocessors (for the tilings' splits).
pub fn section<B: GemmaBackend>(d: &B::Device, settings: &Settings, sms: usize, with_tiling: WithTiling<B>) {
    let Settings { dtype: dt, reps, ref rows, ref models, all } = *settings;
    let mut timer = Timer::<B>::new(d, reps);
    println!("| model | product | m x n x k | weights | path | us | weight GB/s |");
    println!("|---|---|---|---|---|---:|---:|");
    for &(model, what, n, k) in SHAPES.iter().filter(|s| models.iter().any(|m| m == s.0)) {
        let w = random::<B>(vec![n * k], DType::F32, d).reshape([n, k]).mul_scalar(0.05);
        let host: Vec<f32> = w.clone().into_data().to_vec().unwrap_or_default();
        let dense = w.cast(dt);
        let mut weights = Vec::new();
        for format in [None, Some(QuantFormat::Q8), Some(QuantFormat::Q4)] {
            let matrix = match format {
                None => HostMatrix::Dense(dense.clone()),
                Some(f) => match HostQuantized::quantize(&host, n, k, f) {
                    Ok(q) => HostMatrix::Quantized(q),
                    Err(_) => continue,
                },
            };
            let first = crate::upload(matrix.clone(), d);
            let bytes = first.device_bytes() as f64;
            let mut copies = vec![first];
            copies.extend((1..copies_for(bytes as usize)).map(|_| crate::upload(matrix.clone(), d)));
            weights.push((format, bytes, copies));
        }
        drop((host, dense));
        for &m in rows {
            let x = random::<B>(vec![m * k], dt, d).reshape([m, k]);
            let shape = format!("{m} x {n} x {k}");
            for (format, bytes, matrices) in &weights {
                let label = format.map_or("dense".to_string(), |f| f.to_string());
                let row = |path: &str, s: f64, clock: Clock| {
                    let host = if clock == Clock::Host { " (host)" } else { "" };
                    println!(
                        "| {model} | {what} | {shape} | {label} | {path} | {:.1}{host} | {:.0} |",
                        s * 1e6,
                        bytes / s / 1e9
                    );
                };
                let (s, clock) =
                    timer.time(|i| B::project(x.clone(), &matrices[i % matrices.len()], Epilogue::Identity));
                row("project", s, clock);
                let quantized: Vec<_> =
                    matrices.iter().filter_map(|w| if let Matrix::Quantized(q) = w { Some(q) } else { None }).collect();
                if quantized.is_empty() || !all {
                    continue;
                }
                for tiling in MmaTiling::candidates(m, n, k, sms) {
                    if with_tiling(x.clone(), quantized[0], Epilogue::Identity, tiling).is_err() {
                        continue;
                    }
                    let (s, clock) = timer
                        .time(|i| with_tiling(x.clone(), quantized[i % quantized.len()], Epilogue::Identity, tiling));
                    let MmaTiling { nt, planes, bk, splits, .. } = tiling;
                    row(&format!("mma nt{nt} p{planes} bk{bk} s{splits}"), s, clock);
                }
            }
        }
    }
}
