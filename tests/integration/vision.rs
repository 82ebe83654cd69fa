//! Gemma 3 with images against HF transformers 5.23 (tests/fixtures/tiny-gemma-vision, made by
//! scripts/make_vision_fixtures.py): the SigLIP tower and projector's image features, the
//! logits of prompts with one and two images (each image's soft tokens attending to each other
//! both ways, the first image past the sliding window), greedy continuations.

use crate::common;

use burn::tensor::{DType, Tensor, TensorData};
use burn_gemma::{backends::NdArray, generation::token_tensor, Checkpoint, GemmaBackend, ImageEmbeds};
use burn_gemma_model::QueryRows;

/// Bound on image features and logits: f32 against HF's f32 run, as the tiny text models' logits
/// (tests/integration/tiny_models.rs).
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

/// The picture of the fixture resized and normalized as HF's PIL image processor does. Both
/// resample in 8 bits and round: a value may differ by one level (2/255 after normalizing).
#[test]
fn preprocessing_matches_hf_pil_processor() {
    let dir = common::fixtures().join("tiny-gemma-vision/gemma3");
    let reference = common::read_json(dir.join("reference.json"));
    let pixels = burn_gemma::images::Pixels::from_path(dir.join("image.png"), 56).unwrap();
    let want = floats(&reference["preprocessed"]);
    let step = 2.0 / 255.0;
    let off: Vec<f32> = pixels.values.iter().zip(&want).map(|(a, b)| (a - b).abs()).collect();
    let worst = off.iter().copied().fold(0.0, f32::max);
    let differing = off.iter().filter(|&&e| e > 1e-6).count();
    println!("preprocessed: {differing} of {} values differ, at most {worst:.2e}", want.len());
    assert!(worst <= step + 1e-6, "a value {worst:.4} from HF's");
}

fn fixture_pixels(reference: &serde_json::Value) -> Vec<burn_gemma::images::Pixels> {
    let images = reference["images"].as_array().unwrap();
    images.iter().map(|i| burn_gemma::images::Pixels { size: 56, values: floats(&i["pixel_values"]) }).collect()
}

fn vision_generator() -> (burn_gemma::Generator<NdArray>, serde_json::Value) {
    let dir = common::fixtures().join("tiny-gemma-vision/gemma3");
    let checkpoint = Checkpoint::open(&dir).unwrap();
    let device = Default::default();
    let model = checkpoint.load(common::dense_f32::<NdArray>(&device)).unwrap().model;
    let mut g = burn_gemma::Generator::new(model, common::tiny_tokenizer()).unwrap();
    g.set_vision(Some(checkpoint.load_vision(common::dense_f32::<NdArray>(&device)).unwrap())).unwrap();
    (g, common::read_json(dir.join("reference.json")))
}

/// The generator places each picture at its run of soft tokens: HF's greedy continuation, with
/// prompt chunks of every size (a chunk that would end inside a picture runs on to its end).
#[test]
fn generation_with_images_continues_as_hf() {
    let (mut g, reference) = vision_generator();
    let pixels = fixture_pixels(&reference);
    for prompt in reference["prompts"].as_array().unwrap() {
        let ids = common::ids(&prompt["input_ids"]);
        let n = prompt["images"].as_u64().unwrap() as usize;
        let want = common::ids(&prompt["greedy_ids"]);
        for chunk in [1, 3, 7, 64] {
            let config = burn_gemma::GenerationConfig {
                max_new_tokens: want.len(),
                prefill_chunk: std::num::NonZeroUsize::new(chunk).unwrap(),
                ..Default::default()
            };
            g.reset();
            let out = g.continue_ids_with_images(&ids, &pixels[..n], &config, |_| {}).unwrap();
            assert_eq!(out.tokens, want, "{n} images, chunks of {chunk}");
        }
    }
}

