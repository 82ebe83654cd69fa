//! Prefill and decode speed of a Gemma model on one backend, llama-bench style.
//!
//! ```text
//! cargo run --release --features cuda,tools --example bench -- \
//!     --model synthetic:gemma3-1b --backend cuda --dtype bf16 --prompt-len 512 --gen 128 --depth 0 --reps 5
//! ```
//!
//! `--model` is a GGUF file, an HF directory, or `synthetic:<preset>` (random weights built on
//! the device from a seed in the published shapes: gemma3-270m, gemma3-1b, gemma3-4b,
//! gemma3-12b). Each rep fills `--depth` tokens of context (untimed), then times a prefill of
//! `--prompt-len` tokens (to the first sampled token: time to first token) and, after refilling
//! the same context, `--gen` greedy decode steps (each sampled on the device, its id read back:
//! the device is synchronized every token). Medians, minima and maxima over the reps follow a
//! warm-up rep.

use burn::tensor::{Int, Tensor};
#[path = "cli/backend_args.rs"]
mod backend_args;

use backend_args::BackendArgs;
use burn_gemma::{
    backends::{dispatch, parse_kv_cache, resident_bytes, BackendTask},
    generation::token_tensor,
    Checkpoint, Gemma, GemmaBackend, GemmaConfig, KvCache, LoadOptions, ModelOptions,
};
use burn_gemma_kernels::{
    attention::PrefillAttention, graph::GraphError, tuning::BlasOrdering, Draws, KernelTuning, SamplingParams,
};
use burn_gemma_model::{CudaGraph, DecodeGraphs, KvFormat, ModelError, RandomWeights};
use clap::Parser;
use std::num::NonZeroUsize;
use std::time::{Duration, Instant};

/// The program's errors: the library's, or a message about its command line.
type CliError = Box<dyn std::error::Error>;

/// `--cublaslt-order`.
#[derive(Debug, Clone, Copy, clap::ValueEnum)]
enum CublasOrder {
    Device,
    Host,
}

/// `--prefill-attention` (`burn_gemma_kernels::attention::PrefillAttention`).
#[derive(Debug, Clone, Copy, clap::ValueEnum)]
enum PromptAttention {
    Auto,
    Flash,
    Blocked,
    Tiled,
}

