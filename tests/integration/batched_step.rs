//! A batched decode step over many sequences at different positions against each sequence
//! stepped alone, on a CUDA device, for a random Gemma 3 1B-shaped model in bf16 with dense, Q8
//! and Q4 weights: 5, 16 and 40 sequences (the quantized products of 3 to 64 rows run on the
//! matrix units, one row on the matrix-vector kernel: different kernels, different rounding).
//! The batched step runs over a cache of a row per sequence and over a paged cache (the
//! engine's: blocks of a pool through a block table, each sequence's blocks not contiguous),
//! eagerly and replayed as a CUDA graph ([`BatchGraphs`]), which must give the eager step's
//! logits exactly (the same kernels on the same inputs).
//!
//! The bound comes from a reference: each sequence alone in f32 (same weights, same blocks).
//! Were the batched step as accurate as the step alone, the triangle inequality would bound
//! their difference by twice the alone step's distance from f32; the test asserts that bound.
#![cfg(feature = "cuda")]

use burn::tensor::{DType, Tensor};
use burn_gemma::backends::Cuda;
use burn_gemma::generation::token_tensor;
use burn_gemma::{
    BatchGraphs, Gemma, GemmaConfig, KvCache, ModelError, ModelOptions, PagedLayout, StepInputs, WeightFormat,
};
use burn_gemma_kernels::QuantFormat;
use burn_gemma_model::{decode_graph::bucket_bound, RandomWeights};

type B = Cuda;

fn host(t: Tensor<B, 2>) -> Vec<f32> {
    t.cast(DType::F32).into_data().to_vec::<f32>().expect("f32 logits")
}

/// Sequence `i`'s prompt: its own tokens, `3 + 13 * i` of them (positions 2 to 509).
fn prompt(i: usize) -> Vec<u32> {
    (0..3 + 13 * i).map(|j| ((i * 7919 + j * 104_729) % 262_000) as u32 + 2).collect()
}

/// Each sequence's prompt but its last token, run alone into a cache of its own.
fn prompts(model: &Gemma<B>, n: usize, capacity: usize) -> Vec<KvCache<B>> {
    let d = model.device();
    (0..n)
        .map(|i| {
            let p = prompt(i);
            let mut cache = model.new_cache(1, capacity).expect("cache");
            model.forward_last(token_tensor::<B>(&p[..p.len() - 1], &d), &mut cache).expect("prompt");
            cache
        })
        .collect()
}

/// The logits of each sequence's next step alone (batch 1), stepping its own cache.
fn alone(model: &Gemma<B>, caches: &mut [KvCache<B>]) -> Vec<Vec<f32>> {
    let d = model.device();
    caches
        .iter_mut()
        .enumerate()
        .map(|(i, cache)| {
            let p = prompt(i);
            host(model.forward_last(token_tensor::<B>(&p[p.len() - 1..], &d), cache).expect("step"))
        })
        .collect()
}

/// How the batched cache keeps its sequences.
#[derive(Debug, Clone, Copy)]
enum Layout {
    Rows,
    Paged,
    /// Paged, the step replayed as a CUDA graph.
    PagedGraph,
}

/// The logits of one batched step over the first `n` sequences, their caches copied into one.
fn batched(
    model: &Gemma<B>,
    caches: &[KvCache<B>],
    n: usize,
    capacity: usize,
    layout: Layout,
) -> Result<Vec<Vec<f32>>, ModelError> {
    let d = model.device();
    let mut rows = match layout {
        Layout::Rows => model.new_cache(n, capacity).expect("batched cache"),
        Layout::Paged | Layout::PagedGraph => {
            let block_size = PagedLayout::block_size_for(model.config(), capacity, 32);
            assert_eq!(block_size, 32);
            let layout = PagedLayout::new(n, capacity, block_size);
            let mut rows = model.new_paged_cache(layout).expect("paged cache");
            // Each sequence's first block first, the rest after everyone's first: not contiguous.
            for i in 0..n {
                let blocks = rows.reserve(block_size).expect("blocks");
                rows.attach(i, blocks).expect("attach");
            }
            for i in 0..n {
                let rest = prompt(i).len().saturating_sub(block_size);
                if rest > 0 {
                    let blocks = rows.reserve(rest).expect("blocks");
                    rows.attach(i, blocks).expect("attach");
                }
            }
            rows
        }
    };
    let (mut ids, mut positions) = (Vec::new(), Vec::new());
    for (i, cache) in caches[..n].iter().enumerate() {
        let p = prompt(i);
        rows.copy_sequence(i, cache, 0).expect("copy into the batched cache");
        ids.push(p[p.len() - 1]);
        positions.push(p.len() - 1);
    }
    let logits = match layout {
        Layout::PagedGraph => {
            let mut graphs = BatchGraphs::new();
            // Twice: the second replays the recording.
            graphs.step(model, &mut rows, &ids, &positions)?;
            let logits = host(graphs.step(model, &mut rows, &ids, &positions)?);
            assert_eq!(graphs.setup().recordings, 1, "one recording serves both steps");
            logits
        }
        Layout::Paged => {
            // The bound a recording of these positions has (the decode attention's splits are
            // sized by it: the same bound, the same sums), so that the replay must match exactly.
            let mut inputs = StepInputs::sequences(&ids, &positions, &d)?;
            inputs.bound = bucket_bound(inputs.bound, capacity);
            host(model.decode_logits(&inputs, &mut rows)?)
        }
        Layout::Rows => host(model.decode_logits(&StepInputs::sequences(&ids, &positions, &d)?, &mut rows)?),
    };
    let vocab = model.config().vocab_size;
    Ok(logits.chunks(vocab).map(<[f32]>::to_vec).collect())
}

