//! Throughput of the [`Engine`] with many requests at once, `llama-batched-bench` style: for each
//! count of streams `N`, `N` requests of `--prompt-len` random tokens are submitted together, each
//! generating `--gen` tokens greedily.
//!
//! ```text
//! cargo run --release --features cuda,tools --example serve_bench -- \
//!     --model model.gguf --backend cuda --dtype bf16 --streams 1,8,32,64 --prompt-len 512 --gen 128
//! ```
//!
//! Per count it prints the time to first token (median and largest), the decode throughput while
//! all `N` generate (the tokens that arrived between the last request's first token and the
//! first request's last, over that time: `S_TG` in `llama-batched-bench`'s terms, which
//! decodes once every prompt is in), its share per stream, and the whole run's
//! throughput (prompt and generated tokens over the wall time); a JSON line each. Medians over
//! `--reps` after a warm-up run.
//!
//! `--shared-prefix K` makes every prompt begin with the same `K` tokens (a shared system
//! prompt), which the engine's prefix cache (`--prefix-cache`, on by default) runs once.
//!
//! `--prompt-files a.txt,b.txt,...` gives request `i` the text of file `i % count` as a user
//! turn of the model's chat template instead (real prompts: `scripts/spec-prompts`), and
//! `--draft ngram --draft-tokens K` has every request draft by prompt lookup
//! ([`EngineDrafts`]); the drafts kept and drafted are printed with the counts.
//!
//! Each count's line ends with the step's floor: the weights and the batch's KV reads at
//! `--copy-gbps`, plus the batch's products at `--matrix-tflops`, at the middle of the
//! generation (`--prompt-len` + `--gen` / 2), and the measured step as a multiple of it.
//!
//! `--step-only` times the model's batched decode step alone instead (no engine, no sampling):
//! `N` sequences at position `--prompt-len`, the step's logits read back (the device
//! synchronized) each time; the median of 20 steps after 3: over a cache of a row per sequence,
//! over a paged cache, and (where `--cuda-graph` is not `off`) over a paged cache replayed as a
//! CUDA graph.

#[path = "cli/backend_args.rs"]
mod backend_args;
#[path = "cli/model_source.rs"]
mod model_source;

use backend_args::BackendArgs;
use burn_gemma::{
    backends::{dispatch, BackendTask},
    chat::ChatTemplate,
    engine::{Engine, EngineConfig, EngineDrafts, Event, Request},
    BatchGraphs, CudaGraph, Gemma, GemmaBackend, GemmaConfig, GenerationConfig, KvFormat, PagedLayout, PrefixCache,
    StepInputs,
};

use clap::Parser;
use std::num::NonZeroUsize;
use std::time::{Duration, Instant};

use model_source::CliError;

