//! Gemma 3 with images against HF transformers 5.23 (tests/fixtures/tiny-gemma-vision, made by
//! scripts/make_vision_fixtures.py): the SigLIP tower and projector's image features, the
//! logits of prompts with one and two images (each image's soft tokens attending to each other
//! both ways, the first image past the sliding window), greedy continuations.

mod common;

use burn::tensor::{DType, Tensor, TensorData};
use burn_gemma::{backends::NdArray, generation::token_tensor, Checkpoint, GemmaBackend, ImageEmbeds};
use burn_gemma_model::QueryRows;

/// Bound on image features and logits: f32 against HF's f32 run, as the tiny text models' logits
/// (tests/tiny_models.rs).
const TOLERANCE: f32 = 1e-4;

fn floats(v: &serde_json::Value) -> Vec<f32> {
    match v.as_array() {
        Some(items) => items.iter().flat_map(floats).collect(),
        None => vec![v.as_f64().expect("a number") as f32],
    }
}

fn max_error(got: &[f32], want: &[f32]) -> f32 {
    assert_eq!(got.len(), want.len());
    assert!(got.iter().all(|v| v.is_finite()), "non-finite values");
    got.iter().zip(want).map(|(a, b)| (a - b).abs()).fold(0.0, f32::max)
}

fn values<B: burn::tensor::backend::Backend, const D: usize>(t: Tensor<B, D>) -> Vec<f32> {
    t.cast(DType::F32).into_data().convert::<f32>().to_vec().unwrap()
}

fn vision_matches_hf<B: GemmaBackend>(device: &B::Device) {
    let dir = common::fixtures().join("tiny-gemma-vision/gemma3");
    let reference = common::read_json(dir.join("reference.json"));
    let checkpoint = Checkpoint::open(&dir).unwrap();
    let image_token = reference["image_token_index"].as_u64().unwrap() as u32;
    assert_eq!(checkpoint.vision_config().unwrap().image_token_index, image_token);
    let model = checkpoint.load(common::dense_f32::<B>(device)).unwrap().model;
    let vision = checkpoint.load_vision(common::dense_f32::<B>(device)).unwrap();

    let mut features = Vec::new();
    for (i, image) in reference["images"].as_array().unwrap().iter().enumerate() {
        let pixels = Tensor::<B, 4>::from_data(TensorData::new(floats(&image["pixel_values"]), [1, 3, 56, 56]), device);
        let got = vision.image_features(pixels).unwrap();
        let err = max_error(&values(got.clone()), &floats(&image["features"]));
        println!("image {i}: features within {err:.2e} of HF");
        assert!(err <= TOLERANCE, "image {i}: features {err:.2e} from HF");
        let [_, n, width] = got.dims();
        features.push(got.reshape([n, width]));
    }

    for (p, prompt) in reference["prompts"].as_array().unwrap().iter().enumerate() {
        let ids = common::ids(&prompt["input_ids"]);
        // Each run of soft tokens takes the next image's features.
        let starts: Vec<usize> =
            (0..ids.len()).filter(|&i| ids[i] == image_token && (i == 0 || ids[i - 1] != image_token)).collect();
        assert_eq!(starts.len(), prompt["images"].as_u64().unwrap() as usize);
        let images: Vec<ImageEmbeds<B>> =
            starts.iter().zip(&features).map(|(&start, f)| ImageEmbeds { start, features: f.clone() }).collect();
        let mut cache = model.new_cache(1, ids.len() + 8).unwrap();
        let hidden = model.forward_hidden_with_images(token_tensor::<B>(&ids, device), &images, &mut cache).unwrap();
        let logits = model.logits(hidden);
        let err = max_error(&values(logits), &floats(&prompt["logits"]));
        println!("prompt {p} ({} images): logits within {err:.2e} of HF", images.len());
        assert!(err <= TOLERANCE, "prompt {p}: logits {err:.2e} from HF");

        // Greedy after the prompt, one token per step through the cache.
        let want = common::ids(&prompt["greedy_ids"]);
        let mut cache = model.new_cache(1, ids.len() + want.len()).unwrap();
        let hidden = model.forward_hidden_with_images(token_tensor::<B>(&ids, device), &images, &mut cache).unwrap();
        let [_, seq, width] = hidden.dims();
        let mut logits = model.logits(hidden.slice([0..1, seq - 1..seq, 0..width])).reshape([1, 512]);
        let mut got = Vec::new();
        for _ in 0..want.len() {
            let token = values(logits.clone().argmax(1).float())[0] as u32;
            got.push(token);
            let h = model.forward_hidden(token_tensor::<B>(&[token], device), &mut cache, QueryRows::Together).unwrap();
            logits = model.logits(h).reshape([1, 512]);
        }
        assert_eq!(got, want, "prompt {p}: greedy ids");
    }
}

#[test]
fn gemma3_images_match_hf_on_ndarray() {
    vision_matches_hf::<NdArray>(&Default::default());
}

#[cfg(feature = "candle")]
#[test]
fn gemma3_images_match_hf_on_candle() {
    vision_matches_hf::<burn_gemma::backends::Candle>(&Default::default());
}

#[cfg(feature = "wgpu")]
#[test]
fn gemma3_images_match_hf_on_wgpu() {
    vision_matches_hf::<burn_gemma::backends::Wgpu>(&Default::default());
}

#[cfg(feature = "cuda")]
#[test]
fn gemma3_images_match_hf_on_cuda() {
    vision_matches_hf::<burn_gemma::backends::Cuda>(&Default::default());
}