#[test]
fn pictures_that_do_not_fit_are_refused() {
    use burn_gemma::{images::ImageError, Error};
    let (mut g, reference) = vision_generator();
    let pixels = fixture_pixels(&reference);
    let ids = common::ids(&reference["prompts"][1]["input_ids"]);
    let config = burn_gemma::GenerationConfig { max_new_tokens: 2, ..Default::default() };
    // Two places, one picture.
    let err = g.continue_ids_with_images(&ids, &pixels[..1], &config, |_| {}).unwrap_err();
    assert!(matches!(err, Error::Image(ImageError::Count { images: 1, places: 2 })), "{err}");
    // A picture prepared for another tower.
    let small = burn_gemma::images::Pixels { size: 28, values: vec![0.0; 3 * 28 * 28] };
    let err = g.continue_ids_with_images(&ids, &[small.clone(), small], &config, |_| {}).unwrap_err();
    assert!(matches!(err, Error::Image(ImageError::VisionMismatch(_))), "{err}");
    // A run of soft tokens shorter than an image's.
    let short: Vec<u32> = ids.iter().copied().filter(|&t| t != 510).chain([510, 510]).collect();
    let err = g.continue_ids_with_images(&short, &pixels[..1], &config, |_| {}).unwrap_err();
    assert!(err.to_string().contains("soft tokens"), "{err}");
    // The generator still works after each refusal.
    g.reset();
    let out = g.continue_ids_with_images(&ids, &pixels, &config, |_| {}).unwrap();
    assert_eq!(out.tokens, common::ids(&reference["prompts"][1]["greedy_ids"])[..2]);
    // The text helpers need the tokenizer's image tokens (the tiny vocabulary has none).
    let err = g.generate_with_images("describe", &pixels[..1], &config, |_| {}).unwrap_err();
    assert!(err.to_string().contains("<start_of_image>"), "{err}");
    // A model without a tower.
    g.set_vision(None).unwrap();
    let err = g.continue_ids_with_images(&ids, &pixels, &config, |_| {}).unwrap_err();
    assert!(matches!(err, Error::Image(ImageError::NoVision)), "{err}");
}

/// A PNG chunk: length, type, data, CRC-32 (IEEE).
fn png_chunk(kind: &[u8; 4], data: &[u8]) -> Vec<u8> {
    let mut crc = 0xFFFF_FFFFu32;
    for &byte in kind.iter().chain(data) {
        crc ^= u32::from(byte);
        for _ in 0..8 {
            crc = if crc & 1 == 1 { (crc >> 1) ^ 0xEDB8_8320 } else { crc >> 1 };
        }
    }
    let mut out = (data.len() as u32).to_be_bytes().to_vec();
    out.extend_from_slice(kind);
    out.extend_from_slice(data);
    out.extend_from_slice(&(!crc).to_be_bytes());
    out
}

/// A PNG claiming `width x height` RGB pixels, with an empty pixel stream.
fn png_header(width: u32, height: u32) -> Vec<u8> {
    let mut ihdr = width.to_be_bytes().to_vec();
    ihdr.extend_from_slice(&height.to_be_bytes());
    ihdr.extend_from_slice(&[8, 2, 0, 0, 0]);
    let mut png = b"\x89PNG\r\n\x1a\n".to_vec();
    png.extend(png_chunk(b"IHDR", &ihdr));
    // An empty zlib stream: the header reads; the pixels are missing.
    png.extend(png_chunk(b"IDAT", &[0x78, 0x9c, 0x03, 0x00, 0x00, 0x00, 0x00, 0x01]));
    png.extend(png_chunk(b"IEND", &[]));
    png
}

#[test]
fn bad_pictures_give_clear_errors() {
    use burn_gemma::images::{ImageError, Pixels};
    let dir = common::fixtures().join("tiny-gemma-vision/gemma3");
    let good = std::fs::read(dir.join("image.png")).unwrap();
    assert!(Pixels::from_bytes(&good, 56).is_ok());
    // Truncated.
    let err = Pixels::from_bytes(&good[..good.len() / 2], 56).unwrap_err();
    assert!(matches!(err, ImageError::Decode(_)), "{err}");
    // Not a picture; nothing at all.
    let err = Pixels::from_bytes(b"GIF? no, plain text", 56).unwrap_err();
    assert!(matches!(err, ImageError::Decode(_)), "{err}");
    assert!(matches!(Pixels::from_bytes(&[], 56).unwrap_err(), ImageError::Decode(_)));
    // Huge dimensions: refused from the header, before any pixel is allocated.
    let err = Pixels::from_bytes(&png_header(100_000, 80_000), 56).unwrap_err();
    assert!(matches!(err, ImageError::TooLarge { width: 100_000, height: 80_000 }), "{err}");
    // Zero-sized.
    let err = Pixels::from_bytes(&png_header(0, 10), 56).unwrap_err();
    assert!(matches!(err, ImageError::Empty { .. } | ImageError::Decode(_)), "{err}");
    println!("zero-sized: {err}");
    // A missing file names its path.
    let err = Pixels::from_path("/nonexistent/picture.png", 56).unwrap_err();
    assert!(err.to_string().contains("/nonexistent/picture.png"), "{err}");
}