#[derive(Parser, Clone)]
struct Args {
    /// GGUF file, HF directory, `default` (the default model, fetched once), or
    /// synthetic:<preset> (see `GemmaConfig::PRESETS`).
    #[arg(long)]
    model: String,
    #[command(flatten)]
    backend: BackendArgs,
    /// Prompt lengths, comma-separated: each is measured in turn on the one loaded model (as
    /// llama-bench's `-p 512,4096`), one report and one JSON line per length.
    #[arg(long, value_delimiter = ',', default_value = "512")]
    prompt_len: Vec<usize>,
    /// Most prompt tokens per forward pass (as `generate --prefill-chunk`).
    #[arg(long, default_value_t = burn_gemma::DEFAULT_PREFILL_CHUNK)]
    prefill_chunk: std::num::NonZeroUsize,
    #[arg(long, default_value_t = 128)]
    gen: usize,
    /// Context already in the cache before the timed prefill and decode, comma-separated: each
    /// is measured in turn on the one loaded model (as llama-bench's `-d 512,8192`).
    #[arg(long, value_delimiter = ',', default_value = "0")]
    depth: Vec<usize>,
    /// KV-cache formats measured in turn on the one loaded model, each in a cache of its own,
    /// comma-separated (values as `--kv-cache`, which is the one measured by default).
    #[arg(long, value_delimiter = ',')]
    kv_caches: Vec<String>,
    #[arg(long, default_value_t = 5)]
    reps: usize,
    /// Seed of synthetic weights and of the token ids.
    #[arg(long, default_value_t = 7)]
    seed: u64,
    /// auto | on | off: decode steps replayed as one CUDA graph each (`auto`: on CUDA).
    #[arg(long, default_value = "auto")]
    cuda_graph: CudaGraph,
    /// Prefill GEMM kernels the tuner chooses among, comma-separated names (`default`: CubeCL's
    /// tuned kernels and cuBLASLt on CUDA; `tuned`: CubeCL's alone).
    #[arg(long, value_delimiter = ',', default_value = "default")]
    gemm_candidates: Vec<String>,
    /// device | host: how cuBLASLt's products (where the tuner chose it) are ordered against
    /// CubeCL's stream (`burn_gemma_kernels::gemm::cublas::order`; CUDA builds only).
    #[arg(long, value_enum, default_value_t = CublasOrder::Device)]
    cublaslt_order: CublasOrder,
    /// The prompt attention kernel where several take the shapes (`auto`: the library's
    /// default, flash attention on the matrix units where it runs).
    #[arg(long, value_enum, default_value_t = PromptAttention::Auto)]
    prefill_attention: PromptAttention,
    /// auto | at-start | off: kernels of a replayed decode graph launched while their
    /// predecessor runs (programmatic dependent launch, compute capability 9.0+), waiting for
    /// it where they mark it (`at-start`: in their first statement); `off`: stream order.
    #[arg(long, default_value = "auto")]
    dependent_launch: burn_gemma_kernels::graph::DependentLaunch,
    /// Fewest multiply-adds (millions) of a product for which the tuner times cuBLASLt.
    #[arg(long, default_value_t = burn_gemma_kernels::gemm::tune::DEFAULT_CUBLASLT_FLOOR / 1_000_000)]
    cublaslt_floor_m: usize,
    /// Samples the host's call stacks (2 kHz) during the last rep's decode and writes them to
    /// this file as collapsed stacks (`root;...;leaf count`); needs `--features host-profile`.
    #[arg(long)]
    host_profile: Option<std::path::PathBuf>,
    /// Splits the model over N devices (tensor parallelism; CUDA devices from `--device` on,
    /// joined by NCCL, or N shards on a CPU backend): prefill and greedy decode of the split
    /// model (`ShardedModel`), at depth 0 with the one `--kv-cache`.
    #[arg(long, default_value_t = NonZeroUsize::MIN)]
    tensor_parallel: NonZeroUsize,
    /// Keeps only the first N layers of a `synthetic:` preset (its layer pattern and every
    /// matrix shape unchanged): a large model's per-layer kernels timed without building all of
    /// its random weights on the host.
    #[arg(long)]
    layers: Option<std::num::NonZeroUsize>,
}

struct Bench(Args);

fn ids(n: usize, vocab: usize, state: &mut u64) -> Vec<u32> {
    (0..n)
        .map(|_| {
            *state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((*state >> 33) % vocab as u64) as u32
        })
        .collect()
}

/// Feeds `tokens` in chunks of at most `chunk` (bounds the activation memory), returns the
/// greedy token id after the last.
fn feed<B: GemmaBackend>(
    model: &Gemma<B>,
    cache: &mut KvCache<B>,
    tokens: &[u32],
    chunk: std::num::NonZeroUsize,
    device: &B::Device,
) -> Result<u32, CliError> {
    let mut logits = None;
    for chunk in tokens.chunks(chunk.get()) {
        logits = Some(model.forward_last(token_tensor::<B>(chunk, device), cache)?);
    }
    let logits = logits.ok_or_else(|| CliError::from("no tokens to feed"))?;
    Ok(first_id::<B>(B::sample(logits, &SamplingParams::GREEDY, Draws::Host(&[0.0]))?))
}

/// Reads a sampled id back to the host (this waits for the device).
fn first_id<B: GemmaBackend>(ids: Tensor<B, 1, Int>) -> u32 {
    let ids = ids.into_data().convert::<i64>();
    ids.as_slice::<i64>().ok().and_then(|v| v.first().copied()).unwrap_or(0) as u32
}

struct Stat {
    median: f64,
    min: f64,
    max: f64,
}

fn stat(mut v: Vec<f64>) -> Stat {
    v.sort_by(f64::total_cmp);
    Stat { median: v[v.len() / 2], min: v[0], max: v[v.len() - 1] }
}

