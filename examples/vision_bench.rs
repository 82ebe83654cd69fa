//! Time of pictures through a vision tower (Gemma 3's SigLIP tower and projector, or Gemma 4's
//! tower and embedder), and with `--text PRESET` the time to first token of a prompt with them:
//! the tower, then the prompt's prefill (the soft tokens and 16 text tokens) to the first token's
//! logits on the host.
//!
//! ```text
//! cargo run --release --features tools --example vision_bench -- --backend candle --reps 3
//! cargo run --release --features cuda,tools --example vision_bench -- --backend cuda --dtype bf16 --images 4
//! cargo run --release --features cuda,tools --example vision_bench -- --backend cuda --dtype bf16 --text gemma3-4b
//! cargo run --release --features cuda,tools --example vision_bench -- --backend cuda --dtype bf16 --generation gemma4 --text gemma4-e4b
//! ```
//!
//! `--model` is a multimodal Gemma 3 HF directory; without it, random weights in a published
//! shape: Gemma 3 4B-27B's tower (SigLIP so400m: 27 layers of 1152, 16 heads, 896x896 pictures
//! in 14x14 patches, 256 soft tokens of 2560), or Gemma 4's (HF's defaults, those of E2B and
//! E4B: 16 layers of 768, 16-pixel patches pooled 3x3; an 896x896 picture within the default
//! budget of 280 soft tokens is 768x768 pixels, 48x48 patches, 256 soft tokens). Medians, minima
//! and maxima over the reps follow a warm-up rep; each rep reads its result back (the device is
//! synchronized).

#[path = "cli/backend_args.rs"]
mod backend_args;

use backend_args::BackendArgs;
use burn::tensor::Tensor;
use burn_gemma::{
    backends::{dispatch, BackendTask},
    generation::token_tensor,
    images::{PatchGrid, Pixels},
    Checkpoint, Gemma, Gemma3Vision, Gemma3VisionConfig, Gemma4ImageConfig, Gemma4Vision, GemmaBackend, GemmaConfig,
    ImageEmbeds, LoadOptions, ModelOptions, Picture, Vision,
};
use burn_gemma_model::{
    vision::{Gemma4VisionConfig, SiglipConfig},
    RandomWeights,
};
use clap::Parser;
use std::{path::PathBuf, time::Instant};

type CliError = Box<dyn std::error::Error>;

#[derive(Parser, Clone)]
struct Args {
    /// A multimodal Gemma 3 HF directory (default: random weights in Gemma 3 4B's shape).
    #[arg(long)]
    model: Option<PathBuf>,
    /// Pictures per call.
    #[arg(long, default_value_t = 1)]
    images: usize,
    /// The tower of random weights without --model: gemma3 or gemma4.
    #[arg(long, default_value = "gemma3")]
    generation: String,
    /// Also the time to first token with a random text model of this preset (e.g. gemma3-4b,
    /// gemma4-e4b; its hidden size is the tower's output).
    #[arg(long)]
    text: Option<String>,
    #[arg(long, default_value_t = 3)]
    reps: usize,
    #[command(flatten)]
    backend: BackendArgs,
}

/// Gemma 3 4B-27B's vision config (their `config.json`s: `vision_config`, 256 soft tokens).
fn gemma3_4b_vision() -> Gemma3VisionConfig {
    Gemma3VisionConfig {
        vision: SiglipConfig {
            hidden_size: 1152,
            intermediate_size: 4304,
            num_hidden_layers: 27,
            num_attention_heads: 16,
            num_channels: 3,
            image_size: 896,
            patch_size: 14,
            layer_norm_eps: 1e-6,
            hidden_act: "gelu_pytorch_tanh".into(),
            vision_use_head: false,
        },
        mm_tokens_per_image: 256,
        image_token_index: 262_144,
        boi_token_index: 255_999,
        eoi_token_index: 256_000,
        text_hidden_size: 2560,
    }
}

/// Gemma 4's tower in HF's default shape, projecting to `text_hidden_size`, with HF's
/// image-token ids.
fn gemma4_vision(text_hidden_size: usize) -> Gemma4ImageConfig {
    Gemma4ImageConfig {
        vision: Gemma4VisionConfig::default(),
        image_token_id: 258_880,
        boi_token_id: 255_999,
        eoi_token_id: 258_882,
        text_hidden_size,
    }
}

/// Median, minimum and maximum of `times` (seconds), sorted here.
fn spread(times: &mut [f64]) -> (f64, f64, f64) {
    times.sort_by(f64::total_cmp);
    (times[times.len() / 2], times[0], times[times.len() - 1])
}

struct Bench(Args);

impl BackendTask for Bench {
    type Output = Result<(), CliError>;