#[derive(Parser, Clone)]
struct Args {
    /// GGUF file or HF directory (its tokenizer is used), or synthetic:<preset> (random
    /// weights in a published model's shapes).
    #[arg(long)]
    model: String,
    /// Counts of requests submitted together, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "1,8,32,64")]
    streams: Vec<NonZeroUsize>,
    #[arg(long, default_value_t = 512)]
    prompt_len: usize,
    /// Generated prompts: random ids, or `copy` (a 40-id phrase of the request's own,
    /// repeated: what prompt lookup finds).
    #[arg(long, value_enum, default_value_t = PromptKind::Random)]
    prompt: PromptKind,
    #[arg(long, default_value_t = 128)]
    gen: usize,
    #[arg(long, default_value_t = 3)]
    reps: usize,
    /// Tokens a round of the engine runs (see `EngineConfig::round_tokens`).
    #[arg(long, default_value_t = NonZeroUsize::new(2048).unwrap_or(NonZeroUsize::MIN))]
    round_tokens: NonZeroUsize,
    /// Time the batched decode step alone (see the module's docs).
    #[arg(long)]
    step_only: bool,
    /// Batched decode steps replayed as CUDA graphs: auto, on or off.
    #[arg(long, default_value_t = CudaGraph::Auto)]
    cuda_graph: CudaGraph,
    /// Tokens every prompt begins with, the same in every run (a shared system prompt); the
    /// rest of each prompt is its own.
    #[arg(long, default_value_t = 0)]
    shared_prefix: usize,
    /// Prompts' blocks cached for later prompts that begin alike: on or off.
    #[arg(long, default_value_t = PrefixCache::On)]
    prefix_cache: PrefixCache,
    /// Text prompts (user turns of the model's chat template), request `i` taking file `i %
    /// count`, instead of `--prompt-len` random ids.
    #[arg(long, value_delimiter = ',')]
    prompt_files: Vec<std::path::PathBuf>,
    /// Drafts each request verifies in its batched steps: off or ngram (prompt lookup).
    #[arg(long, value_enum, default_value_t = BenchDraft::Off)]
    draft: BenchDraft,
    /// Most tokens a request drafts per step.
    #[arg(long, default_value_t = NonZeroUsize::new(4).unwrap_or(NonZeroUsize::MIN))]
    draft_tokens: NonZeroUsize,
    /// The device's copy rate in GB/s (bytes read plus written) for the step's floor; the
    /// default is the H200's, measured by `bench-gpu.sh` (1 GiB device-to-device, 2026-12-03).
    #[arg(long, default_value_t = 4218.0)]
    copy_gbps: f64,
    /// The device's dense bf16 rate in TFLOP/s for the step's floor; the default is the H200's
    /// rate on random data (an 8192-cube bf16 product through PyTorch: 769-798 TFLOP/s, the
    /// device library's KINDS.md).
    #[arg(long, default_value_t = 790.0)]
    matrix_tflops: f64,
    #[command(flatten)]
    backend: BackendArgs,
}

/// What generated prompts hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum PromptKind {
    Random,
    Copy,
}

/// Where `--draft` takes drafts from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum BenchDraft {
    Off,
    Ngram,
}

/// Median milliseconds of one decode step over `n` sequences at `position` (logits read back).
fn step_ms<B: GemmaBackend>(model: &Gemma<B>, n: usize, position: usize, kind: CacheKind) -> Result<f64, CliError> {
    let mut cache = match kind {
        CacheKind::Rows => model.new_cache(n, position + 2)?,
        CacheKind::Paged | CacheKind::PagedGraph => {
            // As the engine makes it: blocks of 32 where they divide, each sequence holding its own.
            let capacity = (position + 2).next_multiple_of(32);
            let block_size = PagedLayout::block_size_for(model.config(), capacity, 32);
            let layout = PagedLayout::new(n, capacity, block_size);
            let mut cache = model.new_paged_cache(layout)?;
            for row in 0..n {
                let reservation = cache.reserve(position + 2)?;
                cache.attach(row, reservation)?;
            }
            cache
        }
    };
    let ids: Vec<u32> = (0..n).map(|i| 1000 + 17 * i as u32).collect();
    let positions = vec![position; n];
    let device = model.device();
    let mut times = Vec::new();
    let mut graphs = BatchGraphs::new();
    for rep in 0..23 {
        let start = Instant::now();
        let logits = match kind {
            CacheKind::PagedGraph => graphs.step(model, &mut cache, &ids, &positions)?,
            _ => model.decode_logits(&StepInputs::sequences(&ids, &positions, &device)?, &mut cache)?,
        };
        let corner = logits.slice([0..1, 0..1]).into_data();
        std::hint::black_box(corner);
        if rep >= 3 {
            times.push(start.elapsed().as_secs_f64() * 1e3);
        }
    }
    Ok(median(times))
}

/// Which KV cache a step runs over.
#[derive(Debug, Clone, Copy)]
enum CacheKind {
    /// A row of slots per sequence.
    Rows,
    /// Blocks of a pool through a block table, as the engine's.
    Paged,
    /// Paged, the step replayed as a CUDA graph.
    PagedGraph,
}

/// What one request saw: when each of its tokens came (from submission).
struct Seen {
    times: Vec<Duration>,
}