/// The tiny vocabulary with Gemma 3's image tokens at the fixture's ids (508, 509, 510).
fn tokenizer_with_image_tokens() -> burn_gemma::Tokenizer {
    let base = common::tiny_tokenizer();
    let mut tokens: Vec<String> =
        (0..512).map(|id| String::from_utf8_lossy(base.token_bytes(id)).into_owned()).collect();
    let mut types = vec![1; 512];
    for (id, piece) in
        [(0, "<pad>"), (1, "<eos>"), (2, "<bos>"), (3, "<unk>"), (4, "<start_of_turn>"), (5, "<end_of_turn>")]
    {
        tokens[id] = piece.into();
        types[id] = 3;
    }
    for b in 0..=255usize {
        tokens[6 + b] = format!("<0x{b:02X}>");
        types[6 + b] = 6;
    }
    for (id, piece) in [(508, "<start_of_image>"), (509, "<end_of_image>"), (510, "<image_soft_token>")] {
        tokens[id] = piece.into();
        types[id] = 3;
    }
    for (id, token) in tokens.iter_mut().enumerate().skip(262).take(508 - 262) {
        *token = format!("w{id}");
    }
    tokens[511] = "w511".into();
    let scores = (0..512).map(|i| -(i as f32)).collect();
    burn_gemma::Tokenizer::from_vocab(tokens, scores, types, 2).unwrap()
}

/// llama.cpp's projector GGUF of the fixture (its converter's names, metadata and the soft
/// embedding norm stored as `1 + w`) gives HF's image features.
#[test]
fn gemma3_mmproj_gguf_matches_hf() {
    use common::gguf::{GgufWriter, Meta};
    let dir = common::fixtures().join("tiny-gemma-vision/gemma3");
    let reference = common::read_json(dir.join("reference.json"));
    let config = common::read_json(dir.join("config.json"));
    let v = &config["vision_config"];
    let u = |k: &str| v[k].as_u64().unwrap() as u32;
    let mut g = GgufWriter::default();
    g.meta("general.architecture", Meta::Str("clip".into()));
    g.meta("clip.projector_type", Meta::Str("gemma3".into()));
    g.meta("clip.vision.embedding_length", Meta::U32(u("hidden_size")));
    g.meta("clip.vision.feed_forward_length", Meta::U32(u("intermediate_size")));
    g.meta("clip.vision.block_count", Meta::U32(u("num_hidden_layers")));
    g.meta("clip.vision.attention.head_count", Meta::U32(u("num_attention_heads")));
    g.meta("clip.vision.attention.layer_norm_epsilon", Meta::F32(1e-6));
    g.meta("clip.vision.image_size", Meta::U32(u("image_size")));
    g.meta("clip.vision.patch_size", Meta::U32(u("patch_size")));
    // 4 patches a side, 2 soft tokens a side.
    g.meta("clip.vision.projector.scale_factor", Meta::U32(2));
    let tensors = common::f32_tensors(&std::fs::read(dir.join("model.safetensors")).unwrap());
    for (hf, (shape, mut values)) in tensors {
        let name = if let Some(tower) = hf.strip_prefix("model.vision_tower.") {
            let fixed = [
                ("embeddings.patch_embedding.weight", "v.patch_embd.weight"),
                ("embeddings.patch_embedding.bias", "v.patch_embd.bias"),
                ("embeddings.position_embedding.weight", "v.position_embd.weight"),
                ("post_layernorm.weight", "v.post_ln.weight"),
                ("post_layernorm.bias", "v.post_ln.bias"),
            ];
            match fixed.iter().find(|(h, _)| *h == tower) {
                Some((_, g)) => g.to_string(),
                None => {
                    let (layer, rest) = tower.strip_prefix("encoder.layers.").unwrap().split_once('.').unwrap();
                    let (part, suffix) = rest.rsplit_once('.').unwrap();
                    let part = match part {
                        "layer_norm1" => "ln1",
                        "layer_norm2" => "ln2",
                        "self_attn.q_proj" => "attn_q",
                        "self_attn.k_proj" => "attn_k",
                        "self_attn.v_proj" => "attn_v",
                        "self_attn.out_proj" => "attn_out",
                        "mlp.fc1" => "ffn_up",
                        "mlp.fc2" => "ffn_down",
                        other => panic!("unmapped {other}"),
                    };
                    format!("v.blk.{layer}.{part}.{suffix}")
                }
            }
        } else if hf == "model.multi_modal_projector.mm_input_projection_weight" {
            "mm.input_projection.weight".into()
        } else if hf == "model.multi_modal_projector.mm_soft_emb_norm.weight" {
            values.iter_mut().for_each(|w| *w += 1.0);
            "mm.soft_emb_norm.weight".into()
        } else {
            continue;
        };
        g.tensor(&name, shape, values);
    }
    let out = std::env::temp_dir().join(format!("burn-gemma-mmproj-{}", std::process::id()));
    std::fs::create_dir_all(&out).unwrap();
    let path = out.join("mmproj.gguf");
    std::fs::write(&path, g.bytes()).unwrap();

    let tokenizer = tokenizer_with_image_tokens();
    let mmproj = burn_gemma::MmprojCheckpoint::open(&path, &tokenizer).unwrap_or_else(|e| panic!("{e}"));
    let hf = Checkpoint::open(&dir).unwrap();
    // The same config, the norm epsilon stored as an f32.
    let (mut got, want) = (mmproj.config().clone(), hf.vision_config().unwrap());
    assert!((got.vision.layer_norm_eps - want.vision.layer_norm_eps).abs() < 1e-12);
    got.vision.layer_norm_eps = want.vision.layer_norm_eps;
    assert_eq!(&got, want);
    let device = Default::default();
    let vision = mmproj.load(common::dense_f32::<NdArray>(&device)).unwrap();
    for (i, image) in reference["images"].as_array().unwrap().iter().enumerate() {
        let pixels =
            Tensor::<NdArray, 4>::from_data(TensorData::new(floats(&image["pixel_values"]), [1, 3, 56, 56]), &device);
        let err = max_error(&values(vision.image_features(pixels).unwrap()), &floats(&image["features"]));
        println!("mmproj image {i}: features within {err:.2e} of HF");
        assert!(err <= TOLERANCE, "image {i}: {err:.2e}");
    }
    // Not a projector; a tokenizer without image tokens.
    let err = burn_gemma::MmprojCheckpoint::open(dir.join("model.safetensors"), &tokenizer).err().unwrap();
    println!("{err}");
    let err = burn_gemma::MmprojCheckpoint::open(&path, &common::tiny_tokenizer()).err().unwrap();
    assert!(err.to_string().contains("<start_of_image>"), "{err}");
    let _ = std::fs::remove_dir_all(&out);
}

