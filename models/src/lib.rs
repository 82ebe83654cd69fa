//! The Gemma model definition (Gemma 1, 2, 3 and 4) for Burn.
//!
//! One config-driven definition covers the four generations; [`GemmaConfig`] says which parts a
//! checkpoint has (QK-norm, sandwich norms, softcapping, sliding-window layers, per-layer RoPE,
//! and Gemma 4's second attention shape, shared KV layers, per-layer embeddings and experts).
//! The hot operations go through [`burn_gemma_kernels::GemmaBackend`], so the same code runs on
//! every backend.

pub mod assistant;
pub mod attention;
pub mod batch_graph;
pub mod config;
pub mod decode_graph;
pub mod decoder_layer;
pub mod embedding;
pub mod error;
pub mod hf_config;
pub mod mlp;
pub mod model;
pub mod moe;
pub mod norm;
pub mod per_layer;
pub mod projection;
pub mod rope;
pub mod tensor_parallel;
pub mod vision;
pub mod weights;

pub use assistant::{AssistantConfig, DraftInput, DraftOutput, Gemma4Assistant, OrderedEmbeddings};
pub use attention::{
    BlockSet, BlockShortfall, KvCache, PagedLayout, QueryRows, Reservation, RewindPoint, StoredRows, WindowStore,
};
pub use batch_graph::BatchGraphs;
pub use burn_gemma_kernels::{KvFormat, Matrix, StepRows};
pub use config::{Architecture, GemmaConfig, ImageAttention, KvSource, LayerType, MoeConfig, NormScale, RopeConfig};
pub use decode_graph::{bucket_bound, CudaGraph, DecodeGraphs, GraphSetup};
pub use error::ModelError;
pub use hf_config::HfConfig;
pub use model::{Gemma, ImageEmbeds, ModelOptions, StepInputs};
pub use tensor_parallel::{AllReduce, HostAllReduce, Shard, ShardedSource, TensorParallel};
pub use vision::{Gemma3Vision, Gemma3VisionConfig, Gemma4ImageConfig, Gemma4Patches, Gemma4Vision};
pub use weights::{RandomWeights, WeightFormat, WeightSource};