    fn run<B: GemmaBackend>(self, device: B::Device, name: &str) -> Result<(), CliError> {
        let a = self.0;
        if a.images == 0 || a.reps == 0 {
            return Err(CliError::from("--images and --reps must be at least 1"));
        }
        let (weights, dtype, kv_cache) = a.backend.formats(name)?;
        let mut text_config = a.text.as_deref().map(GemmaConfig::preset).transpose()?;
        if let Some(c) = text_config.as_mut().filter(|_| a.generation == "gemma3") {
            // Gemma 3 4B-27B's vocabulary holds the image tokens (262,208 ids; the presets
            // carry the text models' 262,144).
            c.vocab_size = c.vocab_size.max(262_208);
        }
        let text_hidden = text_config.as_ref().map_or(2560, |c| c.hidden_size);
        let options = ModelOptions { dtype, weights, kv_cache: None };
        let vision: Vision<B> = match (&a.model, a.generation.as_str()) {
            (Some(path), _) => Checkpoint::open(path)?
                .load_vision_tower(LoadOptions::<B>::new().device(device.clone()).dtype(dtype).weights(weights))?,
            (None, "gemma3") => {
                let config = Gemma3VisionConfig { text_hidden_size: text_hidden, ..gemma3_4b_vision() };
                Gemma3Vision::load(config, &mut RandomWeights::new(7), &options, &device)?.into()
            }
            (None, "gemma4") => {
                Gemma4Vision::load(gemma4_vision(text_hidden), &mut RandomWeights::new(7), &options, &device)?.into()
            }
            (None, other) => return Err(CliError::from(format!("--generation {other}: gemma3 or gemma4"))),
        };
        // Random pictures of 896x896, prepared as the tower's processor prepares them.
        let mut seed = 0x5eed_u64;
        let mut noise = |n: usize| -> Vec<u8> {
            (0..n)
                .map(|_| {
                    seed = seed.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
                    (seed >> 56) as u8
                })
                .collect()
        };
        let pictures: Vec<Picture> = (0..a.images)
            .map(|_| {
                let rgb = image::RgbImage::from_raw(896, 896, noise(896 * 896 * 3)).ok_or("a picture of 896x896")?;
                Ok(vision.processor().prepare(&image::DynamicImage::ImageRgb8(rgb))?)
            })
            .collect::<Result<_, CliError>>()?;
        let soft = vision.soft_tokens(&pictures[0])?;
        let shape = match &pictures[0] {
            Picture::Square(Pixels { size, .. }) => format!("{size}x{size} pixels"),
            Picture::Crops { whole, crops } => format!("{0}x{0} pixels and {1} crops", whole.size, crops.len()),
            Picture::Patches(PatchGrid { rows, cols, patch_size, .. }) => {
                format!("{rows}x{cols} patches of {patch_size} pixels")
            }
        };
        eprintln!(
            "backend: {name}, dtype: {dtype:?}, {} pictures per call ({shape}, {soft} soft tokens each)",
            a.images
        );
        let mut times = Vec::new();
        for rep in 0..=a.reps {
            let start = Instant::now();
            let features = vision.features(&pictures, &device)?;
            let features = Tensor::cat(features, 0);
            let values = features.into_data().convert::<f32>().to_vec::<f32>().map_err(|e| format!("{e:?}"))?;
            if values.iter().any(|v| !v.is_finite()) {
                return Err(CliError::from("non-finite image features"));
            }
            if rep > 0 {
                times.push(start.elapsed().as_secs_f64());
            }
        }
        let (median, min, max) = spread(&mut times);
        println!(
            "vision tower: median {median:.4} s per call ({:.4} s per picture), min {min:.4}, max {max:.4}, {} reps",
            median / a.images as f64,
            times.len()
        );
        let Some(config) = text_config else { return Ok(()) };
        // The prompt: BOS, then each picture as its processor places it, then 16 text tokens.
        let tokens = vision.processor().tokens();
        let mut ids = vec![2u32];
        for _ in 0..a.images {
            ids.push(tokens.begin);
            ids.extend(std::iter::repeat_n(tokens.soft, soft));
            ids.push(tokens.end);
        }
        ids.extend((0..16).map(|i| 1000 + i));
        let options = ModelOptions { dtype, weights, kv_cache: Some(kv_cache) };
        let model = Gemma::<B>::load(config, &mut RandomWeights::new(11), &options, &device)?;
        let mut times = Vec::new();
        for rep in 0..=a.reps {
            let start = Instant::now();
            let images: Vec<ImageEmbeds<B>> = vision.embeds(&ids, &pictures, &device)?;
            let mut cache = model.new_cache(1, ids.len() + 1)?;
            let hidden = model.forward_hidden_with_images(token_tensor::<B>(&ids, &device), &images, &mut cache)?;
            let [batch, seq, width] = hidden.dims();
            let logits = model.logits(hidden.slice([0..batch, seq - 1..seq, 0..width]))?;
            let first = logits.argmax(2).into_data().convert::<i64>().to_vec::<i64>().map_err(|e| format!("{e:?}"))?;
            if rep > 0 {
                times.push(start.elapsed().as_secs_f64());
            }
            if first.is_empty() {
                return Err(CliError::from("no first token"));
            }
        }
        let (median, min, max) = spread(&mut times);
        println!(
            "time to first token, {} ({} prompt tokens, {} pictures): median {median:.4} s, min {min:.4}, max {max:.4}, \
             {} reps",
            a.text.as_deref().unwrap_or_default(),
            ids.len(),
            a.images,
            times.len()
        );
        Ok(())
    }
}

fn main() -> Result<(), CliError> {
    let args = Args::parse();
    let kind = args.backend.check()?;
    args.backend.start_threads()?;
    dispatch(kind, Bench(args.clone()), &mut |note| eprintln!("{note}"))?
}