impl Seen {
    fn first(&self) -> Duration {
        self.times.first().copied().unwrap_or_default()
    }

    fn last(&self) -> Duration {
        self.times.last().copied().unwrap_or_default()
    }
}

/// One run of `n` requests.
struct Run {
    wall: Duration,
    ttft: Vec<f64>,
    /// Tokens per second while all `n` generate.
    decode: f64,
    generated: usize,
    /// Prompt tokens of the `n` requests.
    prompt_tokens: usize,
}

fn run_once(engine: &Engine, n: usize, args: &Args, (seed, texts): (u64, &[Vec<u32>])) -> Result<Run, CliError> {
    let vocab = engine.tokenizer().vocab_size() as u64;
    let random = |mut state: u64| {
        move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            // Past the first 1000 ids: no special tokens.
            (1000 + state % (vocab - 1000)) as u32
        }
    };
    let shared: Vec<u32> =
        std::iter::repeat_with(random(0x5eed)).take(args.shared_prefix.min(args.prompt_len)).collect();
    let mut next = random(seed);
    let generation = GenerationConfig { max_new_tokens: args.gen, ..GenerationConfig::default() };
    let prompts: Vec<Vec<u32>> = (0..n)
        .map(|i| {
            if !texts.is_empty() {
                return texts[i % texts.len()].clone();
            }
            let own: Vec<u32> = match args.prompt {
                PromptKind::Random => std::iter::repeat_with(&mut next).take(args.prompt_len - shared.len()).collect(),
                PromptKind::Copy => {
                    let phrase: Vec<u32> = std::iter::repeat_with(&mut next).take(40).collect();
                    phrase.into_iter().cycle().take(args.prompt_len - shared.len()).collect()
                }
            };
            shared.iter().copied().chain(own).collect()
        })
        .collect();
    let prompt_tokens = prompts.iter().map(Vec::len).sum();
    let requests: Vec<Request> = prompts.into_iter().map(|ids| Request::new(ids, generation.clone())).collect();
    let start = Instant::now();
    let streams = requests.into_iter().map(|r| engine.submit(r)).collect::<Result<Vec<_>, _>>()?;
    let seen: Vec<Result<Seen, String>> = std::thread::scope(|scope| {
        let handles: Vec<_> = streams
            .into_iter()
            .map(|stream| {
                scope.spawn(move || {
                    let mut times = Vec::new();
                    for event in stream {
                        match event.map_err(|e| e.to_string())? {
                            Event::Token(_) => times.push(start.elapsed()),
                            Event::Done(_) => break,
                        }
                    }
                    Ok(Seen { times })
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap_or_else(|_| Err("a request thread panicked".into()))).collect()
    });
    let wall = start.elapsed();
    let seen = seen.into_iter().collect::<Result<Vec<_>, _>>()?;
    // The window where every request generates: from the last first token to the first request
    // done; the tokens that arrived inside it, over its length.
    let all_started = seen.iter().map(Seen::first).max().unwrap_or_default();
    let first_done = seen.iter().map(Seen::last).min().unwrap_or_default();
    let window = first_done.saturating_sub(all_started).as_secs_f64();
    let in_window = seen.iter().flat_map(|s| &s.times).filter(|&&t| t > all_started && t <= first_done).count() as f64;
    Ok(Run {
        wall,
        ttft: seen.iter().map(|s| s.first().as_secs_f64()).collect(),
        decode: if window > 0.0 { in_window / window } else { 0.0 },
        generated: seen.iter().map(|s| s.times.len()).sum(),
        prompt_tokens,
    })
}

/// What a batched decode step cannot beat: its bytes over the copy rate plus its products over
/// the matrix rate.
struct StepFloor {
    weight_bytes: usize,
    config: GemmaConfig,
    kv: KvFormat,
    copy_gbps: f64,
    matrix_tflops: f64,
}

impl StepFloor {
    /// Milliseconds of `(bytes, products)` of a step over `n` sequences at `position`.
    fn ms(&self, n: usize, position: usize) -> (f64, f64) {
        let bytes = self.weight_bytes as f64 + n as f64 * self.config.kv_read_bytes(self.kv, position) as f64;
        let flops = 2.0 * n as f64 * self.config.decode_macs(position) as f64;
        (bytes / (self.copy_gbps * 1e9) * 1e3, flops / (self.matrix_tflops * 1e12) * 1e3)
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

impl BackendTask for Args {
    type Output = Result<(), CliError>;

    fn run<B: GemmaBackend>(self, device: B::Device, name: &str) -> Result<(), CliError> {
        let formats = self.backend.formats(name)?;
        let (weights, dtype, kv_cache) = formats;
        let (model, tokenizer) = model_source::load::<B>(&self.model, 0x5eed, formats, &device)?;
        if self.step_only {
            eprintln!("backend {name}, dtype {dtype:?}, weights {weights}, KV cache {kv_cache}");
            for &n in &self.streams {
                let ms = step_ms(&model, n.get(), self.prompt_len, CacheKind::Rows)?;
                let paged = step_ms(&model, n.get(), self.prompt_len, CacheKind::Paged)?;
                let graph = match self.cuda_graph {
                    CudaGraph::Off => String::new(),
                    _ => match step_ms(&model, n.get(), self.prompt_len, CacheKind::PagedGraph) {
                        Ok(ms) => format!("; paged graph {ms:.2} ms, {:.1} tok/s", n.get() as f64 * 1e3 / ms),
                        Err(e) if self.cuda_graph == CudaGraph::Auto => format!("; no graph: {e}"),
                        Err(e) => return Err(e),
                    },
                };
                println!(
                    "step {:>3} sequences: {ms:.2} ms, {:.1} tok/s; paged {paged:.2} ms, {:.1} tok/s{graph}",
                    n.get(),
                    n.get() as f64 * 1e3 / ms,
                    n.get() as f64 * 1e3 / paged
                );
            }
            return Ok(());
        }
        let most = self.streams.iter().map(|n| n.get()).max().unwrap_or(1);
        let template = ChatTemplate::for_architecture(model.config().model_type);
        let texts = self
            .prompt_files
            .iter()
            .map(|path| {
                let text =
                    std::fs::read_to_string(path).map_err(|e| format!("--prompt-files {}: {e}", path.display()))?;
                Ok(tokenizer.encode(&template.user_turn(&text), burn_gemma::Bos::Prepend)?)
            })
            .collect::<Result<Vec<Vec<u32>>, CliError>>()?;
        let longest = texts.iter().map(Vec::len).max().unwrap_or(self.prompt_len);
        let config = EngineConfig {
            max_running: NonZeroUsize::new(most).unwrap_or(NonZeroUsize::MIN),
            max_waiting: most,
            round_tokens: self.round_tokens,
            max_sequence_len: NonZeroUsize::new(longest + self.gen + 1).unwrap_or(NonZeroUsize::MIN),
            cuda_graph: self.cuda_graph,
            prefix_cache: self.prefix_cache,
            drafts: match self.draft {
                BenchDraft::Off => EngineDrafts::Off,
                BenchDraft::Ngram => EngineDrafts::PromptLookup { tokens: self.draft_tokens },
            },
            ..EngineConfig::default()
        };
        let floor = StepFloor {
            weight_bytes: model.weight_bytes(),
            config: model.config().clone(),
            kv: model.kv_format(),
            copy_gbps: self.copy_gbps,
            matrix_tflops: self.matrix_tflops,
        };
        let engine = Engine::new(model, tokenizer, config)?;
        eprintln!("backend {name}, dtype {dtype:?}, weights {weights}, KV cache {kv_cache}");
        for &n in &self.streams {
            let n = n.get();
            run_once(&engine, n, &self, (1, &texts))?; // warm-up: kernels compiled, buffers pooled
            let load = |a: &std::sync::atomic::AtomicU64| a.load(std::sync::atomic::Ordering::Relaxed);
            let before = {
                let m = engine.metrics();
                [
                    load(&m.decode_steps),
                    load(&m.decode_micros),
                    load(&m.prompt_micros),
                    load(&m.draft_tokens),
                    load(&m.draft_tokens_accepted),
                ]
            };
            let runs = (0..self.reps)
                .map(|r| run_once(&engine, n, &self, (2 + r as u64, &texts)))
                .collect::<Result<Vec<_>, _>>()?;
            let ttft = median(runs.iter().map(|r| median(r.ttft.clone())).collect());
            let ttft_max = median(runs.iter().map(|r| r.ttft.iter().copied().fold(0.0, f64::max)).collect());
            let decode = median(runs.iter().map(|r| r.decode).collect());
            let total =
                median(runs.iter().map(|r| (r.prompt_tokens + r.generated) as f64 / r.wall.as_secs_f64()).collect());
            let generated = median(runs.iter().map(|r| r.generated as f64).collect());
            let m = engine.metrics();
            let (steps, rows) = (
                m.decode_steps.load(std::sync::atomic::Ordering::Relaxed),
                m.decode_rows.load(std::sync::atomic::Ordering::Relaxed),
            );
            let after = [
                load(&m.decode_steps),
                load(&m.decode_micros),
                load(&m.prompt_micros),
                load(&m.draft_tokens),
                load(&m.draft_tokens_accepted),
            ];
            let (drafted, kept) = (after[3] - before[3], after[4] - before[4]);
            let step_ms = (after[1] - before[1]) as f64 / 1e3 / (after[0] - before[0]).max(1) as f64;
            let graphs = format!(
                "{} of {} decode steps replayed as CUDA graphs, {} recordings in {:.0} ms so far{}",
                load(&m.decode_graph_steps),
                steps,
                load(&m.graph_recordings),
                load(&m.graph_recording_micros) as f64 / 1e3,
                engine.eager_reason().map(|r| format!(" (eager: {r})")).unwrap_or_default()
            );
            let prompt_s = (after[2] - before[2]) as f64 / 1e6 / self.reps.max(1) as f64;
            let (bytes_ms, products_ms) = floor.ms(n, longest + self.gen / 2);
            let floor_ms = bytes_ms + products_ms;
            println!(
                "streams {n:>3}: TTFT median {:.1} ms, largest {:.1} ms; decode {decode:.1} tok/s total, {:.1} per \
                 stream; whole run {total:.1} tok/s; {generated} tokens generated; engine: {step_ms:.2} ms per \
                 decode step, {prompt_s:.2} s of prompts per run; {kept} of {drafted} drafts kept; {} prompt tokens \
                 cached so far; {graphs}; floor {floor_ms:.2} ms per step (bytes {bytes_ms:.2}, products \
                 {products_ms:.2}), the step at {:.1}x it",
                ttft * 1e3,
                ttft_max * 1e3,
                decode / n as f64,
                load(&m.prefix_cached_tokens),
                step_ms / floor_ms,
            );
            println!(
                "JSON {{\"streams\":{n},\"prompt\":{},\"gen\":{},\"ttft_median_s\":{ttft:.4},\"ttft_max_s\":{ttft_max:.4},\
                 \"decode_tok_s\":{decode:.1},\"decode_per_stream\":{:.1},\"total_tok_s\":{total:.1},\
                 \"generated\":{generated},\"mean_batch_so_far\":{:.2},\"drafted\":{drafted},\"kept\":{kept},\"step_ms\":{step_ms:.3},\"floor_ms\":{floor_ms:.3}}}",
                longest,
                self.gen,
                decode / n as f64,
                rows as f64 / steps.max(1) as f64
            );
        }
        engine.shutdown();
        Ok(())
    }
}

fn main() -> Result<(), CliError> {
    let args = Args::parse();
    let kind = args.backend.check()?;
    args.backend.start_threads()?;
    dispatch(kind, args, &mut |note| eprintln!("{note}"))?
}
