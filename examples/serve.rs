//! An OpenAI-compatible server for a Gemma model.
//!
//! ```text
//! cargo run --release --features server --example serve -- --port 8080
//! cargo run --release --features server,cuda --example serve -- --model gemma-3-4b-it-Q4_K_M.gguf --host 0.0.0.0 --port 8080
//! curl http://127.0.0.1:8080/v1/chat/completions -H 'content-type: application/json' \
//!   -d '{"model": "gemma", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 32}'
//! ```
//!
//! A multimodal checkpoint (HF Gemma 3 or Gemma 4 with a vision tower, or a Gemma 3 GGUF with
//! `--mmproj`) reads pictures in chat messages' `image_url` parts (`data:` URLs).
//!
//! `--draft ngram` has each request draft by prompt lookup and verify its drafts in the batched
//! steps (greedy replies unchanged, sampled ones keeping the model's distribution).
//!
//! `--tensor-parallel N` splits the model over N devices (CUDA devices joined by NCCL) and
//! answers requests one at a time.
//!
//! `--api-key KEY` (or `--api-key-file`, or `BURN_GEMMA_API_KEY`) makes every route but
//! `/health` and `/ready` ask for `Authorization: Bearer KEY`. Unknown request fields get a 400
//! unless `--ignore-unknown-fields`; CORS is off unless `--cors-origin`.
//!
//! Ctrl-C stops taking connections and lets the requests in flight finish (at most
//! `--shutdown-seconds`).

#[path = "cli/backend_args.rs"]
mod backend_args;

use backend_args::BackendArgs;
use burn_gemma::{
    backends::{dispatch, BackendTask},
    engine::{Engine, EngineConfig, EngineDrafts},
    server::{Access, ApiKey, ConnectionLimits, Cors, RequestLimits, Server, ServerConfig, UnknownFields},
    Checkpoint, GemmaBackend, LoadOptions, Loaded, MmprojCheckpoint,
};
use clap::Parser;
use std::{num::NonZeroUsize, path::PathBuf, process::ExitCode, time::Duration};

type CliError = Box<dyn std::error::Error>;

#[derive(Parser, Debug, Clone)]
#[command(about = "Serve a Gemma model over an OpenAI-compatible HTTP API")]
struct Args {
    /// A GGUF file or a Hugging Face directory; default: Gemma 3 270M (fetched once, cached).
    #[arg(long)]
    model: Option<PathBuf>,
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    #[arg(long, default_value_t = 8080)]
    port: u16,
    /// The model name `/v1/models` lists; default: the file's or directory's name.
    #[arg(long)]
    model_id: Option<String>,
    /// Requests generating at once.
    #[arg(long, default_value_t = NonZeroUsize::new(16).unwrap_or(NonZeroUsize::MIN))]
    max_running: NonZeroUsize,
    /// Requests waiting beyond those; one more gets a 429.
    #[arg(long, default_value_t = 256)]
    max_waiting: usize,
    /// Tokens a round of the engine runs: one per generating request, then prompt chunks.
    #[arg(long, default_value_t = NonZeroUsize::new(2048).unwrap_or(NonZeroUsize::MIN))]
    round_tokens: NonZeroUsize,
    /// Positions (prompt and generated) each request may hold (at most the model's context).
    #[arg(long, default_value_t = NonZeroUsize::new(4096).unwrap_or(NonZeroUsize::MIN))]
    max_sequence_len: NonZeroUsize,
    /// KV positions over all running requests (per layer): requests hold KV blocks for their
    /// prompt and max_tokens, and wait while the free blocks do not cover them. Default:
    /// --max-running x --max-sequence-len, so that none waits.
    #[arg(long)]
    kv_positions: Option<NonZeroUsize>,
    /// Batched decode steps replayed as CUDA graphs: auto (on CUDA where they can be
    /// recorded), on or off.
    #[arg(long, default_value_t = burn_gemma::CudaGraph::Auto)]
    cuda_graph: burn_gemma::CudaGraph,
    /// Prompts' blocks kept for later prompts that begin alike (a shared system prompt, the
    /// choices of one request), which then run only the rest: on or off.
    #[arg(long, default_value_t = burn_gemma::PrefixCache::On)]
    prefix_cache: burn_gemma::PrefixCache,
    /// Drafts each request verifies in its batched steps (speculative decoding, each request on
    /// its own): `ngram` (prompt lookup over its prompt and output: pays on editing,
    /// summarizing, code) or `off`. With drafts the KV cache keeps every position of the
    /// sliding-window layers (a full layer's memory each).
    #[arg(long, value_enum, default_value_t = ServerDraft::Off)]
    draft: ServerDraft,
    /// Most tokens a request drafts per step.
    #[arg(long, default_value_t = NonZeroUsize::new(4).unwrap_or(NonZeroUsize::MIN))]
    draft_tokens: NonZeroUsize,
    /// llama.cpp's vision projector GGUF (`mmproj`) for a Gemma 3 or Gemma 4 text GGUF:
    /// pictures in chat messages. (An HF multimodal checkpoint's own tower is loaded without it.)
    #[arg(long)]
    mmproj: Option<PathBuf>,
    /// Gemma 3: also read each elongated picture as 2-4 crops (HF's pan-and-scan, its default
    /// sizes), each its own image in the prompt after the whole one.
    #[arg(long)]
    pan_and_scan: bool,
    /// Splits the model over N devices (tensor parallelism: CUDA devices from `--device` on,
    /// joined by NCCL, or N shards on a CPU backend). Requests are then answered one at a time
    /// (no batching, paging, prefix cache, drafts or pictures).
    #[arg(long, default_value_t = NonZeroUsize::MIN)]
    tensor_parallel: NonZeroUsize,
    /// `max_tokens` of a request that gives none (cut to the room its prompt leaves).
    #[arg(long, default_value_t = 256)]
    default_max_tokens: usize,
    #[command(flatten)]
    http: HttpArgs,
    #[command(flatten)]
    backend: BackendArgs,
}