impl BackendTask for Bench {
    type Output = Result<(), CliError>;

    fn run<B: GemmaBackend>(self, device: B::Device, name: &str) -> Result<(), CliError> {
        let mut a = self.0;
        let (weights, dtype, kv_cache) = a.backend.formats(name)?;
        if a.prompt_len.contains(&0) || a.gen == 0 || a.reps == 0 {
            return Err(CliError::from("--prompt-len, --gen and --reps must be at least 1"));
        }
        burn_gemma::backends::check_dtype::<B>(&device, dtype)?;
        let mut candidates = Vec::new();
        for name in &a.gemm_candidates {
            match (name.as_str(), burn_gemma_kernels::gemm::GemmKernel::from_name(name)) {
                ("default", _) => candidates.extend(burn_gemma_kernels::gemm::tune::DEFAULT),
                ("tuned", _) => candidates.extend(burn_gemma_kernels::gemm::tune::TUNED),
                (_, Some(kernel)) => candidates.push(kernel),
                (_, None) => return Err(format!("--gemm-candidates: no GEMM kernel named `{name}`").into()),
            }
        }
        let tuning = KernelTuning {
            gemm_candidates: candidates.into(),
            cublaslt_floor: a.cublaslt_floor_m.saturating_mul(1_000_000),
            blas_ordering: match a.cublaslt_order {
                CublasOrder::Device => BlasOrdering::Device,
                CublasOrder::Host => BlasOrdering::Host,
            },
            prefill_attention: match a.prefill_attention {
                PromptAttention::Auto => PrefillAttention::Auto,
                PromptAttention::Flash => PrefillAttention::Flash,
                PromptAttention::Blocked => PrefillAttention::Blocked,
                PromptAttention::Tiled => PrefillAttention::Tiled,
            },
            flash_layout: None,
            dependent_launch: a.dependent_launch,
        };
        if a.model == "default" {
            a.model = burn_gemma::fetch::default_model(|_, _| {})?.display().to_string();
        }
        if a.tensor_parallel.get() > 1 {
            return sharded::<B>(&a, &device, name, ModelOptions { dtype, weights, kv_cache: Some(kv_cache) }, tuning);
        }
        let load = Instant::now();
        // (tensors read, seconds since the load began) at each progress report.
        let tensor_marks = std::sync::Arc::new(std::sync::Mutex::new(Vec::<(usize, f64)>::new()));
        let model = match a.model.strip_prefix("synthetic:") {
            Some(preset) => {
                let options = ModelOptions { dtype, weights, kv_cache: Some(kv_cache) };
                let mut config = GemmaConfig::preset(preset)?;
                if let Some(layers) = a.layers {
                    let layers = layers.get().min(config.num_hidden_layers);
                    if config.num_kv_shared_layers > 0 {
                        return Err(CliError::from("--layers does not apply to presets with KV-sharing layers"));
                    }
                    config.num_hidden_layers = layers;
                    config.layer_types.truncate(layers);
                }
                let mut model = Gemma::<B>::load(config, &mut RandomWeights::new(a.seed), &options, &device)?;
                model.set_tuning(tuning);
                model
            }
            None => {
                let checkpoint = Checkpoint::open(&a.model)?;
                let opened = load.elapsed().as_secs_f64();
                let marks = std::sync::Arc::clone(&tensor_marks);
                let options = LoadOptions::<B>::new()
                    .device(device.clone())
                    .dtype(dtype)
                    .weights(weights)
                    .kv_cache(kv_cache)
                    .tuning(tuning)
                    .progress(move |p| {
                        if let Ok(mut m) = marks.lock() {
                            m.push((p.loaded, load.elapsed().as_secs_f64()));
                        }
                    });
                let model = checkpoint.load(options)?.model;
                eprintln!("load: checkpoint opened in {opened:.2} s");
                model
            }
        };
        let _ = B::sync(&device);
        if let Ok(marks) = tensor_marks.lock() {
            load_timeline(&marks, load.elapsed().as_secs_f64());
        }
        let config = model.config().clone();
        eprintln!(
            "model {} ({:.2} B parameters, {:.2} GB of weights on the device), backend {name}, dtype {dtype:?}, weights {weights}, KV cache {kv_cache}, loaded in {:.1} s",
            a.model,
            config.num_parameters() as f64 / 1e9,
            model.weight_bytes() as f64 / 1e9,
            load.elapsed().as_secs_f64()
        );
        let longest = a.prompt_len.iter().copied().max().unwrap_or(1);
        let deepest = a.depth.iter().copied().max().unwrap_or(0);
        let capacity = deepest + longest.max(a.gen) + 1;
        let kv_formats = match a.kv_caches.is_empty() {
            true => vec![kv_cache],
            false => a.kv_caches.iter().map(|k| parse_kv_cache(k, dtype)).collect::<Result<Vec<_>, _>>()?,
        };
        for &kv_cache in &kv_formats {
            let mut cache = KvCache::new(&config, 1, capacity, kv_cache, &device)?;
            // Host memory after the load and the cache (CPU backends: the weights and the cache).
            let rss_loaded = resident_bytes().unwrap_or(0);
            let mut graphs = match a.cuda_graph {
                CudaGraph::Off => None,
                _ => Some(DecodeGraphs::<B>::new(SamplingParams::GREEDY, 1, capacity)),
            };
            for &depth in &a.depth {
                // The same ids for a depth whatever else is measured: the context, then the prompts.
                let mut state = a.seed;
                let context = ids(depth, config.vocab_size, &mut state);
                for &prompt_len in &a.prompt_len {
                    let prompt = ids(prompt_len, config.vocab_size, &mut state);
                    let (mut pp, mut tg, mut ttft, mut host) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
                    let mut gpu_share = Vec::new();
                    let mut peak = 0u64;
                    for rep in 0..=a.reps {
                        // Prefill at depth.
                        cache.reset();
                        if !context.is_empty() {
                            feed(&model, &mut cache, &context, a.prefill_chunk, &device)?;
                        }
                        let _ = B::sync(&device);
                        let start = Instant::now();
                        let token = feed(&model, &mut cache, &prompt, a.prefill_chunk, &device)?;
                        let prefill = start.elapsed();
                        peak = peak.max(B::memory_reserved(&device).unwrap_or(0));
                        // Decode at depth.
                        cache.reset();
                        if !context.is_empty() {
                            feed(&model, &mut cache, &context, a.prefill_chunk, &device)?;
                        }
                        let _ = B::sync(&device);
                        let profiler = match (&a.host_profile, rep == a.reps) {
                            (Some(_), true) => Some(host_profile::start()?),
                            _ => None,
                        };
                        let start = Instant::now();
                        let (enqueue, gpu) =
                            decode_greedy(&model, &mut cache, (&mut graphs, a.cuda_graph), token, a.gen)?;
                        let decode = start.elapsed();
                        if let (Some(profiler), Some(path)) = (profiler, &a.host_profile) {
                            host_profile::finish(profiler, path)?;
                            eprintln!("host profile of {} decode tokens written to {}", a.gen, path.display());
                        }
                        peak = peak.max(B::memory_reserved(&device).unwrap_or(0));
                        if rep == 0 {
                            continue; // warm-up
                        }
                        pp.push(prompt_len as f64 / prefill.as_secs_f64());
                        tg.push(a.gen as f64 / decode.as_secs_f64());
                        host.push(enqueue.as_secs_f64() * 1e3 / a.gen as f64);
                        if graphs.is_some() {
                            gpu_share.push(100.0 * gpu.as_secs_f64() / decode.as_secs_f64());
                        }
                        ttft.push(prefill.as_secs_f64() * 1e3);
                    }
                    let (pp, tg, ttft, host) = (stat(pp), stat(tg), stat(ttft), stat(host));
                    let show = |what: &str, s: &Stat, unit: &str| {
                        println!("{what:<28} median {:>9.2} {unit}  (min {:.2}, max {:.2})", s.median, s.min, s.max)
                    };
                    println!(
                        "{} | {name} | {dtype:?} | weights {weights} | KV {kv_cache} | depth {} | {} reps",
                        a.model, depth, a.reps
                    );
                    show(&format!("prefill pp{}", prompt_len), &pp, "tok/s");
                    let tuning = burn_gemma_kernels::gemm::tune::summary();
                    if tuning.tuned > 0 || tuning.cached > 0 {
                        println!(
                    "prefill GEMM tuning: {} shape classes timed in {:.2} s (first rep, untimed warm-up), {} choices read from the cache",
                    tuning.tuned,
                    tuning.time.as_secs_f64(),
                    tuning.cached
                );
                    }
                    show(&format!("decode tg{}", a.gen), &tg, "tok/s");
                    show("time to first token", &ttft, "ms");
                    show("decode host time per token", &host, "ms");
                    let graph_json = match &graphs {
                        Some(g) => {
                            let share = stat(gpu_share);
                            show("decode GPU busy (graph)", &share, "%");
                            let setup = g.setup();
                            println!(
                        "{:<28} {} launches per token, {} recording(s) in {:.0} ms ({} kernels compiled, {} from the PTX cache)",
                        "CUDA graph",
                        setup.launches,
                        setup.recordings,
                        setup.time.as_secs_f64() * 1e3,
                        setup.compiled,
                        setup.cached
                    );
                            format!(
                        ",\"cuda_graph\":true,\"gpu_busy_pct\":{:.2},\"graph_launches\":{},\"graph_setup_ms\":{:.1}",
                        share.median,
                        setup.launches,
                        setup.time.as_secs_f64() * 1e3
                    )
                        }
                        None => ",\"cuda_graph\":false".to_string(),
                    };
                    println!(
                        "{:<28} {:>16.3} ms (wall; the rest of each token waits for the device)",
                        "decode time per token",
                        1e3 / tg.median
                    );
                    match B::memory_reserved(&device) {
                        Some(_) => {
                            println!(
                                "{:<28} {:.2} GiB reserved",
                                "peak device memory",
                                peak as f64 / (1u64 << 30) as f64
                            )
                        }
                        None => println!("{:<28} not reported by this backend", "peak device memory"),
                    }
                    let rss_end = resident_bytes().unwrap_or(0);
                    println!(
                        "{:<28} {:.0} MB after load, {:.0} MB at the end ({} CPU threads)",
                        "resident host memory",
                        rss_loaded as f64 / 1e6,
                        rss_end as f64 / 1e6,
                        rayon::current_num_threads()
                    );
                    let host_json = format!(
                        ",\"threads\":{},\"rss_loaded_bytes\":{rss_loaded},\"rss_end_bytes\":{rss_end}",
                        rayon::current_num_threads()
                    );
                    println!(
                "JSON {{\"model\":\"{}\",\"backend\":\"{name}\",\"dtype\":\"{dtype:?}\",\"weights\":\"{weights}\",\"kv_cache\":\"{kv_cache}\",\"depth\":{},\"pp\":{:.3},\"tg\":{:.3},\"ttft_ms\":{:.3},\"host_ms_per_token\":{:.4},\"prompt_len\":{},\"gen\":{},\"reps\":{},\"weight_bytes\":{},\"kv_read_bytes\":{},\"peak_bytes\":{peak},\"gemm_tuning_s\":{:.3}{graph_json}{host_json}}}",
                a.model, depth, pp.median, tg.median, ttft.median, host.median, prompt_len, a.gen, a.reps, model.weight_bytes(), config.kv_read_bytes(kv_cache, depth + a.gen / 2), tuning.time.as_secs_f64()
            );
                }
            }
        }
        Ok(())
    }
}

