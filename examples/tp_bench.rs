//! Tensor-parallel prefill and decode on several CUDA devices of one host (issue 37): the model
//! split over 1, 2, 4 ... devices in turn, NCCL's collectives between them, each device's shard
//! on a thread of its own (`burn_gemma::tensor_parallel::ShardedModel`); the prompt runs
//! eagerly, and each decode step replays one CUDA graph per device with the collectives inside
//! (`--cuda-graph off`: eager steps).
//!
//! ```text
//! cargo run --release --features cuda,tools --example tp_bench -- \
//!     --model synthetic:gemma4-31b --tensor-parallel 1,2 --dtype bf16 --weights bf16 --prompt-len 512 --gen 128
//! ```
//!
//! Each split loads, prefills `--prompt-len` tokens (to the first greedy token, read back) and
//! decodes `--gen` greedy tokens (each read back: the devices are synchronized every token);
//! medians over `--reps` after a warm-up rep. The first split's prompt logits and tokens are the
//! reference the others' are compared with (a random-weight `synthetic:` model is the same on
//! every split: its shards draw the unsplit model's weights).

#[path = "cli/backend_args.rs"]
mod backend_args;

use backend_args::BackendArgs;
use burn::backend::cuda::CudaDevice;
use burn_gemma::{
    backends::Cuda,
    tensor_parallel::{nccl::NcclAllReduce, ShardedModel},
    Checkpoint, CudaGraph, GemmaConfig, LoadOptions, ModelOptions,
};
use burn_gemma_model::RandomWeights;
use clap::Parser;
use std::time::Instant;

type CliError = Box<dyn std::error::Error>;

#[derive(Parser)]
struct Args {
    /// GGUF file, HF directory, or synthetic:<preset> (random weights, see `GemmaConfig::PRESETS`).
    #[arg(long)]
    model: String,
    #[command(flatten)]
    backend: BackendArgs,
    /// Device counts measured in turn, comma-separated (devices 0..N of the host).
    #[arg(long, value_delimiter = ',', default_value = "1,2")]
    tensor_parallel: Vec<usize>,
    #[arg(long, default_value_t = 512)]
    prompt_len: usize,
    #[arg(long, default_value_t = 128)]
    gen: usize,
    #[arg(long, default_value_t = 3)]
    reps: usize,
    /// A synthetic model's first N layers only (the preset's shapes, fewer of them): a split
    /// small enough to compare in f32 with one device.
    #[arg(long)]
    layers: Option<usize>,
    /// Writes each split's prompt logits (the fresh caches', little-endian f32) to
    /// `<prefix>-<N>gpu.f32`, to be set beside another run's (another dtype, say).
    #[arg(long)]
    save_logits: Option<String>,
    /// Seed of synthetic weights and of the prompt's ids.
    #[arg(long, default_value_t = 7)]
    seed: u64,
    /// auto | on | off: decode steps replayed as one CUDA graph per device (`auto`: eager where
    /// a step cannot be recorded, saying why).
    #[arg(long, default_value = "auto")]
    cuda_graph: CudaGraph,
}

/// The synthetic preset's config, cut to `--layers`.
fn synthetic_config(preset: &str, layers: Option<usize>) -> Result<GemmaConfig, CliError> {
    let mut config = GemmaConfig::preset(preset)?;
    if let Some(n) = layers {
        if n == 0 || n > config.num_hidden_layers {
            return Err(format!("--layers {n}: {preset} has 1 to {} layers", config.num_hidden_layers).into());
        }
        config.num_hidden_layers = n;
        config.layer_types.truncate(n);
        // A cut that leaves the preset inconsistent (Gemma 4 E models' KV-sharing layers) says so.
        config.validate()?;
    }
    Ok(config)
}

