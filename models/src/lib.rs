//! The Gemma model definition (Gemma 1, 2 and 3) for Burn.
//!
//! One config-driven definition covers the three generations; [`GemmaConfig`] says which parts a
//! checkpoint has (QK-norm, sandwich norms, softcapping, sliding-window layers, per-layer RoPE).
//! The hot operations go through [`burn_gemma_kernels::GemmaBackend`], so the same code runs on
//! every backend.

pub mod cache;
pub mod config;
pub mod error;
pub mod gemma;
pub mod weights;

pub use cache::{KvCache, KvFormat};
pub use config::{Architecture, GemmaConfig, LayerType, RopeConfig};
pub use error::ModelError;
pub use gemma::Gemma;
pub use weights::{MatrixWeight, RandomWeights, WeightFormat, WeightSource};