/// Who may call the server, and the limits of requests and connections.
#[derive(clap::Args, Debug, Clone)]
struct HttpArgs {
    /// A key clients must send as `Authorization: Bearer KEY` (repeat for several). Also read
    /// from `BURN_GEMMA_API_KEY`.
    #[arg(long = "api-key", env = "BURN_GEMMA_API_KEY", value_delimiter = ',')]
    api_keys: Vec<String>,
    /// A file of keys, one a line.
    #[arg(long)]
    api_key_file: Option<PathBuf>,
    /// An origin whose web pages may read the answers (`https://app.example.com`; repeat for
    /// several; `*` for any). Default: none.
    #[arg(long = "cors-origin")]
    cors_origins: Vec<String>,
    /// Ignore request fields the server does not know (named in the `x-ignored-fields` header)
    /// instead of answering 400. Fields it knows and does not implement are refused either way.
    #[arg(long)]
    ignore_unknown_fields: bool,
    /// Connections open at once; one more gets a 503.
    #[arg(long, default_value_t = 1024)]
    max_connections: usize,
    /// Bytes of a request body.
    #[arg(long, default_value_t = 32 << 20)]
    max_body_bytes: usize,
    /// Bytes of a prompt's text.
    #[arg(long, default_value_t = 1 << 20)]
    max_prompt_bytes: usize,
    /// Pictures per request.
    #[arg(long, default_value_t = 8)]
    max_images: usize,
    /// Seconds a client has to send a request's headers (also how long an idle connection stays).
    #[arg(long, default_value_t = 30)]
    header_seconds: u64,
    /// Seconds a client has to send a request's body.
    #[arg(long, default_value_t = 60)]
    body_seconds: u64,
    /// Seconds one write may wait for a client to read; then its connection is closed.
    #[arg(long, default_value_t = 30)]
    write_seconds: u64,
    /// Seconds the requests in flight get to finish after Ctrl-C.
    #[arg(long, default_value_t = 30)]
    shutdown_seconds: u64,
}

impl HttpArgs {
    /// The server's configuration for `model_id`.
    fn config(&self, model_id: String, default_max_tokens: usize) -> Result<ServerConfig, CliError> {
        let mut keys = self.api_keys.clone();
        if let Some(file) = &self.api_key_file {
            let text = std::fs::read_to_string(file).map_err(|e| format!("--api-key-file {}: {e}", file.display()))?;
            keys.extend(text.lines().map(str::trim).filter(|l| !l.is_empty()).map(str::to_string));
        }
        let api_keys = keys.iter().map(|k| ApiKey::new(k)).collect::<Result<Vec<_>, _>>()?;
        let cors = match &self.cors_origins[..] {
            [] => Cors::Off,
            origins if origins.iter().any(|o| o == "*") => Cors::AnyOrigin,
            origins => Cors::Origins(origins.to_vec()),
        };
        let defaults = ServerConfig::default();
        Ok(ServerConfig {
            model_id,
            default_max_tokens,
            limits: RequestLimits {
                max_body_bytes: self.max_body_bytes,
                max_prompt_bytes: self.max_prompt_bytes,
                max_images: self.max_images,
                ..defaults.limits
            },
            connections: ConnectionLimits {
                max_connections: self.max_connections,
                header_timeout: Duration::from_secs(self.header_seconds),
                body_timeout: Duration::from_secs(self.body_seconds),
                write_timeout: Duration::from_secs(self.write_seconds),
                shutdown_deadline: Duration::from_secs(self.shutdown_seconds),
            },
            access: Access { api_keys, cors },
            unknown_fields: match self.ignore_unknown_fields {
                true => UnknownFields::Ignore,
                false => UnknownFields::Refuse,
            },
        })
    }
}

/// Where `--draft` takes drafts from (the engine drafts by prompt lookup; a draft model or a
/// Gemma 4 assistant drafts in `generate`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum ServerDraft {
    Off,
    Ngram,
}