fn max_diff(a: &[Vec<f32>], b: &[Vec<f32>]) -> f32 {
    a.iter().flatten().zip(b.iter().flatten()).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

#[test]
fn random_1b_batched_step_matches_each_alone() {
    let d = burn::backend::cuda::CudaDevice::new(0);
    let config = GemmaConfig::preset("gemma3-1b").expect("preset");
    let formats = [
        ("bf16", WeightFormat::Dense),
        ("q8", WeightFormat::Quantized(QuantFormat::Q8)),
        ("q4", WeightFormat::Quantized(QuantFormat::Q4)),
    ];
    let most = 40;
    // 544 positions: the full-attention layers' 17 blocks of 32, the 512-position windows' 16.
    let capacity = prompt(most - 1).len().next_multiple_of(32) + 32;
    assert_eq!(capacity, 544);
    for (name, weights) in formats {
        let load = |dtype| {
            let options = ModelOptions { dtype, weights, kv_cache: None };
            Gemma::<B>::load(config.clone(), &mut RandomWeights::new(5), &options, &d).expect("random 1B")
        };
        let reference = {
            let model = load(DType::F32);
            alone(&model, &mut prompts(&model, most, capacity))
        };
        let model = load(DType::BF16);
        // The prompts run once: the batched steps copy their caches, then each steps alone.
        let mut caches = prompts(&model, most, capacity);
        let layouts =
            [(5, Layout::Rows), (16, Layout::Rows), (most, Layout::Rows), (5, Layout::Paged), (most, Layout::Paged)];
        let steps: Vec<_> = layouts
            .into_iter()
            .map(|(n, layout)| (n, layout, batched(&model, &caches, n, capacity, layout).expect("batched step")))
            .collect();
        // Replayed: the eager paged step's logits exactly. Dense bf16 weights take the prefill
        // GEMM above 8 rows, which a graph cannot hold: refused as such.
        for n in [5, most] {
            let eager = steps.iter().find(|(m, l, _)| *m == n && matches!(l, Layout::Paged)).map(|s| &s.2);
            match (batched(&model, &caches, n, capacity, Layout::PagedGraph), weights) {
                (Ok(replayed), _) => {
                    let diff = max_diff(&replayed, eager.expect("the eager paged step"));
                    println!("1B {name}, {n} sequences: replayed vs eager {diff}");
                    assert!(diff == 0.0, "1B {name}, {n} sequences: replayed vs eager {diff}");
                }
                (Err(ModelError::Graph(e)), WeightFormat::Dense) if n > 8 => {
                    println!("1B {name}, {n} sequences: no graph ({e})");
                    assert!(e.to_string().contains("prefill product"), "{e}");
                }
                (Err(e), _) => panic!("1B {name}, {n} sequences replayed: {e}"),
            }
        }
        let single = alone(&model, &mut caches);
        for (n, layout, got) in steps {
            let what = format!("1B {name}, {n} sequences ({layout:?})");
            assert!(got.iter().flatten().all(|v| v.is_finite()), "{what}: non-finite logits");
            let bound = 2.0 * max_diff(&single[..n], &reference[..n]);
            let diff = max_diff(&got, &single[..n]);
            println!("{what}: batched vs alone {diff:.4}, bound (2 x alone vs f32) {bound:.4}");
            assert!(diff <= bound, "{what}: batched vs alone {diff} > {bound}");
        }
    }
}
