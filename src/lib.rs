//! # burn-gemma
//!
//! Google's Gemma language models (Gemma 1, 2, 3 and 4's text decoders) on the
//! [Burn](https://burn.dev) deep-learning framework, generic over the backend: swap
//! `Gemma<NdArray>` for `Gemma<Candle>`, `Gemma<Wgpu>` or `Gemma<Cuda>` ([`backends`]).
//!
//! ```no_run
//! use burn_gemma::{backends::NdArray, Checkpoint, GenerationConfig, Generator, LoadOptions};
//!
//! # fn main() -> Result<(), burn_gemma::Error> {
//! let path = burn_gemma::fetch::default_model(|_, _| {})?; // Gemma 3 270M, cached
//! let checkpoint = Checkpoint::open(&path)?;
//! let loaded = checkpoint.load(LoadOptions::<NdArray>::new())?;
//! let mut generator = Generator::new(loaded.model, checkpoint.tokenizer()?)?;
//! let config = GenerationConfig { max_new_tokens: 16, ..Default::default() };
//! // Streamed as an iterator of tokens; dropping the stream stops generation.
//! for token in generator.generate_stream("The capital of France is", &config)? {
//!     print!("{}", token?.text);
//! }
//! # Ok(()) }
//! ```
//!
//! Multimodal Gemma 3 and Gemma 4 checkpoints read pictures ([`vision`]: load the tower with
//! [`Checkpoint::load_vision_tower`], or from llama.cpp's projector GGUF with
//! [`MmprojCheckpoint`], hand it to [`Generator::set_vision`] or
//! [`engine::Engine::with_vision`]; Gemma 3's pan-and-scan: [`images::PanAndScan`]).
//!
//! Errors are [`Error`], whose variants carry enums a caller can match ([`RequestError`],
//! [`SamplingError`], [`TokenizerError`], [`FetchError`], [`BackendError`], [`OptionError`],
//! [`ModelError`]).

pub mod backends;
pub mod chat;
pub mod engine;
mod error;
pub mod fetch;
mod floats;
pub mod generation;
pub mod gguf;
mod gguf_config;
pub mod graph_policy;
pub mod images;
mod load_options;
pub mod loader;
pub mod output;
pub mod safetensors;
pub mod sampling;
#[cfg(feature = "server")]
pub mod server;
pub mod speculative;
pub mod tensor_parallel;
pub mod tokenizer;
pub mod vision;

pub use burn_gemma_kernels::{GemmaBackend, QuantFormat};
pub use burn_gemma_model::{
    AssistantConfig, BatchGraphs, BlockSet, BlockShortfall, CudaGraph, Gemma, Gemma3Vision, Gemma3VisionConfig,
    Gemma4Assistant, Gemma4ImageConfig, Gemma4Patches, Gemma4Vision, GemmaConfig, GraphSetup, ImageEmbeds, KvCache,
    KvFormat, ModelError, ModelOptions, PagedLayout, Reservation, StepInputs, StepRows, StoredRows, WeightFormat,
    WeightSource, WindowStore,
};
pub use engine::PrefixCache;
pub use error::{
    BackendError, EngineError, Error, FetchError, OptionError, RequestError, SamplingError, TokenizerError,
};
pub use generation::{
    GenerationConfig, GenerationOutput, Generator, StopReason, Token, TokenStream, DEFAULT_PREFILL_CHUNK,
};
pub use graph_policy::EagerReason;
pub use load_options::{LoadOptions, LoadProgress};
pub use loader::{AssistantCheckpoint, Checkpoint, LoadReport, Loaded, MmprojCheckpoint, MmprojConfig};
pub use sampling::SamplingConfig;
pub use tokenizer::{Bos, Tokenizer};
pub use vision::{ImageProcessor, Picture, Vision};

/// The README's programs, compiled as doc tests (`no_run`: they fetch the default model).
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeProgramsCompile;