/// The text helpers with a vocabulary that has the image tokens: `<start_of_image>` in the
/// prompt (or none: the pictures go first) expands to Gemma 3's image sequence, and generation
/// gives what the same ids give through `continue_ids_with_images`.
#[test]
fn prompts_with_image_places_expand_as_gemma3_processor() {
    let dir = common::fixtures().join("tiny-gemma-vision/gemma3");
    let checkpoint = Checkpoint::open(&dir).unwrap();
    let device = Default::default();
    let model = checkpoint.load(common::dense_f32::<NdArray>(&device)).unwrap().model;
    let tokenizer = tokenizer_with_image_tokens();
    let mut g = burn_gemma::Generator::new(model, tokenizer_with_image_tokens()).unwrap();
    g.set_vision(Some(checkpoint.load_vision(common::dense_f32::<NdArray>(&device)).unwrap())).unwrap();
    let reference = common::read_json(dir.join("reference.json"));
    let pixels = fixture_pixels(&reference);
    let config = burn_gemma::GenerationConfig { max_new_tokens: 4, ..Default::default() };
    let out = g.generate_with_images("w300 <start_of_image> w301", &pixels[..1], &config, |_| {}).unwrap();
    let soft = "<image_soft_token>".repeat(4);
    let text = format!("w300 \n\n<start_of_image>{soft}<end_of_image>\n\n w301");
    let ids = tokenizer.encode(&text, burn_gemma::Bos::Prepend).unwrap();
    assert_eq!(ids.iter().filter(|&&t| t == 510).count(), 4);
    g.reset();
    let same = g.continue_ids_with_images(&ids, &pixels[..1], &config, |_| {}).unwrap();
    assert_eq!(out.tokens, same.tokens);
    // No place in the prompt: the pictures go first; two places for one picture: refused.
    assert!(g.generate_with_images("w300", &pixels[..2], &config, |_| {}).is_ok());
    let err = g.generate_with_images("<start_of_image><start_of_image>", &pixels[..1], &config, |_| {}).unwrap_err();
    assert!(err.to_string().contains("1 images for 2 places"), "{err}");
}