/// Decodes `gen` greedy tokens after `token`: replaying `graphs` where there are some (under
/// [`CudaGraph::Auto`] a step that cannot be recorded drops them, saying why once, and decodes
/// eagerly from there), else eagerly. Returns the host's issue time and, from the replays, the
/// GPU time.
fn decode_greedy<B: GemmaBackend>(
    model: &Gemma<B>,
    cache: &mut KvCache<B>,
    (graphs, mode): (&mut Option<DecodeGraphs<B>>, CudaGraph),
    mut token: u32,
    gen: usize,
) -> Result<(Duration, Duration), CliError> {
    let device = model.device();
    let (mut enqueue, mut gpu) = (Duration::ZERO, Duration::ZERO);
    for _ in 0..gen {
        let step = Instant::now();
        if let Some(g) = graphs.as_mut() {
            match g.step(model, cache, &[token], &[0.0]) {
                Ok(ids) => {
                    let times = g.last_replay();
                    enqueue += times.issue;
                    gpu += times.gpu;
                    token = ids.first().copied().unwrap_or(0);
                    continue;
                }
                // Auto: eager where the backend is not CUDA, and where the step cannot be
                // recorded (said once).
                Err(ModelError::Graph(e)) if mode == CudaGraph::Auto => {
                    if !matches!(e, GraphError::NotCuda(_)) {
                        eprintln!("decoding eagerly, the CUDA graph failed: {e}");
                    }
                    *graphs = None;
                }
                Err(e) => return Err(e.into()),
            }
        }
        let logits = model.forward_last(token_tensor::<B>(&[token], &device), cache)?;
        let next = B::sample(logits, &SamplingParams::GREEDY, Draws::Host(&[0.0]))?;
        enqueue += step.elapsed();
        token = first_id::<B>(next);
    }
    Ok((enqueue, gpu))
}

