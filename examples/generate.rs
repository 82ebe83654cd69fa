//! Generate text with Gemma.
//!
//! ```text
//! cargo run --release --example generate -- --prompt "The capital of France is"
//! cargo run --release --example generate -- --chat            # interactive multi-turn chat
//! cargo run --release --example generate -- --model gemma4.gguf --chat --thinking --prompt "Why is the sky blue?"
//! cargo run --release --example generate -- --draft ngram --prompt "Repeat after me: ..."  # prompt lookup
//! cargo run --release --example generate -- --model gemma-4-E2B-it --draft assistant:gemma-4-E2B-it-assistant --chat
//! ```
//!
//! stdout receives exactly the generated text; progress, the chosen backend and the final
//! statistics go to stderr.

#[path = "cli/backend_args.rs"]
mod backend_args;

use backend_args::BackendArgs;
use burn::tensor::DType;
use burn_gemma::{
    backends::{dispatch, list_devices, resident_bytes, BackendTask},
    chat::{ChatTemplate, ReplyPart, ReplyRouter, SystemTurn, Thinking},
    output::{OutputRules, Room, SequenceOutput},
    speculative::{AssistantDrafter, DraftLength, DraftModel, Drafter, PromptLookup, Speculation},
    tensor_parallel::{self, ShardedModel},
    AssistantCheckpoint, Bos, Checkpoint, EagerReason, Error, GemmaBackend, GenerationConfig, Generator, LoadOptions,
    Loaded, MmprojCheckpoint, Picture, SamplingConfig, StopReason,
};
use clap::Parser;
use indicatif::{ProgressBar, ProgressStyle};
use std::{
    io::{BufRead, IsTerminal, Read, Write},
    path::PathBuf,
    process::ExitCode,
    sync::{
        atomic::{AtomicBool, AtomicUsize, Ordering},
        Arc,
    },
    time::Instant,
};

/// The program's errors: the library's, or a message about its command line.
type CliError = Box<dyn std::error::Error>;

