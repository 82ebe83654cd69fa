//! The crate's error type.

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
    Tokenizer(String),
    #[error("fetching the default model: {0}")]
    Fetch(String),
    #[error("invalid sampling parameter: {0}")]
    Sampling(String),
    #[error("invalid generation request: {0}")]
    Request(String),
    #[error("the logits at generation step {step} contain NaN or infinity; stopping")]
    NonFiniteLogits { step: usize },
    #[error("backend: {0}")]
    Backend(String),
}

impl From<ModelError> for Error {
    fn from(e: ModelError) -> Self {
        Self::Model(Box::new(e))
    }
}