/// Bound on the Gemma 4 prompts' logits against HF's f32 run: HF's own f32 logits of these
/// prompts are up to 4.2e-4 from its f64 run (the fixture script's models in f64), and the tiny
/// Gemma 4 decoders' text logits are held to 1e-3 (tests/integration/tiny_models.rs).
const GEMMA4_LOGITS: f32 = 1e-3;

/// Gemma 4 (tests/fixtures/tiny-gemma-vision/gemma4 and gemma4-e, made by
/// scripts/make_gemma4_vision_fixtures.py): the vision tower (clipped linears, one KV head for
/// two query heads, axial RoPE, the 2 x 2 pooler, standardization) and embedder give HF's soft
/// tokens for a 4 x 6 and a 2 x 2 patch grid, and the text models with them placed HF's logits.
fn gemma4_vision_matches_hf<B: GemmaBackend>(device: &B::Device) {
    for variant in ["gemma4", "gemma4-e"] {
        gemma4_variant_matches_hf::<B>(variant, device);
    }
}

/// One fixture: the features of both images, then the logits of every position of a prompt
/// with one image (past the sliding window) and with both (the soft tokens attending to each
/// other both ways on sliding layers; the E model's per-layer inputs of image positions those
/// of the pad token).
fn gemma4_variant_matches_hf<B: GemmaBackend>(variant: &str, device: &B::Device) {
    let dir = common::fixtures().join("tiny-gemma-vision").join(variant);
    let reference = common::read_json(dir.join("reference.json"));
    let checkpoint = Checkpoint::open(&dir).unwrap();
    let config = checkpoint.gemma4_vision_config().expect("a Gemma 4 vision config");
    let image_token = config.image_token_id;
    assert_eq!((image_token, config.vision.pooling_kernel_size), (500, 2));
    assert!(checkpoint.vision_config().is_none());
    let vision = checkpoint.load_gemma4_vision(common::dense_f32::<B>(device)).unwrap();
    let patch_values = 3 * 4 * 4;
    let mut features = Vec::new();
    for (i, image) in reference["images"].as_array().unwrap().iter().enumerate() {
        let (rows, cols) = (image["rows"].as_u64().unwrap() as usize, image["cols"].as_u64().unwrap() as usize);
        let pixels =
            Tensor::<B, 2>::from_data(TensorData::new(floats(&image["patches"]), [rows * cols, patch_values]), device);
        let got = vision.image_features(&burn_gemma::Gemma4Patches { values: pixels, rows, cols }).unwrap();
        assert_eq!(got.dims(), [rows / 2 * cols / 2, 64], "image {i}: soft tokens");
        let err = max_error(&values(got.clone()), &floats(&image["features"]));
        println!("{variant} image {i} ({rows} x {cols} patches): features within {err:.2e} of HF");
        assert!(err <= TOLERANCE, "{variant} image {i}: features {err:.2e} from HF");
        features.push(got);
    }
    // The text decoder of the multimodal checkpoint (`model.language_model.*`).
    let loaded = checkpoint.load(common::dense_f32::<B>(device)).unwrap();
    let unused = &loaded.report.unused_tensors;
    assert!(!unused.is_empty() && unused.iter().all(|name| name.contains("vision")), "{unused:?}");
    let model = loaded.model;
    for (p, prompt) in reference["prompts"].as_array().unwrap().iter().enumerate() {
        let ids = common::ids(&prompt["input_ids"]);
        let starts: Vec<usize> =
            (0..ids.len()).filter(|&i| ids[i] == image_token && (i == 0 || ids[i - 1] != image_token)).collect();
        assert_eq!(starts.len(), prompt["images"].as_u64().unwrap() as usize);
        let images: Vec<ImageEmbeds<B>> =
            starts.iter().zip(&features).map(|(&start, f)| ImageEmbeds { start, features: f.clone() }).collect();
        let mut cache = model.new_cache(1, ids.len() + 8).unwrap();
        let hidden = model.forward_hidden_with_images(token_tensor::<B>(&ids, device), &images, &mut cache).unwrap();
        let err = max_error(&values(model.logits(hidden)), &floats(&prompt["logits"]));
        println!("{variant} prompt {p} ({} images): logits within {err:.2e} of HF", images.len());
        assert!(err <= GEMMA4_LOGITS, "{variant} prompt {p}: logits {err:.2e} from HF");
    }
}

#[test]
fn gemma4_images_match_hf_on_ndarray() {
    gemma4_vision_matches_hf::<NdArray>(&Default::default());
}