#[derive(Parser, Debug, Clone)]
#[command(about = "Generate text with a Gemma model on any Burn backend")]
struct Args {
    /// A GGUF file or a Hugging Face directory; default: Gemma 3 270M (fetched once, cached).
    #[arg(long)]
    model: Option<PathBuf>,
    /// The prompt; read from stdin when absent and stdin is not a terminal.
    #[arg(long)]
    prompt: Option<String>,
    /// Wrap the prompt in the Gemma chat template; without --prompt, start an interactive chat.
    #[arg(long)]
    chat: bool,
    /// Chat only: instructions for the model (Gemma 4's system turn; Gemma 1-3 read them at the
    /// head of the first message).
    #[arg(long)]
    system: Option<String>,
    /// Chat only, Gemma 4: the model thinks before it answers; its thought goes to stderr
    /// (dimmed on a terminal), the answer to stdout.
    #[arg(long)]
    thinking: bool,
    #[arg(long, default_value_t = 128)]
    max_new_tokens: usize,
    /// A text that ends generation where it appears (it is not printed); repeat for several.
    #[arg(long = "stop", value_name = "TEXT")]
    stop_strings: Vec<String>,
    /// 0 is greedy.
    #[arg(long, default_value_t = 0.0)]
    temperature: f32,
    #[arg(long)]
    top_k: Option<usize>,
    #[arg(long)]
    top_p: Option<f32>,
    #[arg(long)]
    min_p: Option<f32>,
    #[arg(long, default_value_t = 1.0)]
    repeat_penalty: f32,
    /// Tokens the repetition penalty looks back over.
    #[arg(long, default_value_t = 64)]
    repeat_last_n: usize,
    #[arg(long, default_value_t = 42)]
    seed: u64,
    #[command(flatten)]
    backend: BackendArgs,
    /// auto | on | off: replay each decode step as one recorded CUDA graph (`auto`: on CUDA,
    /// without a repetition penalty; `on`: an error where it cannot work).
    #[arg(long, default_value = "auto")]
    cuda_graph: burn_gemma::CudaGraph,
    /// Most prompt tokens per forward pass: longer prompts run in chunks of this size, which
    /// bounds the device memory their activations take.
    #[arg(long, default_value_t = burn_gemma::DEFAULT_PREFILL_CHUNK)]
    prefill_chunk: std::num::NonZeroUsize,
    /// Speculative decoding: `ngram` (prompt lookup: continue earlier occurrences of the last
    /// tokens; pays off when the reply copies from the prompt), `model:PATH` (a smaller Gemma
    /// of the same vocabulary, e.g. Gemma 3 270M for Gemma 3 1B+) or `assistant:PATH` (the
    /// model's Gemma 4 assistant, `gemma-4-*-it-assistant`: HF directory or GGUF). Greedy output
    /// is unchanged; sampled output keeps the model's distribution.
    #[arg(long)]
    draft: Option<DraftArg>,
    /// Most tokens drafted per step.
    #[arg(long, default_value_t = std::num::NonZeroUsize::new(5).expect("5 is not zero"))]
    draft_tokens: std::num::NonZeroUsize,
    /// Adapt the draft length to how many drafts are kept, up to --draft-tokens.
    #[arg(long)]
    draft_adaptive: bool,
    /// A picture for the model to read (repeatable; a multimodal Gemma 3 or Gemma 4 HF
    /// checkpoint, or a Gemma 3 or Gemma 4 GGUF with --mmproj): placed where the prompt says
    /// `<start_of_image>` (Gemma 3) or `<|image|>` (Gemma 4), else before the prompt; in a chat,
    /// in the first turn.
    #[arg(long = "image")]
    images: Vec<PathBuf>,
    /// llama.cpp's vision projector GGUF (`mmproj`) for a Gemma 3 or Gemma 4 text GGUF: its
    /// vision tower (Gemma 3's SigLIP and projector, or Gemma 4's tower and embedder), for
    /// --image.
    #[arg(long)]
    mmproj: Option<PathBuf>,
    /// Gemma 3: also read each elongated picture as 2-4 crops (HF's pan-and-scan, its default
    /// sizes), each its own image in the prompt after the whole one.
    #[arg(long)]
    pan_and_scan: bool,
    /// Split the model over this many devices (tensor parallelism): CUDA devices 0..N joined by
    /// NCCL (its library, `libnccl.so`, must be installed), or N shards on a CPU backend. A
    /// prompt (with or without --chat) is generated eagerly; drafts, pictures and the
    /// interactive chat are not split.
    #[arg(long, default_value_t = std::num::NonZeroUsize::MIN)]
    tensor_parallel: std::num::NonZeroUsize,
    /// Print the backends and devices detected, then exit.
    #[arg(long)]
    list_devices: bool,
}

/// Where `--draft` takes drafts from.
#[derive(Debug, Clone)]
enum DraftArg {
    PromptLookup,
    Model(PathBuf),
    Assistant(PathBuf),
}

impl DraftArg {
    /// The checkpoint a drafter loads.
    fn path(&self) -> Option<&PathBuf> {
        match self {
            Self::PromptLookup => None,
            Self::Model(path) | Self::Assistant(path) => Some(path),
        }
    }
}

impl std::str::FromStr for DraftArg {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let path = |prefix: &str| s.strip_prefix(prefix).filter(|p| !p.is_empty()).map(PathBuf::from);
        match (s, path("model:"), path("assistant:")) {
            ("ngram", ..) => Ok(Self::PromptLookup),
            (_, Some(path), _) => Ok(Self::Model(path)),
            (_, _, Some(path)) => Ok(Self::Assistant(path)),
            _ => Err(format!("expected `ngram`, `model:PATH` or `assistant:PATH`, got {s:?}")),
        }
    }
}

fn progress_bar(message: &str) -> ProgressBar {
    let bar = ProgressBar::with_draw_target(Some(0), indicatif::ProgressDrawTarget::stderr());
    bar.set_style(
        ProgressStyle::with_template("{msg:>10} [{bar:30}] {pos}/{len} ({elapsed})")
            .unwrap_or(ProgressStyle::default_bar())
            .progress_chars("=> "),
    );
    bar.set_message(message.to_string());
    bar
}

/// What the run needs once the backend is chosen.
struct Run {
    args: Args,
    model_path: PathBuf,
    prompt: Option<String>,
    generation: GenerationConfig,
    interrupt: Arc<AtomicBool>,
    /// CPU threads (see `--threads`).
    threads: usize,
}