/// The split model over `devices`.
fn load(args: &Args, devices: &[CudaDevice]) -> Result<ShardedModel<Cuda>, CliError> {
    let (weights, dtype, kv_cache) = args.backend.formats("cuda")?;
    let Some(preset) = args.model.strip_prefix("synthetic:") else {
        let checkpoint = Checkpoint::open(&args.model)?;
        let options =
            |d: &CudaDevice| LoadOptions::new().device(d.clone()).dtype(dtype).weights(weights).kv_cache(kv_cache);
        return Ok(ShardedModel::load_nccl(&checkpoint, devices, options)?);
    };
    let options = ModelOptions { dtype, weights, kv_cache: Some(kv_cache) };
    let reduces = if devices.len() > 1 { NcclAllReduce::group(devices)? } else { Vec::new() };
    // Each shard draws the whole model's weights from the seed and keeps its part.
    let source = || RandomWeights::new(args.seed);
    Ok(ShardedModel::load_from(synthetic_config(preset, args.layers)?, source, &options, devices, reduces)?)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() -> Result<(), CliError> {
    let args = Args::parse();
    let kind = args.backend.check()?;
    if !matches!(kind, burn_gemma::backends::BackendKind::Cuda | burn_gemma::backends::BackendKind::Auto) {
        return Err(format!("tp_bench runs on CUDA devices (NCCL), not {}", args.backend.backend).into());
    }
    args.backend.start_threads()?;
    let config = match args.model.strip_prefix("synthetic:") {
        Some(preset) => synthetic_config(preset, args.layers)?,
        None if args.layers.is_some() => return Err("--layers cuts synthetic models only".into()),
        None => Checkpoint::open(&args.model)?.config().clone(),
    };
    let vocab = config.vocab_size as u64;
    let mut state = args.seed | 1;
    let prompt: Vec<u32> = (0..args.prompt_len.max(1))
        .map(|i| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            if i == 0 {
                2
            } else {
                (4 + state % (vocab - 4)) as u32
            }
        })
        .collect();
    let mut reference: Option<(Vec<f32>, Vec<u32>)> = None;
    for &world in &args.tensor_parallel {
        let devices: Vec<CudaDevice> = (0..world).map(CudaDevice::new).collect();
        let started = Instant::now();
        let mut model = load(&args, &devices)?;
        eprintln!("{world} device(s): loaded in {:.1} s", started.elapsed().as_secs_f64());
        model.set_cuda_graph(args.cuda_graph)?;
        // The prompt's last logits on fresh caches, before any step was recorded or replayed.
        model.new_cache(prompt.len() + args.gen + 1)?;
        let logits = model.logits(&prompt)?;
        if let Some(prefix) = &args.save_logits {
            let bytes: Vec<u8> = logits.iter().flat_map(|v| v.to_le_bytes()).collect();
            std::fs::write(format!("{prefix}-{world}gpu.f32"), bytes)?;
        }
        let (mut prefill, mut decode) = (Vec::new(), Vec::new());
        let mut again = Vec::new();
        let mut tokens = Vec::new();
        for rep in 0..=args.reps {
            model.new_cache(prompt.len() + args.gen + 1)?;
            let t = Instant::now();
            let mut next = model.greedy(&prompt)?;
            let pp = t.elapsed().as_secs_f64();
            let t = Instant::now();
            let mut generated = vec![next];
            for _ in 1..args.gen {
                next = model.greedy(&[next])?;
                generated.push(next);
            }
            let tg = t.elapsed().as_secs_f64();
            if rep > 0 {
                prefill.push(prompt.len() as f64 / pp);
                decode.push((args.gen.max(2) - 1) as f64 / tg);
            } else {
                tokens = generated;
                // The same size: the caches are emptied in place and the recorded steps kept;
                // the prompt's logits then must be the fresh caches' again.
                model.new_cache(prompt.len() + args.gen + 1)?;
                again = model.logits(&prompt)?;
            }
        }
        let (pp, tg) = (median(prefill), median(decode));
        let steps = match (args.cuda_graph, model.eager_reason()) {
            (CudaGraph::Off, _) => "eager".to_string(),
            (_, Some(why)) => format!("eager ({why})"),
            _ => "graphs".to_string(),
        };
        let largest_diff = |a: &[f32], b: &[f32]| a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0f32, f32::max);
        let reused = largest_diff(&logits, &again);
        let parity = match &reference {
            None => {
                // How far the best logit stands above the second: a split whose logits move by
                // more may pick another first token without being wrong.
                let mut sorted = logits.clone();
                sorted.sort_by(|a, b| b.total_cmp(a));
                let margin = sorted.first().zip(sorted.get(1)).map_or(0.0, |(a, b)| a - b);
                format!("reference (top-2 margin {margin:.4})")
            }
            Some((ref_logits, ref_tokens)) => {
                let diff = largest_diff(ref_logits, &logits);
                let scale = ref_logits.iter().fold(0.0f32, |m, v| m.max(v.abs()));
                let same = ref_tokens.iter().zip(&tokens).take_while(|(a, b)| a == b).count();
                format!("prompt logits {diff:.4} from the first split's (largest {scale:.2}); first {same} of {} greedy tokens equal", tokens.len())
            }
        };
        println!(
            "{}{} | {world} GPU(s) | pp{} {pp:.1} tok/s | tg{} {tg:.2} tok/s ({:.2} ms/token, {steps}) | {parity} | after a rep's steps {reused:.4}",
            args.model,
            args.layers.map_or(String::new(), |n| format!(" ({n} layers)")),
            prompt.len(),
            args.gen,
            1e3 / tg
        );
        if reference.is_none() {
            reference = Some((logits, tokens));
        }
    }
    Ok(())
}
