//! # burn-gemma
//!
//! Google's Gemma language models (Gemma 1, 2 and 3) on the [Burn](https://burn.dev) deep-learning
//! framework, generic over the backend: swap `Gemma<NdArray>` for `Gemma<Wgpu>` or `Gemma<Cuda>`.
//!
//! ```no_run
//! use burn_gemma::{backends::NdArray, Checkpoint, Generator, GenerationConfig};
//!
//! # fn main() -> Result<(), burn_gemma::Error> {
//! let path = burn_gemma::fetch::default_model(|_, _| {})?; // Gemma 3 270M, cached
//! let checkpoint = Checkpoint::open(&path)?;
//! let device = Default::default();
//! let (model, _report) = checkpoint.load_model::<NdArray>(burn::tensor::DType::F32, &device, |_, _| {})?;
//! let tokenizer = checkpoint.tokenizer()?;
//! let mut generator = Generator::new(model, tokenizer)?;
//! let config = GenerationConfig { max_new_tokens: 16, ..Default::default() };
//! let output = generator.generate("The capital of France is", &config, |text| print!("{text}"))?;
//! eprintln!("\n{} tokens", output.tokens.len());
//! # Ok(()) }
//! ```

pub mod backends;
pub mod chat;
mod error;
pub mod fetch;
pub mod generation;
pub mod gguf;
mod load_options;
pub mod loader;
pub mod safetensors;
pub mod sampling;
pub mod tokenizer;

pub use burn_gemma_kernels::{GemmaBackend, QuantFormat};
pub use burn_gemma_model::{
    CudaGraph, Gemma, GemmaConfig, KvCache, KvFormat, ModelError, ModelOptions, WeightFormat, WeightSource,
};
pub use error::{BackendError, Error, FetchError, OptionError, RequestError, SamplingError, TokenizerError};
pub use generation::{
    EagerReason, GenerationConfig, GenerationOutput, Generator, StopReason, Token, TokenStream, DEFAULT_PREFILL_CHUNK,
};
pub use load_options::{LoadOptions, LoadProgress};
pub use loader::{Checkpoint, LoadReport, Loaded};
pub use sampling::SamplingConfig;
pub use tokenizer::{Bos, Tokenizer};