impl BackendTask for Run {
    type Output = Result<(), CliError>;

    fn run<B: GemmaBackend>(self, device: B::Device, name: &str) -> Result<(), CliError> {
        if self.args.tensor_parallel.get() > 1 {
            return self.run_split::<B>(device, name);
        }
        let (weights, dtype, kv_cache) = self.args.backend.formats(name)?;
        let threads = if name.contains("CPU") { format!(", threads: {}", self.threads) } else { String::new() };
        eprintln!(
            "backend: {name}, device: {device:?}{threads}, dtype: {dtype:?}, weights: {weights}, KV cache: {kv_cache}"
        );
        let checkpoint = Checkpoint::open(&self.model_path)?;
        if !self.args.images.is_empty() && !checkpoint.has_vision() && self.args.mmproj.is_none() {
            return Err(CliError::from(format!(
                "--image needs a multimodal model (an HF Gemma 3 or Gemma 4 checkpoint with a vision tower, or a \
                 Gemma 3 GGUF with --mmproj); {} has none",
                self.model_path.display()
            )));
        }
        if dtype == DType::F16 {
            eprintln!("note: f16 weights with an f32 residual stream (Gemma activations overflow f16)");
        }
        let bar = progress_bar("loading");
        let progress = bar.clone();
        let options =
            LoadOptions::<B>::new().device(device.clone()).dtype(dtype).weights(weights).kv_cache(kv_cache).progress(
                move |p| {
                    progress.set_length(p.total as u64);
                    progress.set_position(p.loaded as u64);
                },
            );
        let Loaded { model, report } = checkpoint.load(options)?;
        bar.finish_and_clear();
        let tokenizer = checkpoint.tokenizer()?;
        let vision = match (self.args.images.is_empty(), &self.args.mmproj) {
            (true, _) => None,
            (false, Some(mmproj)) => {
                let options = LoadOptions::<B>::new().device(device.clone()).dtype(dtype).weights(weights);
                Some(MmprojCheckpoint::open(mmproj, &tokenizer)?.load(options)?)
            }
            (false, None) => {
                let options = LoadOptions::<B>::new().device(device.clone()).dtype(dtype).weights(weights);
                Some(checkpoint.load_vision_tower(options)?)
            }
        };
        // Unmaps the file: what stays resident is the model.
        drop(checkpoint);
        if let Some(rss) = resident_bytes().filter(|_| name.contains("CPU")) {
            eprintln!(
                "loaded: {:.0} MB of weights, {:.0} MB resident",
                model.weight_bytes() as f64 / 1e6,
                rss as f64 / 1e6
            );
        }
        if !report.unused_tensors.is_empty() {
            eprintln!(
                "note: {} tensors not used by the text model (e.g. {})",
                report.unused_tensors.len(),
                report.unused_tensors[0]
            );
        }
        let mut generator = Generator::new(model, tokenizer)?;
        if let Some(draft) = &self.args.draft {
            let drafter = match draft {
                DraftArg::PromptLookup => Drafter::PromptLookup(PromptLookup::default()),
                DraftArg::Model(path) => {
                    let checkpoint = Checkpoint::open(path)?;
                    let bar = progress_bar("draft");
                    let progress = bar.clone();
                    let options = LoadOptions::<B>::new()
                        .device(device.clone())
                        .dtype(dtype)
                        .weights(weights)
                        .kv_cache(kv_cache)
                        .progress(move |p| {
                            progress.set_length(p.total as u64);
                            progress.set_position(p.loaded as u64);
                        });
                    let Loaded { model, .. } = checkpoint.load(options)?;
                    bar.finish_and_clear();
                    eprintln!("draft model: {} ({} layers)", path.display(), model.num_layers());
                    Drafter::Model(Box::new(DraftModel::new(model)))
                }
                DraftArg::Assistant(path) => {
                    let checkpoint = AssistantCheckpoint::open(path)?;
                    let bar = progress_bar("assistant");
                    let progress = bar.clone();
                    let options =
                        LoadOptions::<B>::new().device(device.clone()).dtype(dtype).weights(weights).progress(
                            move |p| {
                                progress.set_length(p.total as u64);
                                progress.set_position(p.loaded as u64);
                            },
                        );
                    let assistant = checkpoint.load(options)?;
                    bar.finish_and_clear();
                    let layers = assistant.config().text.num_hidden_layers;
                    eprintln!("assistant: {} ({layers} layers)", path.display());
                    Drafter::Assistant(Box::new(AssistantDrafter::new(assistant)))
                }
            };
            let length = match self.args.draft_adaptive {
                true => DraftLength::Adaptive { max: self.args.draft_tokens },
                false => DraftLength::Fixed(self.args.draft_tokens),
            };
            generator.set_speculation(Some(Speculation::new(drafter, length)))?;
            let cuda = burn_gemma_kernels::graph::available::<B>(&device).is_ok();
            if cuda && dtype != DType::F32 {
                eprintln!(
                    "note: drafts are verified on recorded CUDA graphs; in {dtype:?} a near tie can make greedy \
                     text part from decoding without drafts (a verify step's products over several rows sum in \
                     another order; --dtype f32 makes it far rarer)"
                );
            } else if !cuda && !name.contains("CPU") {
                eprintln!(
                    "note: on this backend the drafts' verify steps and a draft model's steps run eagerly (recorded \
                     steps are CUDA's): on an H200 eager drafting ran at 0.04-0.31x of plain decoding \
                     (BENCHMARKS.md, Speculative decoding)"
                );
            }
        }
        let mut images = Vec::new();
        if let Some(vision) = vision {
            let rule = self.args.pan_and_scan.then(burn_gemma::images::PanAndScan::default);
            let processor = vision.processor().with_pan_and_scan(rule).map_err(Error::from)?;
            for path in &self.args.images {
                let picture = processor.read(path).map_err(Error::from)?;
                let soft = processor.soft_tokens(&picture).map_err(Error::from)?;
                let size = match &picture {
                    Picture::Square(p) => format!("{0}x{0} pixels", p.size),
                    Picture::Crops { whole, crops } => format!("{0}x{0} pixels and {1} crops", whole.size, crops.len()),
                    Picture::Patches(p) => format!("{} x {} patches of {} pixels", p.rows, p.cols, p.patch_size),
                };
                eprintln!("image {}: {size}, {soft} soft tokens", path.display());
                images.push(picture);
            }
            generator.set_vision(Some(vision))?;
        }
        let flag = generator.interrupt_flag();
        let interrupt = self.interrupt.clone();
        // Forward the process-wide Ctrl-C flag to the generator.
        std::thread::spawn(move || loop {
            if interrupt.swap(false, Ordering::SeqCst) {
                flag.store(true, Ordering::SeqCst);
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        });

        if self.args.chat {
            let thinking = if self.args.thinking { Thinking::On } else { Thinking::Off };
            generator.set_system(SystemTurn { instructions: self.args.system.clone(), thinking, tools: Vec::new() })?;
        }
        let mut stdout = std::io::stdout();
        let dim = std::io::stderr().is_terminal();
        // In chat, a Gemma 4 thought channel goes to stderr and the answer to stdout.
        let mut router = ReplyRouter::default();
        let chat = self.args.chat;
        let mut emit = |text: &str| {
            if !chat {
                let _ = stdout.write_all(text.as_bytes());
                let _ = stdout.flush();
                return;
            }
            router.push(text, |part, text| match part {
                ReplyPart::Answer => {
                    let _ = stdout.write_all(text.as_bytes());
                    let _ = stdout.flush();
                }
                ReplyPart::Thought if dim => eprint!("\x1b[2m{text}\x1b[0m"),
                ReplyPart::Thought => eprint!("{text}"),
            });
        };
        match self.prompt {
            Some(prompt) => {
                let output = match (self.args.chat, images.is_empty()) {
                    (true, true) => generator.chat(&prompt, &self.generation, &mut emit)?,
                    (false, true) => generator.generate(&prompt, &self.generation, &mut emit)?,
                    (true, false) => generator.chat_with_images(&prompt, &images, &self.generation, &mut emit)?,
                    (false, false) => generator.generate_with_images(&prompt, &images, &self.generation, &mut emit)?,
                };
                eprintln!();
                if output.stop == StopReason::Interrupted {
                    eprintln!("interrupted");
                }
                if let Some(reason @ EagerReason::GraphFailed { .. }) = generator.eager_reason() {
                    eprintln!("note: decoding ran eagerly, the CUDA graph failed: {reason}");
                }
                eprintln!("{}", output.stats);
            }
            None => {
                eprintln!("interactive chat: type a message and press Enter; an empty line or Ctrl-D ends");
                let stdin = std::io::stdin();
                loop {
                    eprint!("> ");
                    let mut line = String::new();
                    if stdin
                        .lock()
                        .read_line(&mut line)
                        .map_err(|source| Error::Io { path: "<stdin>".into(), source })?
                        == 0
                    {
                        break;
                    }
                    let line = line.trim_end_matches(['\n', '\r']);
                    if line.trim().is_empty() {
                        break;
                    }
                    // The pictures go into the first turn.
                    let output = match std::mem::take(&mut images) {
                        pictures if pictures.is_empty() => generator.chat(line, &self.generation, &mut emit)?,
                        pictures => generator.chat_with_images(line, &pictures, &self.generation, &mut emit)?,
                    };
                    emit("\n"); // separates replies in the transcript
                    eprintln!("{}", output.stats);
                }
            }
        }
        Ok(())
    }
}

impl Run {
    /// `--tensor-parallel N`: the prompt's reply from the model split over N devices.
    fn run_split<B: GemmaBackend>(self, device: B::Device, name: &str) -> Result<(), CliError> {
        let world = self.args.tensor_parallel.get();
        let Some(prompt) = &self.prompt else {
            return Err(CliError::from("--tensor-parallel generates one reply: pass --prompt (or pipe it on stdin)"));
        };
        if self.args.draft.is_some() || !self.args.images.is_empty() {
            return Err(CliError::from("--tensor-parallel does not take --draft or --image"));
        }
        let (weights, dtype, kv_cache) = self.args.backend.formats(name)?;
        let (devices, reduces) = tensor_parallel::split_devices::<B>(&device, world)?;
        eprintln!(
            "backend: {name}, {world} devices from {device:?}, dtype: {dtype:?}, weights: {weights}, KV cache: {kv_cache}"
        );
        let checkpoint = Checkpoint::open(&self.model_path)?;
        let started = Instant::now();
        let options =
            |d: &B::Device| LoadOptions::<B>::new().device(d.clone()).dtype(dtype).weights(weights).kv_cache(kv_cache);
        let mut model = ShardedModel::load(&checkpoint, &devices, options, reduces)?;
        eprintln!("loaded {world} shards in {:.1} s", started.elapsed().as_secs_f64());
        let tokenizer = checkpoint.tokenizer()?;
        let config = checkpoint.config().clone();
        drop(checkpoint);
        let text = match self.args.chat {
            true => ChatTemplate::for_architecture(config.model_type).user_turn(prompt),
            false => prompt.clone(),
        };
        let ids = tokenizer.encode(&text, Bos::Prepend)?;
        let stop = burn_gemma::generation::default_stop_tokens(&config, &tokenizer);
        let mut output = SequenceOutput::new(OutputRules {
            stop_tokens: stop.clone(),
            stop_strings: self.generation.stop_strings.clone(),
            max_new_tokens: self.args.max_new_tokens,
        });
        // The split model checks its own context; the output checks stops and the limit.
        let room = Room { used: 0, capacity: usize::MAX };
        let mut stdout = std::io::stdout();
        let started = Instant::now();
        let mut first = None;
        let interrupt = self.interrupt.clone();
        let generated = model.generate(&ids, self.generation.sampling, self.args.max_new_tokens, &stop, |id| {
            first.get_or_insert_with(|| started.elapsed());
            let emitted = output.push(id, tokenizer.token_bytes(id), room);
            if let Some(text) = &emitted.text {
                let _ = stdout.write_all(text.as_bytes());
                let _ = stdout.flush();
            }
            emitted.stop.is_none() && !interrupt.load(Ordering::SeqCst)
        })?;
        let _ = stdout.write_all(output.finish().as_bytes());
        eprintln!();
        let first = first.unwrap_or_default().as_secs_f64();
        let decode = started.elapsed().as_secs_f64() - first;
        eprintln!(
            "{} prompt tokens in {:.2} s ({:.1} tok/s), {} tokens in {:.2} s ({:.1} tok/s), {world} devices",
            ids.len(),
            first,
            ids.len() as f64 / first.max(1e-9),
            generated.len().saturating_sub(1),
            decode,
            generated.len().saturating_sub(1) as f64 / decode.max(1e-9)
        );
        Ok(())
    }
}

fn real_main(args: Args) -> Result<(), CliError> {
    if args.list_devices {
        for line in list_devices() {
            println!("{line}");
        }
        return Ok(());
    }
    let threads = args.backend.start_threads()?;
    // Everything the user typed is checked before any download or model load.
    let kind = args.backend.check()?;
    let sampling = SamplingConfig {
        temperature: args.temperature,
        top_k: args.top_k,
        top_p: args.top_p,
        min_p: args.min_p,
        repeat_penalty: args.repeat_penalty,
        repeat_last_n: args.repeat_last_n,
        seed: args.seed,
    };
    sampling.validate()?;
    if (args.thinking || args.system.is_some()) && !args.chat {
        return Err(CliError::from("--thinking and --system shape a chat: add --chat"));
    }
    if args.max_new_tokens == 0 {
        return Err(CliError::from("--max-new-tokens must be at least 1"));
    }
    if let Some(path) = args.mmproj.as_ref().filter(|p| !p.is_file()) {
        return Err(CliError::from(format!("projector {} does not exist", path.display())));
    }
    if (args.mmproj.is_some() || args.pan_and_scan) && args.images.is_empty() {
        return Err(CliError::from("--mmproj and --pan-and-scan read pictures: add --image PATH"));
    }
    if let Some(path) = args.images.iter().find(|p| !p.is_file()) {
        return Err(CliError::from(format!("image {} does not exist", path.display())));
    }
    if let Some(path) = args.draft.as_ref().and_then(DraftArg::path) {
        if !path.exists() {
            return Err(CliError::from(format!("draft model path {} does not exist", path.display())));
        }
    }
    if args.draft_adaptive && args.draft.is_none() {
        return Err(CliError::from(
            "--draft-adaptive adapts a draft: add --draft ngram, --draft model:PATH or --draft assistant:PATH",
        ));
    }
    let prompt = match &args.prompt {
        Some(p) => Some(p.clone()),
        None if !std::io::stdin().is_terminal() && !args.chat => {
            let mut text = String::new();
            std::io::stdin()
                .read_to_string(&mut text)
                .map_err(|source| Error::Io { path: "<stdin>".into(), source })?;
            Some(text)
        }
        None if args.chat => None,
        None => return Err(CliError::from("no prompt: pass --prompt TEXT, pipe text on stdin, or use --chat")),
    };
    if prompt.as_deref().is_some_and(|p| p.trim().is_empty()) {
        return Err(CliError::from("the prompt is empty"));
    }
    let model_path = match &args.model {
        Some(path) => {
            if !path.exists() {
                return Err(CliError::from(format!("model path {} does not exist", path.display())));
            }
            path.clone()
        }
        None => {
            let bar = progress_bar("fetching");
            let path = burn_gemma::fetch::default_model(|done, total| {
                bar.set_length(total as u64);
                bar.set_position(done as u64);
            })?;
            bar.finish_and_clear();
            path
        }
    };

    let interrupt = Arc::new(AtomicBool::new(false));
    let presses = Arc::new(AtomicUsize::new(0));
    {
        let interrupt = interrupt.clone();
        let _ = ctrlc::set_handler(move || {
            if presses.fetch_add(1, Ordering::SeqCst) >= 1 {
                std::process::exit(130);
            }
            interrupt.store(true, Ordering::SeqCst);
        });
    }
    let generation = GenerationConfig {
        max_new_tokens: args.max_new_tokens,
        sampling,
        stop_tokens: Vec::new(),
        stop_strings: args.stop_strings.clone(),
        cuda_graph: args.cuda_graph,
        prefill_chunk: args.prefill_chunk,
    };
    let run = Run { args, model_path, prompt, generation, interrupt, threads };
    dispatch(kind, run, &mut |note| eprintln!("{note}"))?
}

fn main() -> ExitCode {
    let args = Args::parse();
    match real_main(args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}
