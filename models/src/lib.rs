//! The Gemma model definition (Gemma 1, 2 and 3) for Burn.
//!
//! One config-driven definition covers the three generations; [`GemmaConfig`] says which parts a
//! checkpoint has (QK-norm, sandwich norms, softcapping, sliding-window layers, per-layer RoPE).
//! The hot operations go through [`burn_gemma_kernels::GemmaBackend`], so the same code runs on
//! every backend.

pub mod attention;
pub mod config;
pub mod decode_graph;
pub mod error;
pub mod gemma;
pub mod norm;
pub mod projection;
pub mod rope;
pub mod weights;

pub use attention::KvCache;
pub use burn_gemma_kernels::{KvFormat, Matrix};
pub use config::{Architecture, GemmaConfig, LayerType, RopeConfig};
pub use decode_graph::{CudaGraph, DecodeGraphs, GraphSetup};
pub use error::ModelError;
pub use gemma::{Gemma, StepInputs};
pub use weights::{RandomWeights, WeightFormat, WeightSource};