/// Sampling the host's stacks with `pprof` (SIGPROF), written as collapsed stacks for
/// `scripts/host_profile.py`.
#[cfg(feature = "host-profile")]
mod host_profile {
    use super::CliError;
    use std::{fmt::Write as _, path::Path};

    pub struct Profiler(pprof::ProfilerGuard<'static>);

    pub fn start() -> Result<Profiler, CliError> {
        pprof::ProfilerGuard::new(1999).map(Profiler).map_err(|e| CliError::from(format!("host profiler: {e}")))
    }

    pub fn finish(profiler: Profiler, path: &Path) -> Result<(), CliError> {
        let report = profiler.0.report().build().map_err(|e| CliError::from(format!("host profiler: {e}")))?;
        let mut text = String::new();
        for (frames, count) in &report.data {
            // Frames run from the sampled instruction outwards, inlined functions innermost first.
            let names: Vec<String> =
                frames.frames.iter().rev().flat_map(|f| f.iter().rev().map(|s| s.name().replace(';', ":"))).collect();
            let _ = writeln!(text, "{};{} {count}", frames.thread_name_or_id(), names.join(";"));
        }
        std::fs::write(path, text).map_err(|e| CliError::from(format!("writing {}: {e}", path.display())))
    }
}

#[cfg(not(feature = "host-profile"))]
mod host_profile {
    use super::CliError;