#[cfg(feature = "candle")]
#[test]
fn gemma4_images_match_hf_on_candle() {
    gemma4_vision_matches_hf::<burn_gemma::backends::Candle>(&Default::default());
}

#[cfg(feature = "wgpu")]
#[test]
fn gemma4_images_match_hf_on_wgpu() {
    gemma4_vision_matches_hf::<burn_gemma::backends::Wgpu>(&Default::default());
}

#[cfg(feature = "cuda")]
#[test]
fn gemma4_images_match_hf_on_cuda() {
    gemma4_vision_matches_hf::<burn_gemma::backends::Cuda>(&Default::default());
}

/// Patch grids the tower cannot pool, or whose values do not match, are refused by name; a
/// Gemma 4 checkpoint asked for Gemma 3's tower says where its own is.
#[test]
fn gemma4_bad_patch_grids_are_refused() {
    let device = Default::default();
    let dir = common::fixtures().join("tiny-gemma-vision/gemma4");
    let checkpoint = Checkpoint::open(&dir).unwrap();
    let vision = checkpoint.load_gemma4_vision(common::dense_f32::<NdArray>(&device)).unwrap();
    let patches = |rows: usize, cols: usize, width: usize| burn_gemma::Gemma4Patches {
        values: Tensor::<NdArray, 2>::zeros([rows * cols, width], &device),
        rows,
        cols,
    };
    for (p, what) in [
        (patches(3, 4, 48), "does not pool by 2 x 2"),
        (patches(0, 4, 48), "does not pool by 2 x 2"),
        (patches(2, 2, 47), "4 patches of 47 values"),
        (patches(18, 2, 48), "past the 16 positions"),
    ] {
        match vision.image_features(&p) {
            Err(burn_gemma_model::ModelError::InvalidInput(reason)) => {
                assert!(reason.contains(what), "{reason}")
            }
            other => panic!("{what}: {:?}", other.map(|t| t.dims())),
        }
    }
    match checkpoint.load_vision(common::dense_f32::<NdArray>(&device)) {
        Err(e) => assert!(e.to_string().contains("load_gemma4_vision"), "{e}"),
        Ok(_) => panic!("Gemma 3's tower loaded from a Gemma 4 checkpoint"),
    }
}

/// Gemma 4's preprocessing of the fixture picture (37x23) against HF's PIL processor (4x4
/// patches pooled 2x2, at most 70 soft tokens): the same 12 x 20 patch grid and the same values
/// (the resampling is PIL's, fixed-point weights and 8-bit rounding after each pass): equal up
/// to the f32 rounding of `x / 255`.
#[test]
fn gemma4_preprocessing_matches_hf_pil_processor() {
    let dir = common::fixtures().join("tiny-gemma-vision");
    let reference = common::read_json(dir.join("gemma4/reference.json"));
    let want = &reference["preprocessed"];
    let budget = burn_gemma::images::PatchBudget { patch_size: 4, pooling_kernel_size: 2, max_soft_tokens: 70 };
    let grid = burn_gemma::images::PatchGrid::from_path(dir.join("gemma3/image.png"), budget).unwrap();
    assert_eq!(
        (grid.rows, grid.cols),
        (want["rows"].as_u64().unwrap() as usize, want["cols"].as_u64().unwrap() as usize)
    );
    let want = floats(&want["patches"]);
    assert_eq!(grid.values.len(), want.len());
    let off: Vec<f32> = grid.values.iter().zip(&want).map(|(a, b)| (a - b).abs()).collect();
    let worst = off.iter().copied().fold(0.0, f32::max);
    let differing = off.iter().filter(|&&e| e > 1e-6).count();
    println!("Gemma 4 preprocessed: {differing} of {} values differ, at most {worst:.2e}", want.len());
    assert!(worst <= 1e-6, "a value {worst:.4} from HF's");
    // HF's sizes: the largest grid of the aspect ratio within the budget, and the thin-side rule.
    assert_eq!(budget.target_size(23, 37).unwrap(), (48, 80));
    assert_eq!(budget.target_size(1, 1000).unwrap(), (8, 560));
    assert_eq!(budget.target_size(1000, 1).unwrap(), (560, 8));
    assert!(budget.target_size(0, 5).is_err());
    let absurd = burn_gemma::images::PatchBudget { max_soft_tokens: usize::MAX, ..budget };
    assert!(matches!(absurd.target_size(23, 37), Err(burn_gemma::images::ImageError::VisionMismatch(_))));
}
