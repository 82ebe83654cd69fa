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
        let logits = model.logits(hidden).expect("logits");
        let err = max_error(&values(logits), &floats(&prompt["logits"]));
        println!("prompt {p} ({} images): logits within {err:.2e} of HF", images.len());
        assert!(err <= TOLERANCE, "prompt {p}: logits {err:.2e} from HF");

        // Greedy after the prompt, one token per step through the cache.
        let want = common::ids(&prompt["greedy_ids"]);
        let mut cache = model.new_cache(1, ids.len() + want.len()).unwrap();
        let hidden = model.forward_hidden_with_images(token_tensor::<B>(&ids, device), &images, &mut cache).unwrap();
        let [_, seq, width] = hidden.dims();
        let mut logits = model.logits(hidden.slice([0..1, seq - 1..seq, 0..width])).expect("logits").reshape([1, 512]);
        let mut got = Vec::new();
        for _ in 0..want.len() {
            let token = values(logits.clone().argmax(1).float())[0] as u32;
            got.push(token);
            let h = model.forward_hidden(token_tensor::<B>(&[token], device), &mut cache, QueryRows::Together).unwrap();
            logits = model.logits(h).expect("logits").reshape([1, 512]);
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

fn fixture_pixels(reference: &serde_json::Value) -> Vec<burn_gemma::Picture> {
    let images = reference["images"].as_array().unwrap();
    images.iter().map(|i| burn_gemma::images::Pixels { size: 56, values: floats(&i["pixel_values"]) }.into()).collect()
}

fn vision_generator() -> (burn_gemma::Generator<NdArray>, serde_json::Value) {
    let dir = common::fixtures().join("tiny-gemma-vision/gemma3");
    let checkpoint = Checkpoint::open(&dir).unwrap();
    let device = Default::default();
    let model = checkpoint.load(common::dense_f32::<NdArray>(&device)).unwrap().model;
    let mut g = burn_gemma::Generator::new(model, common::tiny_tokenizer()).unwrap();
    g.set_vision(Some(checkpoint.load_vision(common::dense_f32::<NdArray>(&device)).unwrap().into())).unwrap();
    (g, common::read_json(dir.join("reference.json")))
}

/// The generator places each picture at its run of soft tokens: HF's greedy continuation, with
/// prompt chunks of every size (a chunk that would end inside a picture runs on to its end).
#[test]
fn generation_with_images_continues_as_hf() {
    let (mut g, reference) = vision_generator();
    continues_as_hf(&mut g, &reference, &fixture_pixels(&reference), "gemma3");
}

/// Each prompt of `greedy` (`input_ids`, its `images` first pictures, HF's `greedy_ids`) through
/// `g` with prompt chunks of 1, 3, 7 and 64: HF's tokens.
fn continues_as_hf(
    g: &mut burn_gemma::Generator<NdArray>,
    greedy: &serde_json::Value,
    pictures: &[burn_gemma::Picture],
    what: &str,
) {
    for prompt in greedy["prompts"].as_array().unwrap() {
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
            let out = g.continue_ids_with_images(&ids, &pictures[..n], &config, |_| {}).unwrap();
            assert_eq!(out.tokens, want, "{what}: {n} images, chunks of {chunk}");
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
    let small: burn_gemma::Picture = burn_gemma::images::Pixels { size: 28, values: vec![0.0; 3 * 28 * 28] }.into();
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
    tokenizer_with_specials(&[(508, "<start_of_image>"), (509, "<end_of_image>"), (510, "<image_soft_token>")])
}

/// The tiny vocabulary with `specials` (id, piece) as control tokens, the rest `w{id}`.
fn tokenizer_with_specials(specials: &[(usize, &str)]) -> burn_gemma::Tokenizer {
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
    for (id, token) in tokens.iter_mut().enumerate().skip(262) {
        *token = format!("w{id}");
    }
    for &(id, piece) in specials {
        tokens[id] = piece.into();
        types[id] = 3;
    }
    let scores = (0..512).map(|i| -(i as f32)).collect();
    burn_gemma::Tokenizer::from_vocab(tokens, scores, types, 2).unwrap()
}

/// A projector GGUF's metadata as llama.cpp's converter writes it for the vision config `v`
/// (HF's field names): `projector` is the projector type's key and value, `image_size` the
/// size it records and `scale` the soft tokens' pooling per side.
fn clip_gguf(projector: (&str, &str), v: &serde_json::Value, image_size: u32, scale: u32) -> common::gguf::GgufWriter {
    use common::gguf::{GgufWriter, Meta};
    let u = |k: &str| v[k].as_u64().unwrap() as u32;
    let mut g = GgufWriter::default();
    g.meta("general.architecture", Meta::Str("clip".into()));
    g.meta(projector.0, Meta::Str(projector.1.into()));
    g.meta("clip.vision.embedding_length", Meta::U32(u("hidden_size")));
    g.meta("clip.vision.feed_forward_length", Meta::U32(u("intermediate_size")));
    g.meta("clip.vision.block_count", Meta::U32(u("num_hidden_layers")));
    g.meta("clip.vision.attention.head_count", Meta::U32(u("num_attention_heads")));
    g.meta("clip.vision.attention.layer_norm_epsilon", Meta::F32(1e-6));
    g.meta("clip.vision.image_size", Meta::U32(image_size));
    g.meta("clip.vision.patch_size", Meta::U32(u("patch_size")));
    g.meta("clip.vision.projector.scale_factor", Meta::U32(scale));
    g
}

/// llama.cpp's projector GGUF of the fixture (its converter's names, metadata and the soft
/// embedding norm stored as `1 + w`) gives HF's image features.
#[test]
fn gemma3_mmproj_gguf_matches_hf() {
    let dir = common::fixtures().join("tiny-gemma-vision/gemma3");
    let reference = common::read_json(dir.join("reference.json"));
    let config = common::read_json(dir.join("config.json"));
    let v = &config["vision_config"];
    // 4 patches a side, 2 soft tokens a side.
    let mut g = clip_gguf(("clip.projector_type", "gemma3"), v, v["image_size"].as_u64().unwrap() as u32, 2);
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
    let path = common::Scratch::new("mmproj").file("mmproj.gguf");
    std::fs::write(&path, g.bytes()).unwrap();

    let tokenizer = tokenizer_with_image_tokens();
    let mmproj = burn_gemma::MmprojCheckpoint::open(&path, &tokenizer).unwrap_or_else(|e| panic!("{e}"));
    let hf = Checkpoint::open(&dir).unwrap();
    // The same config, the norm epsilon stored as an f32.
    let burn_gemma::MmprojConfig::Gemma3(mut got) = mmproj.config().clone() else { panic!("not Gemma 3's") };
    let want = hf.vision_config().unwrap();
    assert!((got.vision.layer_norm_eps - want.vision.layer_norm_eps).abs() < 1e-12);
    got.vision.layer_norm_eps = want.vision.layer_norm_eps;
    assert_eq!(&got, want);
    let device = Default::default();
    let burn_gemma::Vision::Gemma3(vision) = mmproj.load(common::dense_f32::<NdArray>(&device)).unwrap() else {
        panic!("a Gemma 3 projector loads Gemma 3's tower")
    };
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
}

/// llama.cpp's converter's name of a Gemma 4 vision weight (`Gemma4VisionAudioModel` then
/// gguf-py's tensor map), written out here from those two sources so that the test does not
/// share the loader's table.
fn gemma4v_gguf_name(hf: &str) -> Option<String> {
    if hf == "model.embed_vision.embedding_projection.weight" {
        return Some("mm.input_projection.weight".into());
    }
    let tower = hf.strip_prefix("model.vision_tower.")?;
    let fixed = [
        ("patch_embedder.input_proj.weight", "v.patch_embd.weight"),
        ("patch_embedder.position_embedding_table", "v.position_embd.weight"),
        ("std_bias", "v.std_bias"),
        ("std_scale", "v.std_scale"),
    ];
    if let Some((_, g)) = fixed.iter().find(|(h, _)| *h == tower) {
        return Some(g.to_string());
    }
    let (layer, rest) = tower.strip_prefix("encoder.layers.")?.split_once('.')?;
    let rest = rest.replace(".linear.weight", ".weight");
    let (part, suffix) = rest.rsplit_once('.')?;
    let part = match part {
        "input_layernorm" => "ln1",
        "post_attention_layernorm" => "attn_post_norm",
        "pre_feedforward_layernorm" => "ln2",
        "post_feedforward_layernorm" => "ffn_post_norm",
        "self_attn.q_proj" => "attn_q",
        "self_attn.k_proj" => "attn_k",
        "self_attn.v_proj" => "attn_v",
        "self_attn.o_proj" => "attn_out",
        "self_attn.q_norm" => "attn_q_norm",
        "self_attn.k_norm" => "attn_k_norm",
        "mlp.gate_proj" => "ffn_gate",
        "mlp.up_proj" => "ffn_up",
        "mlp.down_proj" => "ffn_down",
        other => panic!("unmapped {other}"),
    };
    Some(format!("v.blk.{layer}.{part}.{suffix}"))
}

/// llama.cpp's projector GGUF of the Gemma 4 fixture (projector `gemma4v`, its converter's
/// names, the patch projection stored as a channel-first convolution kernel, the clipped
/// linears' scalar bounds as 1-D tensors) loads HF's config and gives HF's image features; a
/// Gemma 4 projector refuses a tokenizer without Gemma 4's image tokens.
#[test]
fn gemma4_mmproj_gguf_matches_hf() {
    let dir = common::fixtures().join("tiny-gemma-vision/gemma4");
    let reference = common::read_json(dir.join("reference.json"));
    let config = common::read_json(dir.join("config.json"));
    let v = &config["vision_config"];
    let u = |k: &str| v[k].as_u64().unwrap() as u32;
    // llama.cpp's converter writes an unused image size of 224 for Gemma 4.
    let mut g = clip_gguf(("clip.vision.projector_type", "gemma4v"), v, 224, u("pooling_kernel_size"));
    let p = u("patch_size") as usize;
    let tensors = common::f32_tensors(&std::fs::read(dir.join("model.safetensors")).unwrap());
    for (hf, (shape, values)) in tensors {
        let Some(name) = gemma4v_gguf_name(&hf) else { continue };
        let (shape, values) = match (shape.as_slice(), name.as_str()) {
            // `[n, p * p * 3]` (row, column, channel) -> `[n, 3, p, p]`.
            ([n, _], "v.patch_embd.weight") => {
                let mut kernel = vec![0.0; values.len()];
                for i in 0..*n {
                    for y in 0..p {
                        for x in 0..p {
                            for c in 0..3 {
                                kernel[((i * 3 + c) * p + y) * p + x] = values[i * 3 * p * p + (y * p + x) * 3 + c];
                            }
                        }
                    }
                }
                (vec![*n, 3, p, p], kernel)
            }
            ([], _) => (vec![1], values),
            _ => (shape, values),
        };
        g.tensor(&name, shape, values);
    }
    let path = common::Scratch::new("mmproj4").file("mmproj.gguf");
    std::fs::write(&path, g.bytes()).unwrap();

    let mmproj = burn_gemma::MmprojCheckpoint::open(&path, &gemma4_tokenizer()).unwrap_or_else(|e| panic!("{e}"));
    let hf = Checkpoint::open(&dir).unwrap();
    let burn_gemma::MmprojConfig::Gemma4(mut got) = mmproj.config().clone() else { panic!("not Gemma 4's") };
    let want = hf.gemma4_vision_config().unwrap();
    assert!((got.vision.rms_norm_eps - want.vision.rms_norm_eps).abs() < 1e-12);
    got.vision.rms_norm_eps = want.vision.rms_norm_eps;
    assert_eq!(&got, want);
    let device = Default::default();
    let burn_gemma::Vision::Gemma4 { tower, .. } = mmproj.load(common::dense_f32::<NdArray>(&device)).unwrap() else {
        panic!("a gemma4v projector loads Gemma 4's tower")
    };
    for (i, image) in reference["images"].as_array().unwrap().iter().enumerate() {
        let (rows, cols) = (image["rows"].as_u64().unwrap() as usize, image["cols"].as_u64().unwrap() as usize);
        let data = TensorData::new(floats(&image["patches"]), [rows * cols, 3 * p * p]);
        let patches = burn_gemma::Gemma4Patches { values: Tensor::<NdArray, 2>::from_data(data, &device), rows, cols };
        let err = max_error(&values(tower.image_features(&patches).unwrap()), &floats(&image["features"]));
        println!("gemma4v mmproj image {i}: features within {err:.2e} of HF");
        assert!(err <= TOLERANCE, "image {i}: {err:.2e}");
    }
    let err = burn_gemma::MmprojCheckpoint::open(&path, &tokenizer_with_image_tokens()).err().unwrap();
    assert!(err.to_string().contains("<|image>"), "{err}");
}

/// Pan-and-scan as HF's `Gemma3ImageProcessorPil` does it (`pan_and_scan.json`, made with
/// transformers 5.23): the crop sizes of its rule for pictures of many shapes, the whole
/// picture and its crops of two elongated pictures (values within one 8-bit level, as the plain
/// preprocessing), and the prompt text `Gemma3Processor` makes of them; such a picture's squares
/// are read as HF reads them, as separate images at their runs of soft tokens.
#[test]
fn pan_and_scan_matches_hf_gemma3_processor() {
    use burn_gemma::images::PanAndScan;
    let dir = common::fixtures().join("tiny-gemma-vision/gemma3");
    let fixture = common::read_json(dir.join("pan_and_scan.json"));
    let rule_of = |r: &serde_json::Value| PanAndScan {
        min_crop_size: r["pan_and_scan_min_crop_size"].as_u64().unwrap() as usize,
        max_num_crops: r["pan_and_scan_max_num_crops"].as_u64().unwrap() as usize,
        min_ratio_to_activate: r["pan_and_scan_min_ratio_to_activate"].as_f64().unwrap(),
    };
    let small = rule_of(&fixture["rule"]);
    for case in fixture["crop_sizes"].as_array().unwrap() {
        let rule = if case["rule"] == "default" { PanAndScan::default() } else { small };
        let (w, h) = (case["width"].as_u64().unwrap() as u32, case["height"].as_u64().unwrap() as u32);
        let got: Vec<[u64; 2]> =
            rule.crops(w, h).iter().map(|&(_, _, cw, ch)| [u64::from(cw), u64::from(ch)]).collect();
        let want: Vec<[u64; 2]> = case["crops"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| [c[0].as_u64().unwrap(), c[1].as_u64().unwrap()])
            .collect();
        assert_eq!(got, want, "{w}x{h} with the {} rule", case["rule"]);
    }

    let (mut g, _) = vision_generator();
    let processor = g.vision().unwrap().processor().with_pan_and_scan(Some(small)).unwrap();
    let tokenizer = tokenizer_with_image_tokens();
    let step = 2.0 / 255.0;
    for case in fixture["pictures"].as_array().unwrap() {
        let file = case["file"].as_str().unwrap();
        let picture = processor.read(dir.join(file)).unwrap();
        let burn_gemma::Picture::Crops { whole, crops } = &picture else { panic!("{file}: no crops") };
        assert_eq!(crops.len() as u64, case["num_crops"].as_u64().unwrap(), "{file}");
        let want: Vec<Vec<f32>> = case["squares"].as_array().unwrap().iter().map(floats_nested).collect();
        for (i, (got, want)) in std::iter::once(whole).chain(crops).zip(&want).enumerate() {
            let worst = got.values.iter().zip(want).map(|(a, b)| (a - b).abs()).fold(0.0, f32::max);
            println!("{file} square {i}: within {worst:.2e} of HF");
            assert!(got.values.len() == want.len() && worst <= step + 1e-6, "{file} square {i}: {worst:.4}");
        }
        let text = processor.expand("<start_of_image>", std::slice::from_ref(&picture), &tokenizer).unwrap();
        assert_eq!(text, case["text"].as_str().unwrap(), "{file}");
        // The squares at their runs, as separate pictures would be.
        let ids = tokenizer.encode(&format!("w300{text}w301"), burn_gemma::Bos::Prepend).unwrap();
        let config = burn_gemma::GenerationConfig { max_new_tokens: 4, ..Default::default() };
        let squares: Vec<burn_gemma::Picture> = std::iter::once(whole).chain(crops).map(|p| p.clone().into()).collect();
        let with_crops = g.continue_ids_with_images(&ids, std::slice::from_ref(&picture), &config, |_| {}).unwrap();
        g.reset();
        let separate = g.continue_ids_with_images(&ids, &squares, &config, |_| {}).unwrap();
        g.reset();
        assert_eq!(with_crops.tokens, separate.tokens, "{file}");
        // One run short: refused, naming the runs.
        let err = g.continue_ids_with_images(&ids, &squares[..3], &config, |_| {}).unwrap_err();
        assert!(err.to_string().contains("3 images for 4 places"), "{err}");
        g.reset();
    }
    // Gemma 4 keeps the aspect ratio: no pan-and-scan.
    let (g4, _, _) = gemma4_vision_generator("gemma4");
    let err = g4.vision().unwrap().processor().with_pan_and_scan(Some(PanAndScan::default())).unwrap_err();
    assert!(err.to_string().contains("Gemma 3's"), "{err}");
}

/// An engine set to pan-and-scan prepares a wide picture as its whole and crops (what the
/// server then reads from a chat message), and generates from them the generator's tokens,
/// with prompt chunks that end inside the crops' runs; a Gemma 4 engine refuses the setting.
#[test]
fn engine_reads_pan_and_scan_pictures_as_the_generator() {
    use burn_gemma::engine::{Engine, EngineConfig, Event, Request};
    use burn_gemma::images::PanAndScan;
    let dir = common::fixtures().join("tiny-gemma-vision/gemma3");
    let rule = PanAndScan { min_crop_size: 8, ..PanAndScan::default() };
    let bytes = std::fs::read(dir.join("wide.png")).unwrap();
    let tokenizer = tokenizer_with_image_tokens();
    let (model, vision, _, _) = engine_fixture("gemma3");
    let mut engine =
        Engine::with_vision(model, Some(vision), tokenizer_with_image_tokens(), EngineConfig::default()).unwrap();
    engine.set_pan_and_scan(Some(rule)).unwrap();
    let processor = engine.image_processor().unwrap().clone();
    let picture = processor.decode(&bytes).unwrap();
    assert!(matches!(&picture, burn_gemma::Picture::Crops { crops, .. } if crops.len() == 3));
    let text = processor.expand("w300 <start_of_image> w301", std::slice::from_ref(&picture), &tokenizer).unwrap();
    let ids = tokenizer.encode(&text, burn_gemma::Bos::Prepend).unwrap();
    let want = {
        let (mut g, _) = vision_generator();
        let config = burn_gemma::GenerationConfig { max_new_tokens: 5, ..Default::default() };
        g.continue_ids_with_images(&ids, std::slice::from_ref(&picture), &config, |_| {}).unwrap().tokens
    };
    for chunk in [5, 64] {
        let mut request = Request::new(
            ids.clone(),
            burn_gemma::GenerationConfig {
                max_new_tokens: 5,
                prefill_chunk: std::num::NonZeroUsize::new(chunk).unwrap(),
                ..Default::default()
            },
        );
        request.images = vec![picture.clone()];
        let mut got = Vec::new();
        for event in engine.submit(request).unwrap() {
            match event.unwrap() {
                Event::Token(t) => got.push(t.id),
                Event::Done(_) => break,
            }
        }
        assert_eq!(got, want, "prompt chunks of {chunk}");
    }
    engine.shutdown();
    let (model, vision, _, _) = engine_fixture("gemma4");
    let mut engine = Engine::with_vision(model, Some(vision), gemma4_tokenizer(), EngineConfig::default()).unwrap();
    assert!(engine.set_pan_and_scan(Some(rule)).is_err());
    engine.shutdown();
}

/// A JSON array of numbers, nested to any depth, flattened.
fn floats_nested(v: &serde_json::Value) -> Vec<f32> {
    match v {
        serde_json::Value::Array(items) => items.iter().flat_map(floats_nested).collect(),
        other => vec![other.as_f64().unwrap() as f32],
    }
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
    g.set_vision(Some(checkpoint.load_vision(common::dense_f32::<NdArray>(&device)).unwrap().into())).unwrap();
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
        let err = max_error(&values(model.logits(hidden).expect("logits")), &floats(&prompt["logits"]));
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

/// A Gemma 4 fixture's model and tokenizer (`<|image|>`, `<|image>`, `<image|>` at the fixture's
/// 500, 501, 502) in a generator reading images, its reference and HF's greedy continuations
/// (greedy.json: `scripts/make_gemma4_vision_fixtures.py greedy`).
fn gemma4_vision_generator(variant: &str) -> (burn_gemma::Generator<NdArray>, serde_json::Value, serde_json::Value) {
    let dir = common::fixtures().join("tiny-gemma-vision").join(variant);
    let checkpoint = Checkpoint::open(&dir).unwrap();
    assert!(checkpoint.has_vision());
    let device = Default::default();
    let model = checkpoint.load(common::dense_f32::<NdArray>(&device)).unwrap().model;
    let mut g = burn_gemma::Generator::new(model, gemma4_tokenizer()).unwrap();
    let vision = checkpoint.load_vision_tower(common::dense_f32::<NdArray>(&device)).unwrap();
    assert!(matches!(vision, burn_gemma::Vision::Gemma4 { .. }));
    g.set_vision(Some(vision)).unwrap();
    (g, common::read_json(dir.join("reference.json")), common::read_json(dir.join("greedy.json")))
}

fn gemma4_tokenizer() -> burn_gemma::Tokenizer {
    tokenizer_with_specials(&[(500, "<|image|>"), (501, "<|image>"), (502, "<image|>")])
}

/// The fixture's patch grids as pictures.
fn gemma4_pictures(reference: &serde_json::Value) -> Vec<burn_gemma::Picture> {
    let images = reference["images"].as_array().unwrap();
    images
        .iter()
        .map(|i| {
            let (rows, cols) = (i["rows"].as_u64().unwrap() as usize, i["cols"].as_u64().unwrap() as usize);
            burn_gemma::images::PatchGrid { rows, cols, patch_size: 4, values: floats(&i["patches"]) }.into()
        })
        .collect()
}

/// The generator places each Gemma 4 picture (grids of different sizes: 6 and 1 soft tokens) at
/// its run of soft tokens: HF's greedy continuation of 8 tokens, for the dense and the E model
/// (per-layer inputs, KV sharing), with prompt chunks of every size.
#[test]
fn gemma4_generation_with_images_continues_as_hf() {
    for variant in ["gemma4", "gemma4-e"] {
        let (mut g, reference, greedy) = gemma4_vision_generator(variant);
        continues_as_hf(&mut g, &greedy, &gemma4_pictures(&reference), variant);
    }
}

/// `<|image|>` in a prompt expands as HF's `Gemma4Processor` does (`<|image>`, the picture's
/// soft tokens, `<image|>`), each picture as long as its grid pools to; generation gives what
/// the same ids give. Pictures that do not fit the tower are refused by name, and the
/// generator works after each refusal.
#[test]
fn gemma4_prompts_with_image_places_expand_as_gemma4_processor() {
    use burn_gemma::{images::ImageError, Error};
    let (mut g, reference, greedy) = gemma4_vision_generator("gemma4");
    let pictures = gemma4_pictures(&reference);
    let tokenizer = gemma4_tokenizer();
    let config = burn_gemma::GenerationConfig { max_new_tokens: 4, ..Default::default() };
    let out = g.generate_with_images("w300 <|image|> w301 <|image|>", &pictures, &config, |_| {}).unwrap();
    let text = format!("w300 <|image>{}<image|> w301 <|image><|image|><image|>", "<|image|>".repeat(6));
    let ids = tokenizer.encode(&text, burn_gemma::Bos::Prepend).unwrap();
    assert_eq!(ids.iter().filter(|&&t| t == 500).count(), 7, "{ids:?}");
    g.reset();
    let same = g.continue_ids_with_images(&ids, &pictures, &config, |_| {}).unwrap();
    assert_eq!(out.tokens, same.tokens);
    // No place: the pictures go first. Two places for one picture: refused.
    assert!(g.generate_with_images("w300", &pictures[..1], &config, |_| {}).is_ok());
    let err = g.generate_with_images("<|image|><|image|>", &pictures[..1], &config, |_| {}).unwrap_err();
    assert!(matches!(err, Error::Image(ImageError::Count { images: 1, places: 2 })), "{err}");
    // A run of soft tokens the length of the other picture's.
    let ids = common::ids(&greedy["prompts"][0]["input_ids"]);
    let err = g.continue_ids_with_images(&ids, &pictures[1..], &config, |_| {}).unwrap_err();
    assert!(err.to_string().contains("takes 1 soft tokens; the prompt has a run of 6"), "{err}");
    // Gemma 3's square picture; a grid that does not pool by 2; patches of another size.
    let square: burn_gemma::Picture = burn_gemma::images::Pixels { size: 56, values: vec![0.0; 3 * 56 * 56] }.into();
    let odd: burn_gemma::Picture =
        burn_gemma::images::PatchGrid { rows: 3, cols: 4, patch_size: 4, values: vec![0.5; 12 * 48] }.into();
    let wide: burn_gemma::Picture =
        burn_gemma::images::PatchGrid { rows: 2, cols: 2, patch_size: 8, values: vec![0.5; 4 * 192] }.into();
    for (picture, what) in [(square, "not square pictures"), (odd, "multiples of 2"), (wide, "8-pixel patches")] {
        let err = g.generate_with_images("w300", &[picture], &config, |_| {}).unwrap_err();
        assert!(matches!(&err, Error::Image(ImageError::VisionMismatch(m)) if m.contains(what)), "{err}");
    }
    g.reset();
    let ids = common::ids(&greedy["prompts"][1]["input_ids"]);
    let out = g.continue_ids_with_images(&ids, &pictures, &config, |_| {}).unwrap();
    assert_eq!(out.tokens, common::ids(&greedy["prompts"][1]["greedy_ids"])[..4]);
}

/// A picture from a file through the tower's own preparation ([`burn_gemma::Vision::read`]):
/// the fixture picture (37x23) sized within a budget of 24 soft tokens (HF's rule: 24 x 48
/// pixels, a 6 x 12 grid of 18 soft tokens) runs in a chat turn; within HF's default budget of
/// 280 its grid (26 x 42 patches) is past the tiny tower's 16 positions, and is refused by name.
#[test]
fn gemma4_pictures_from_files_run_in_a_chat() {
    use burn_gemma::{images::ImageError, Error};
    let dir = common::fixtures().join("tiny-gemma-vision/gemma4");
    let checkpoint = Checkpoint::open(&dir).unwrap();
    let device = Default::default();
    let model = checkpoint.load(common::dense_f32::<NdArray>(&device)).unwrap().model;
    let mut g = burn_gemma::Generator::new(model, gemma4_tokenizer()).unwrap();
    let tower = checkpoint.load_gemma4_vision(common::dense_f32::<NdArray>(&device)).unwrap();
    let path = common::fixtures().join("tiny-gemma-vision/gemma3/image.png");
    let config = burn_gemma::GenerationConfig { max_new_tokens: 3, ..Default::default() };
    // HF's default budget.
    let vision = burn_gemma::Vision::from(tower);
    let picture = vision.read(&path).unwrap();
    let burn_gemma::Picture::Patches(grid) = &picture else { panic!("a Gemma 4 tower prepares patch grids") };
    assert_eq!((grid.rows, grid.cols), (26, 42));
    let burn_gemma::Vision::Gemma4 { tower, budget } = vision else { panic!("a Gemma 4 tower") };
    assert_eq!(budget.max_soft_tokens, 280);
    g.set_vision(Some(burn_gemma::Vision::Gemma4 { tower, budget })).unwrap();
    let err = g.chat_with_images("w300 w301", &[picture], &config, |_| {}).unwrap_err();
    assert!(matches!(&err, Error::Image(ImageError::VisionMismatch(m)) if m.contains("16 positions")), "{err}");
    // A budget the tower's table holds.
    let Some(burn_gemma::Vision::Gemma4 { tower, .. }) = g.vision().cloned() else { panic!("a Gemma 4 tower") };
    let budget = burn_gemma::images::PatchBudget { max_soft_tokens: 24, ..budget };
    g.set_vision(Some(burn_gemma::Vision::Gemma4 { tower, budget })).unwrap();
    let vision = g.vision().unwrap();
    let picture = vision.read(&path).unwrap();
    assert_eq!(vision.soft_tokens(&picture).unwrap(), 18);
    let err = vision.read("/nonexistent/picture.png").unwrap_err();
    assert!(err.to_string().contains("/nonexistent/picture.png"), "{err}");
    let out = g.chat_with_images("w300 w301", &[picture], &config, |_| {}).unwrap();
    assert_eq!(out.tokens.len(), 3);
}

/// A fixture's model, its vision tower, its pictures and its prompts with HF's greedy tokens
/// (ids, picture count, greedy ids): Gemma 3's from reference.json, Gemma 4's from greedy.json.
#[allow(clippy::type_complexity)]
fn engine_fixture(
    fixture: &str,
) -> (burn_gemma::Gemma<NdArray>, burn_gemma::Vision<NdArray>, Vec<burn_gemma::Picture>, Vec<(Vec<u32>, usize, Vec<u32>)>)
{
    let dir = common::fixtures().join("tiny-gemma-vision").join(fixture);
    let checkpoint = Checkpoint::open(&dir).unwrap();
    let device = Default::default();
    let model = checkpoint.load(common::dense_f32::<NdArray>(&device)).unwrap().model;
    let vision = checkpoint.load_vision_tower(common::dense_f32::<NdArray>(&device)).unwrap();
    let reference = common::read_json(dir.join("reference.json"));
    let (pictures, greedy) = match fixture {
        "gemma3" => (fixture_pixels(&reference), reference.clone()),
        _ => (gemma4_pictures(&reference), common::read_json(dir.join("greedy.json"))),
    };
    let prompts = greedy["prompts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| (common::ids(&p["input_ids"]), p["images"].as_u64().unwrap() as usize, common::ids(&p["greedy_ids"])))
        .collect();
    (model, vision, pictures, prompts)
}

/// The engine reads pictures as the generator does, for Gemma 3 and Gemma 4 (dense and E):
/// every fixture prompt at once (prompt chunks of 3 and of 64, the prefix cache on) gives HF's
/// greedy tokens; the first prompt's ids with another picture in its place give the
/// generator's tokens for that picture (so no KV block was shared between prompts whose soft
/// tokens hold different pictures), and differ from the first picture's; pictures that do not
/// fit the prompt are refused at submit, and a text model's engine refuses pictures.
#[test]
fn engine_reads_pictures_as_the_generator() {
    use burn_gemma::engine::{Engine, EngineConfig, Event, Request};
    use burn_gemma::{images::ImageError, Error};
    for fixture in ["gemma3", "gemma4", "gemma4-e"] {
        let (model, vision, pictures, prompts) = engine_fixture(fixture);
        // The first picture with its values reversed: the same grid, another picture.
        let other = match &pictures[0] {
            burn_gemma::Picture::Square(p) => {
                burn_gemma::images::Pixels { size: p.size, values: p.values.iter().rev().copied().collect() }.into()
            }
            burn_gemma::Picture::Patches(p) => {
                burn_gemma::images::PatchGrid { values: p.values.iter().rev().copied().collect(), ..p.clone() }.into()
            }
            burn_gemma::Picture::Crops { .. } => panic!("the fixtures' pictures have no crops"),
        };
        let (first_ids, _, first_want) = prompts[0].clone();
        let other_want = {
            let (model, vision, _, _) = engine_fixture(fixture);
            let mut g = burn_gemma::Generator::new(model, common::tiny_tokenizer()).unwrap();
            g.set_vision(Some(vision)).unwrap();
            let config = burn_gemma::GenerationConfig { max_new_tokens: first_want.len(), ..Default::default() };
            g.continue_ids_with_images(&first_ids, std::slice::from_ref(&other), &config, |_| {}).unwrap().tokens
        };
        assert_ne!(other_want, first_want, "{fixture}: the other picture changes nothing");
        let config = EngineConfig {
            max_running: std::num::NonZeroUsize::new(3).unwrap(),
            prefix_cache: burn_gemma::PrefixCache::On,
            kv_block_size: std::num::NonZeroUsize::new(4).unwrap(),
            ..EngineConfig::default()
        };
        let engine = Engine::with_vision(model, Some(vision), common::tiny_tokenizer(), config).unwrap();
        let request = |ids: &[u32], images: Vec<burn_gemma::Picture>, new: usize, chunk: usize| Request {
            images,
            ..Request::new(
                ids.to_vec(),
                burn_gemma::GenerationConfig {
                    max_new_tokens: new,
                    prefill_chunk: std::num::NonZeroUsize::new(chunk).unwrap(),
                    ..Default::default()
                },
            )
        };
        let mut cases = Vec::new();
        for (ids, n, want) in &prompts {
            for chunk in [3, 64] {
                cases.push((request(ids, pictures[..*n].to_vec(), want.len(), chunk), want.clone()));
            }
        }
        cases.push((request(&first_ids, vec![other.clone()], first_want.len(), 64), other_want));
        cases.push((request(&first_ids, vec![pictures[0].clone()], first_want.len(), 64), first_want.clone()));
        let streams: Vec<_> = cases.iter().map(|(r, _)| engine.submit(r.clone()).unwrap()).collect();
        for (i, (stream, (_, want))) in streams.into_iter().zip(&cases).enumerate() {
            let mut got = Vec::new();
            for event in stream {
                match event.unwrap() {
                    Event::Token(t) => got.push(t.id),
                    Event::Done(_) => break,
                }
            }
            assert_eq!(&got, want, "{fixture}: request {i}");
        }
        // Two places, one picture; a picture of the other generation.
        let two = prompts.iter().find(|p| p.1 == 2).unwrap();
        let err = engine.submit(request(&two.0, pictures[..1].to_vec(), 2, 64)).unwrap_err();
        assert!(matches!(err, Error::Image(ImageError::Count { images: 1, places: 2 })));
        let wrong: burn_gemma::Picture = match &pictures[0] {
            burn_gemma::Picture::Square(_) => {
                burn_gemma::images::PatchGrid { rows: 2, cols: 2, patch_size: 4, values: vec![0.5; 192] }.into()
            }
            burn_gemma::Picture::Patches(_) => burn_gemma::images::Pixels { size: 4, values: vec![0.0; 48] }.into(),
            burn_gemma::Picture::Crops { .. } => panic!("the fixtures' pictures have no crops"),
        };
        let err = engine.submit(request(&first_ids, vec![wrong], 2, 64)).unwrap_err();
        assert!(matches!(&err, Error::Image(ImageError::VisionMismatch(_))), "{err}");
        engine.shutdown();
    }
    // A text model's engine.
    let dir = common::fixtures().join("tiny-gemma-vision/gemma3");
    let model = Checkpoint::open(&dir).unwrap().load(common::dense_f32::<NdArray>(&Default::default())).unwrap().model;
    let engine = Engine::new(model, common::tiny_tokenizer(), EngineConfig::default()).unwrap();
    assert!(engine.image_processor().is_none());
    let (_, _, pictures, prompts) = engine_fixture("gemma3");
    let mut request = Request::new(prompts[0].0.clone(), burn_gemma::GenerationConfig::default());
    request.images = pictures[..1].to_vec();
    let err = engine.submit(request).unwrap_err();
    assert!(matches!(err, Error::Image(ImageError::NoVision)), "{err}");
}

/// A multimodal fixture served: its model, its tower (Gemma 4's within a budget of 24 soft
/// tokens, which the tiny tower's 16 positions hold), its tokenizer with the image tokens.
#[cfg(feature = "server")]
fn served_fixture(fixture: &str) -> (burn_gemma::Gemma<NdArray>, burn_gemma::Vision<NdArray>, burn_gemma::Tokenizer) {
    let dir = common::fixtures().join("tiny-gemma-vision").join(fixture);
    let checkpoint = Checkpoint::open(&dir).unwrap();
    let device = Default::default();
    let model = checkpoint.load(common::dense_f32::<NdArray>(&device)).unwrap().model;
    let vision = match checkpoint.load_vision_tower(common::dense_f32::<NdArray>(&device)).unwrap() {
        burn_gemma::Vision::Gemma4 { tower, budget } => burn_gemma::Vision::Gemma4 {
            tower,
            budget: burn_gemma::images::PatchBudget { max_soft_tokens: 24, ..budget },
        },
        gemma3 => gemma3,
    };
    let tokenizer = match fixture {
        "gemma3" => tokenizer_with_image_tokens(),
        _ => gemma4_tokenizer(),
    };
    (model, vision, tokenizer)
}

/// The server reads pictures in chat messages (`image_url` parts with `data:` URLs) for Gemma 3
/// and Gemma 4: the answer is the generator's for the same turn and picture (read from the
/// file), streamed or not; pictures that are not data URLs, bad base64, damaged pictures,
/// pictures in an assistant's message and pictures for a text model get a 400 naming the part.
#[cfg(feature = "server")]
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn server_reads_pictures_in_chat_messages() {
    use base64::Engine as _;
    use burn_gemma::{
        chat::ChatTemplate,
        engine::{Engine, EngineConfig},
        server::{Server, ServerConfig},
    };
    use serde_json::{json, Value};
    let path = common::fixtures().join("tiny-gemma-vision/gemma3/image.png");
    let png = std::fs::read(&path).unwrap();
    let url = format!("data:image/png;base64,{}", base64::engine::general_purpose::STANDARD.encode(&png));
    let serve = |engine: Engine| async move {
        let config = ServerConfig { default_max_tokens: 4, ..ServerConfig::new("tiny") };
        let server = Server::new(engine, config).expect("server");
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let base = format!("http://{}", listener.local_addr().unwrap());
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(async move {
            server
                .serve(listener, async move {
                    let _ = stopped.await;
                })
                .await
        });
        (base, stop, task)
    };
    let post = |base: String, body: Value| async move {
        let response =
            reqwest::Client::new().post(format!("{base}/v1/chat/completions")).json(&body).send().await.unwrap();
        (response.status().as_u16(), response.text().await.unwrap())
    };
    for (fixture, template) in [("gemma3", ChatTemplate::Gemma), ("gemma4", ChatTemplate::Gemma4)] {
        let (model, vision, tokenizer) = served_fixture(fixture);
        let place = vision.processor().placeholder();
        let expected = {
            let (model, vision, tokenizer) = served_fixture(fixture);
            let picture = vision.read(&path).unwrap();
            let mut g = burn_gemma::Generator::new(model, tokenizer).unwrap();
            g.set_vision(Some(vision)).unwrap();
            let config = burn_gemma::GenerationConfig { max_new_tokens: 4, ..Default::default() };
            let turn = template.user_turn(&format!("w300 {place} w301"));
            g.generate_with_images(&turn, &[picture], &config, |_| {}).unwrap()
        };
        assert_eq!(expected.tokens.len(), 4, "{fixture}: {:?}", expected.stop);
        let engine = Engine::with_vision(model, Some(vision), tokenizer, EngineConfig::default()).unwrap();
        let (base, stop, task) = serve(engine).await;
        let parts = |url: &str| {
            json!([
                { "type": "text", "text": "w300 " },
                { "type": "image_url", "image_url": { "url": url } },
                { "type": "text", "text": " w301" },
            ])
        };
        let body =
            json!({ "messages": [{ "role": "user", "content": parts(&url) }], "max_tokens": 4, "temperature": 0 });
        let (status, text) = post(base.clone(), body.clone()).await;
        assert_eq!(status, 200, "{fixture}: {text}");
        let answer: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(answer["choices"][0]["message"]["content"], expected.text.as_str(), "{fixture}");
        let mut streaming = body.clone();
        streaming["stream"] = json!(true);
        let (status, text) = post(base.clone(), streaming).await;
        assert_eq!(status, 200);
        let streamed: String = text
            .lines()
            .filter_map(|l| l.strip_prefix("data: "))
            .filter(|d| *d != "[DONE]")
            .filter_map(|d| serde_json::from_str::<Value>(d).ok())
            .filter_map(|v| v["choices"][0]["delta"]["content"].as_str().map(str::to_string))
            .collect();
        assert_eq!(streamed, expected.text, "{fixture}: streamed");
        let truncated = format!(
            "data:image/png;base64,{}",
            base64::engine::general_purpose::STANDARD.encode(&png[..png.len() / 2])
        );
        let assistant_picture = json!([
            { "role": "user", "content": "w300" },
            { "role": "assistant", "content": parts(&url) },
            { "role": "user", "content": "w301" },
        ]);
        for (messages, what) in [
            (json!([{ "role": "user", "content": parts("https://example.com/cat.png") }]), "not a data URL"),
            (json!([{ "role": "user", "content": parts("data:image/png;base64,@@@") }]), "base64"),
            (json!([{ "role": "user", "content": parts("data:image/png,rawbytes") }]), "not base64"),
            (json!([{ "role": "user", "content": parts(&truncated) }]), "cannot decode"),
            (assistant_picture, "pictures go in user messages"),
        ] {
            let (status, text) = post(base.clone(), json!({ "messages": messages, "max_tokens": 2 })).await;
            assert_eq!(status, 400, "{fixture}, {what}: {text}");
            let error: Value = serde_json::from_str(&text).unwrap();
            let message = error["error"]["message"].as_str().unwrap();
            assert!(message.contains(what) && message.contains("image_url"), "{fixture}, {what}: {message}");
            assert_eq!(error["error"]["param"], "messages");
        }
        // It serves on.
        let (status, _) = post(base.clone(), body).await;
        assert_eq!(status, 200);
        let _ = stop.send(());
        assert!(matches!(task.await, Ok(Ok(()))));
    }
    // A text model refuses pictures.
    let (model, _, tokenizer) = served_fixture("gemma3");
    let engine = Engine::new(model, tokenizer, EngineConfig::default()).unwrap();
    let (base, stop, task) = serve(engine).await;
    let body =
        json!({ "messages": [{ "role": "user", "content": [{ "type": "image_url", "image_url": { "url": url } }] }] });
    let (status, text) = post(base, body).await;
    assert_eq!(status, 400, "{text}");
    assert!(text.contains("reads no images"), "{text}");
    let _ = stop.send(());
    assert!(matches!(task.await, Ok(Ok(()))));
}