    pub enum Profiler {}

    pub fn start() -> Result<Profiler, CliError> {
        Err(CliError::from("--host-profile needs the bench built with `--features host-profile`"))
    }

    pub fn finish(profiler: Profiler, _: &std::path::Path) -> Result<(), CliError> {
        match profiler {}
    }
}

/// `--tensor-parallel N`: the model split over N devices, each rep a fresh prompt (timed to its
/// greedy token) and `--gen` greedy tokens, each read back; decode steps replay one CUDA graph
/// per device where they can (`--cuda-graph`).
fn sharded<B: GemmaBackend>(
    a: &Args,
    device: &B::Device,
    name: &str,
    options: ModelOptions,
    tuning: KernelTuning,
) -> Result<(), CliError> {
    use burn_gemma::tensor_parallel::{split_devices, ShardedModel};
    if a.depth.iter().any(|&d| d != 0) || !a.kv_caches.is_empty() || a.layers.is_some() || a.host_profile.is_some() {
        return Err(CliError::from(
            "--tensor-parallel measures at depth 0 with the one --kv-cache; leave out --depth, --kv-caches, --layers and --host-profile",
        ));
    }
    let world = a.tensor_parallel.get();
    let (devices, reduces) = split_devices::<B>(device, world)?;
    let load = Instant::now();
    let mut model = match a.model.strip_prefix("synthetic:") {
        Some(preset) => {
            // Each shard draws the whole model's weights from the seed and keeps its part.
            let source = || RandomWeights::new(a.seed);
            ShardedModel::load_from(GemmaConfig::preset(preset)?, source, &options, &devices, reduces)?
        }
        None => {
            let checkpoint = Checkpoint::open(&a.model)?;
            let kv_cache = options.kv_cache.unwrap_or(KvFormat::Dense(options.dtype));
            let (dtype, weights) = (options.dtype, options.weights);
            let options = move |d: &B::Device| {
                LoadOptions::<B>::new().device(d.clone()).dtype(dtype).weights(weights).kv_cache(kv_cache)
            };
            ShardedModel::load(&checkpoint, &devices, options, reduces)?
        }
    };
    model.set_cuda_graph(a.cuda_graph)?;
    model.set_tuning(tuning)?;
    let config = model.config().clone();
    eprintln!(
        "model {} split over {world} devices of {name}, dtype {:?}, weights {}, loaded in {:.1} s",
        a.model,
        options.dtype,
        options.weights,
        load.elapsed().as_secs_f64()
    );
    let capacity = a.prompt_len.iter().copied().max().unwrap_or(1) + a.gen + 1;
    let mut state = a.seed;
    for &prompt_len in &a.prompt_len {
        let prompt = ids(prompt_len, config.vocab_size, &mut state);
        let (mut pp, mut tg) = (Vec::new(), Vec::new());
        for rep in 0..=a.reps {
            // The same size every rep: the caches are emptied in place, the recorded steps kept.
            model.new_cache(capacity)?;
            let start = Instant::now();
            let mut next = model.greedy(&prompt)?;
            let prefill = start.elapsed();
            let start = Instant::now();
            for _ in 0..a.gen {
                next = model.greedy(&[next])?;
            }
            let decode = start.elapsed();
            if rep > 0 {
                pp.push(prompt_len as f64 / prefill.as_secs_f64());
                tg.push(a.gen as f64 / decode.as_secs_f64());
            }
        }
        let steps = match (a.cuda_graph, model.eager_reason()) {
            (CudaGraph::Off, _) => "eager".to_string(),
            (_, Some(why)) => format!("eager ({why})"),
            _ => "graphs".to_string(),
        };
        println!("== {} on {world} devices, prompt {prompt_len}, {} generated, decode steps {steps}", a.model, a.gen);
        for (what, unit, s) in [("prefill", "tok/s", stat(pp)), ("decode", "tok/s", stat(tg))] {
            println!("{what:<28} median {:>9.2} {unit}  (min {:.2}, max {:.2})", s.median, s.min, s.max);
        }
    }
    Ok(())
}

fn main() -> Result<(), CliError> {
    let args = Args::parse();
    let kind = args.backend.check()?;
    args.backend.start_threads()?;
    dispatch(kind, Bench(args.clone()), &mut |note| eprintln!("{note}"))?
}

/// Where a checkpoint's load spent its time: until the first tensor was read, the slowest
/// tensors (the time since the previous report), and from the last tensor to the device's sync.
fn load_timeline(marks: &[(usize, f64)], total: f64) {
    let (Some(&(_, first)), Some(&(_, last))) = (marks.first(), marks.last()) else { return };
    let mut gaps: Vec<(usize, f64)> = marks.windows(2).map(|w| (w[1].0, w[1].1 - w[0].1)).collect();
    gaps.sort_by(|a, b| b.1.total_cmp(&a.1));
    let slowest: Vec<String> = gaps.iter().take(8).map(|(i, s)| format!("#{i} {s:.2} s")).collect();
    eprintln!(
        "load: first tensor at {first:.2} s, {} tensors by {last:.2} s (slowest: {}), synchronized at {total:.2} s",
        marks.len(),
        slowest.join(", ")
    );
}