struct Run {
    args: Args,
    model_path: PathBuf,
}

impl BackendTask for Run {
    type Output = Result<(), CliError>;

    fn run<B: GemmaBackend>(self, device: B::Device, name: &str) -> Result<(), CliError> {
        let args = self.args;
        let (weights, dtype, kv_cache) = args.backend.formats(name)?;
        eprintln!("backend: {name}, device: {device:?}, dtype: {dtype:?}, weights: {weights}, KV cache: {kv_cache}");
        let checkpoint = Checkpoint::open(&self.model_path)?;
        let model_id = args.model_id.clone().unwrap_or_else(|| {
            self.model_path.file_stem().map_or_else(|| "gemma".into(), |s| s.to_string_lossy().into_owned())
        });
        let server_config = args.http.config(model_id, args.default_max_tokens)?;
        if args.tensor_parallel.get() > 1 {
            if args.mmproj.is_some() || args.draft != ServerDraft::Off || args.pan_and_scan {
                return Err(CliError::from(
                    "--tensor-parallel serves text alone: leave out --mmproj, --draft and --pan-and-scan",
                ));
            }
            let world = args.tensor_parallel.get();
            let (devices, reduces) = burn_gemma::tensor_parallel::split_devices::<B>(&device, world)?;
            let options = |d: &B::Device| {
                LoadOptions::<B>::new().device(d.clone()).dtype(dtype).weights(weights).kv_cache(kv_cache)
            };
            let mut model = burn_gemma::tensor_parallel::ShardedModel::load(&checkpoint, &devices, options, reduces)?;
            model.set_cuda_graph(args.cuda_graph)?;
            eprintln!("the model split over {world} devices; requests answered one at a time");
            let config = EngineConfig {
                max_waiting: args.max_waiting,
                max_sequence_len: args.max_sequence_len,
                ..EngineConfig::default()
            };
            let engine = Engine::sharded(model, checkpoint.tokenizer()?, config)?;
            return serve(Server::new(engine, server_config)?, &args.host, args.port);
        }
        let options = LoadOptions::<B>::new().device(device.clone()).dtype(dtype).weights(weights).kv_cache(kv_cache);
        let Loaded { model, .. } = checkpoint.load(options)?;
        let tokenizer = checkpoint.tokenizer()?;
        let options = LoadOptions::<B>::new().device(device).dtype(dtype).weights(weights);
        let vision = match (&args.mmproj, checkpoint.has_vision()) {
            (Some(mmproj), _) => Some(MmprojCheckpoint::open(mmproj, &tokenizer)?.load(options)?),
            (None, true) => Some(checkpoint.load_vision_tower(options)?),
            (None, false) => None,
        };
        if vision.is_some() {
            eprintln!("reading pictures (image_url parts of chat messages)");
        }
        drop(checkpoint);
        let config = EngineConfig {
            max_running: args.max_running,
            max_waiting: args.max_waiting,
            round_tokens: args.round_tokens,
            max_sequence_len: args.max_sequence_len,
            kv_positions: args.kv_positions,
            cuda_graph: args.cuda_graph,
            prefix_cache: args.prefix_cache,
            drafts: match args.draft {
                ServerDraft::Off => EngineDrafts::Off,
                ServerDraft::Ngram => EngineDrafts::PromptLookup { tokens: args.draft_tokens },
            },
            ..EngineConfig::default()
        };
        let mut engine = Engine::with_vision(model, vision, tokenizer, config)?;
        if args.pan_and_scan {
            engine.set_pan_and_scan(Some(burn_gemma::images::PanAndScan::default()))?;
        }
        serve(Server::new(engine, server_config)?, &args.host, args.port)
    }
}

/// Serves `server` on `host:port` until Ctrl-C, then lets the requests in flight finish.
fn serve(server: std::sync::Arc<Server>, host: &str, port: u16) -> Result<(), CliError> {
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    runtime.block_on(async {
        let listener = tokio::net::TcpListener::bind((host, port)).await?;
        eprintln!("serving on http://{}", listener.local_addr()?);
        let shutdown = async {
            let _ = tokio::signal::ctrl_c().await;
            eprintln!("shutting down: finishing the requests in flight");
        };
        server.serve(listener, shutdown).await
    })?;
    Ok(())
}

fn real_main(args: Args) -> Result<(), CliError> {
    args.backend.start_threads()?;
    let kind = args.backend.check()?;
    if args.default_max_tokens == 0 {
        return Err(CliError::from("--default-max-tokens must be at least 1"));
    }
    let model_path = match &args.model {
        Some(path) if !path.exists() => {
            return Err(CliError::from(format!("model path {} does not exist", path.display())))
        }
        Some(path) => path.clone(),
        None => {
            burn_gemma::fetch::default_model(|done, total| eprintln!("fetching the default model: {done}/{total}"))?
        }
    };
    dispatch(kind, Run { args, model_path }, &mut |note| eprintln!("{note}"))?
}

fn main() -> ExitCode {
    match real_main(Args::parse()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}
