//! Time of pictures through Gemma 3's vision tower and projector (what a prompt with images
//! adds to the time to first token, before the soft tokens' prefill).
//!
//! ```text
//! cargo run --release --features tools --example vision_bench -- --backend candle --reps 3
//! cargo run --release --features cuda,tools --example vision_bench -- --backend cuda --dtype bf16 --images 4
//! ```
//!
//! `--model` is a multimodal Gemma 3 HF directory; without it, random weights in the published
//! shape of Gemma 3 4B-27B's tower (SigLIP so400m: 27 layers of 1152, 16 heads, 896x896 pictures
//! in 14x14 patches, 256 soft tokens of 2560). Medians, minima and maxima over the reps follow a
//! warm-up rep; each rep reads the features back (the device is synchronized).

#[path = "cli/backend_args.rs"]
mod backend_args;

use backend_args::BackendArgs;
use burn::tensor::{Distribution, Tensor};
use burn_gemma::{
    backends::{dispatch, BackendTask},
    Checkpoint, Gemma3Vision, Gemma3VisionConfig, GemmaBackend, LoadOptions, ModelOptions,
};
use burn_gemma_model::{vision::SiglipConfig, RandomWeights};
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

struct Bench(Args);

impl BackendTask for Bench {
    type Output = Result<(), CliError>;

    fn run<B: GemmaBackend>(self, device: B::Device, name: &str) -> Result<(), CliError> {
        let a = self.0;
        if a.images == 0 || a.reps == 0 {
            return Err(CliError::from("--images and --reps must be at least 1"));
        }
        let (weights, dtype, _) = a.backend.formats(name)?;
        let vision: Gemma3Vision<B> = match &a.model {
            Some(path) => Checkpoint::open(path)?
                .load_vision(LoadOptions::<B>::new().device(device.clone()).dtype(dtype).weights(weights))?,
            None => {
                let options = ModelOptions { dtype, weights, kv_cache: None };
                Gemma3Vision::load(gemma3_4b_vision(), &mut RandomWeights::new(7), &options, &device)?
            }
        };
        let size = vision.config().vision.image_size;
        eprintln!("backend: {name}, dtype: {dtype:?}, {} pictures of {size}x{size} per call", a.images);
        let pixels = Tensor::<B, 4>::random([a.images, 3, size, size], Distribution::Uniform(-1.0, 1.0), &device);
        let mut times = Vec::new();
        for rep in 0..=a.reps {
            let start = Instant::now();
            let features = vision.image_features(pixels.clone())?;
            let values = features.into_data().convert::<f32>().to_vec::<f32>().map_err(|e| format!("{e:?}"))?;
            if values.iter().any(|v| !v.is_finite()) {
                return Err(CliError::from("non-finite image features"));
            }
            if rep > 0 {
                times.push(start.elapsed().as_secs_f64());
            }
        }
        times.sort_by(f64::total_cmp);
        let median = times[times.len() / 2];
        println!(
            "vision tower + projector: median {:.3} s per call ({:.3} s per picture), min {:.3}, max {:.3}, {} reps",
            median,
            median / a.images as f64,
            times[0],
            times[times.len() - 1],
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
