//! Tiny random Gemma 1/2/3 checkpoints against HF transformers' full logits.

mod common;

use burn::tensor::DType;
use burn_gemma::generation::token_tensor;
use burn_gemma::{Checkpoint, GemmaBackend};

struct Case {
    name: &'static str,
    tolerance: f32,
}

const CASES: [Case; 5] = [
    Case { name: "gemma1", tolerance: 1e-3 },
    Case { name: "gemma2", tolerance: 1e-3 },
    Case { name: "gemma3", tolerance: 1e-3 },
    Case { name: "gemma3-bf16", tolerance: 1e-2 },
    Case { name: "gemma3-legacy-config", tolerance: 1e-3 },
];

/// Largest logit error over all positions, and the greedy continuation.
fn run_case<B: GemmaBackend>(case: &Case, device: &B::Device) {
    run_case_within::<B>(case, case.tolerance, device)
}

/// Like [`run_case`] with another tolerance.
fn run_case_within<B: GemmaBackend>(case: &Case, tolerance: f32, device: &B::Device) {
    let case = &Case { name: case.name, tolerance };
    let dir = common::fixtures().join("tiny-gemma").join(case.name);
    let reference = common::read_json(dir.join("reference.json"));
    let checkpoint = Checkpoint::open(&dir).expect("open checkpoint");
    let (model, report) = checkpoint.load_model::<B>(DType::F32, device, |_, _| {}).expect("load");
    assert!(report.unused_tensors.is_empty(), "unused: {:?}", report.unused_tensors);

    let input = common::ids(&reference["input_ids"]);
    let mut cache = model.new_cache(1, input.len()).unwrap();
    let logits = model.forward(token_tensor::<B>(&input, device), &mut cache).unwrap();
    let got = logits.into_data().to_vec::<f32>().unwrap();
    let expected: Vec<f32> = reference["logits"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|row| row.as_array().unwrap().iter().map(|v| v.as_f64().unwrap() as f32))
        .collect();
    assert_eq!(got.len(), expected.len());
    assert!(got.iter().all(|v| v.is_finite()), "{}: non-finite logits", case.name);
    let max_err = got.iter().zip(&expected).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
    println!("{}: {} logits, max abs error {max_err:.2e} (tolerance {:.0e})", case.name, got.len(), case.tolerance);
    assert!(max_err <= case.tolerance, "{}: max logit error {max_err} > {}", case.name, case.tolerance);

    // Greedy decoding through the KV cache, one token at a time after the prompt.
    let prompt = common::ids(&reference["greedy_prompt_ids"]);
    let want = common::ids(&reference["greedy_ids"]);
    let mut cache = model.new_cache(1, prompt.len() + want.len()).unwrap();
    let mut next = prompt.clone();
    let mut produced = Vec::new();
    for _ in 0..want.len() {
        let logits = model.forward_last(token_tensor::<B>(&next, device), &mut cache).unwrap();
        let token = logits.argmax(1).into_data().convert::<i64>().to_vec::<i64>().unwrap()[0] as u32;
        produced.push(token);
        next = vec![token];
    }
    assert_eq!(produced, want, "{}: greedy ids", case.name);
}

#[test]
fn tiny_models_match_reference_on_ndarray() {
    for case in &CASES {
        run_case::<burn_gemma::backends::NdArray>(case, &Default::default());
    }
}

#[cfg(feature = "candle")]
#[test]
fn tiny_models_match_reference_on_candle() {
    for case in &CASES {
        run_case::<burn_gemma::backends::Candle>(case, &Default::default());
    }
}

#[cfg(feature = "wgpu")]
#[test]
fn tiny_models_match_reference_on_wgpu() {
    for case in &CASES {
        run_case::<burn_gemma::backends::Wgpu>(case, &Default::default());
    }
}

/// CubeCL's CUDA matmul accumulates f32 products at reduced (TF32-class) precision on
/// Hopper: measured 2e-4 (gemma1) to 1.24e-3 (gemma2) on an H100, so GPU parity is held to the
/// bf16 tolerance.
#[cfg(feature = "cuda")]
#[test]
fn tiny_models_match_reference_on_cuda() {
    for case in &CASES {
        run_case_within::<burn_gemma::backends::Cuda>(case, 1e-2, &Default::default());
    }
}
