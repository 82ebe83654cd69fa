//! `--section attention`: prompt attention (`GemmaBackend::grouped_attention`, one causal
//! prompt over its own keys) on Gemma's head shapes, by each kernel of `--attention-kernels`,
//! dense and int8 keys and values, TFLOP/s counted over the visible (query, key) pairs only
//! (4 flops per pair and head dimension: scores and output).

use super::{random, time};
use burn::tensor::{DType, Tensor};
use burn_gemma::GemmaBackend;
use burn_gemma_kernels::{
    attention::{FlashLayout, PrefillAttention},
    AttentionMask, AttentionOptions, KernelTuning, KvFormat, KvStore, KvView,
};

/// `(what, q heads, kv heads, head size, window)`.
const SHAPES: [(&str, usize, usize, usize, Option<usize>); 6] = [
    ("gemma3-1b global", 4, 1, 256, None),
    ("gemma3-4b global", 8, 4, 256, None),
    ("gemma3-4b local", 8, 4, 256, Some(1024)),
    ("gemma3-12b global", 16, 8, 256, None),
    ("gemma4 full", 16, 2, 512, None),
    ("gemma4 sliding", 16, 8, 256, Some(512)),
];

/// What the section measures.
pub struct Settings {
    pub dtype: DType,
    pub reps: usize,
    /// Prompt lengths (the keys are the prompt's own).
    pub tokens: Vec<usize>,
    pub kernels: Vec<PrefillAttention>,
    /// Key and value formats: the dtype's dense cache and/or int8.
    pub int8: Vec<bool>,
    /// Layouts the flash kernel is timed with (`None`: its default).
    pub layouts: Vec<Option<FlashLayout>>,
}

impl Settings {
    /// The table the gemm section prints: the default kernel, dense, 2k to 8k tokens.
    pub fn defaults(dtype: DType, reps: usize) -> Self {
        Settings {
            dtype,
            reps,
            tokens: vec![2048, 4096, 8192],
            kernels: vec![PrefillAttention::Auto],
            int8: vec![false],
            layouts: vec![None],
        }
    }
}

/// One row per (shape, tokens, format, kernel).
pub fn section<B: GemmaBackend>(d: &B::Device, settings: &Settings) {
    let Settings { dtype: dt, reps, ref tokens, ref kernels, ref int8, ref layouts } = *settings;
    // Every (kernel, flash layout) pair to time: the layouts only vary the flash kernel.
    let runs: Vec<(PrefillAttention, Option<FlashLayout>)> = kernels
        .iter()
        .flat_map(|&k| match k {
            PrefillAttention::Flash => layouts.iter().map(|&l| (k, l)).collect::<Vec<_>>(),
            _ => vec![(k, None)],
        })
        .collect();
    println!(
        "\n| attention | q heads / kv heads x dim | tokens | window | KV | kernel | ms | TFLOP/s (visible pairs) |"
    );
    println!("|---|---|---:|---:|---|---|---:|---:|");
    for (what, hq, hkv, dim, window) in SHAPES {
        for &tokens in tokens {
            let q = random::<B>(vec![tokens * hq * dim], dt, d).reshape([1, tokens, hq, dim]).swap_dims(1, 2);
            let k = random::<B>(vec![tokens * hkv * dim], dt, d).reshape([1, tokens, hkv, dim]).swap_dims(1, 2);
            let v = random::<B>(vec![tokens * hkv * dim], dt, d).reshape([1, tokens, hkv, dim]).swap_dims(1, 2);
            let mask = AttentionMask { q_offset: 0, k_offset: 0, window };
            let options = AttentionOptions { mask, scale: 1.0 / (dim as f64).sqrt(), softcap: None };
            let pairs: f64 = (0..tokens).map(|i| window.map_or(i + 1, |w| (i + 1).min(w)) as f64).sum();
            let flop = 4.0 * pairs * (hq * dim) as f64;
            let win = window.map_or("-".to_string(), |w| w.to_string());
            for &int8 in int8 {
                let store = int8.then(|| {
                    let zeros = B::kv_zeros([1, hkv, tokens, dim], KvFormat::Int8, d);
                    B::kv_write(zeros, k.clone(), v.clone(), 0)
                });
                let view = || match &store {
                    Some(KvStore::Int8 { keys, values }) => KvView::Int8 { keys, values, len: tokens },
                    _ => KvView::Dense { keys: k.clone(), values: v.clone() },
                };
                for &(kernel, layout) in &runs {
                    let tuning =
                        KernelTuning { prefill_attention: kernel, flash_layout: layout, ..KernelTuning::DEFAULT };
                    let run = |q: Tensor<B, 4>| {
                        tuning.run(|| {
                            B::grouped_attention(q, view(), &options).expect("a host position reads nothing back")
                        })
                    };
                    let s = time::<B, _>(d, reps, || run(q.clone()));
                    let kv = if int8 { "int8" } else { "dense" };
                    let kernel = match layout {
                        Some(FlashLayout { planes, bk, prefetch }) => format!("{kernel:?} {planes}x{bk} {prefetch:?}"),
                        None => format!("{kernel:?}"),
                    };
                    println!(
                        "| {what} | {hq} / {hkv} x {dim} | {tokens} | {win} | {kv} | {kernel} | {:.3} | {:.1} |",
                        s * 1e3,
                        flop / s / 1e12
                    );
                }
            }
        }
    }
}
