//! Errors raised while configuring, loading or running a model.

/// Something is wrong with a config, a checkpoint, or a request to the model.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    /// The config could not be parsed.
    #[error("config is not valid JSON for a Gemma model: {0}")]
    ConfigJson(#[from] serde_json::Error),
    /// The checkpoint is for another architecture.
    #[error("not a Gemma model: model_type / architecture is {0:?} (expected gemma, gemma2, gemma3(_text), gemma4(_text) or gemma4_unified(_text))")]
    NotGemma(String),
    /// A config value is missing or out of range.
    #[error("invalid config: `{field}` {reason}")]
    InvalidConfig { field: &'static str, reason: String },
    /// A config value has the wrong type; `path` names it as it sits in the JSON
    /// (`text_config.num_hidden_layers`, `layer_types[3]`).
    #[error("invalid config: `{path}`: {reason}")]
    ConfigValue { path: String, reason: String },
    /// A config value names a feature this crate does not implement.
    #[error("unsupported config: `{field}` = {value}")]
    UnsupportedConfig { field: &'static str, value: String },
    /// A weight the config calls for is not in the checkpoint.
    #[error("missing tensor `{0}` in the checkpoint")]
    MissingTensor(String),
    /// A weight's shape disagrees with the config.
    #[error("tensor `{name}` has shape {actual:?}, but the config implies {expected:?}")]
    ShapeMismatch { name: String, expected: Vec<usize>, actual: Vec<usize> },
    /// A weight's storage type cannot be read.
    #[error("tensor `{name}` has unsupported dtype {dtype}")]
    UnsupportedTensorDtype { name: String, dtype: String },
    /// The backend cannot hold tensors of the requested dtype.
    #[error("the {backend} backend does not support dtype {dtype:?}; choose another --dtype (f32 works everywhere)")]
    BackendDtype { backend: String, dtype: burn::tensor::DType },
    /// An allocation the device cannot hold, refused before it is attempted.
    #[error("{what}: {asked} bytes asked, {available} available ({limit})")]
    DeviceMemory { what: String, asked: u64, available: u64, limit: &'static str },
    /// The sequence does not fit in the KV cache.
    #[error("context overflow: {needed} positions needed but the KV cache holds {capacity}")]
    ContextOverflow { needed: usize, capacity: usize },
    /// A paged KV cache has too few free blocks for a sequence now (others hold them).
    #[error("the paged KV cache has {available} free blocks of {block_size} positions, {needed} needed")]
    KvBlocks { needed: usize, available: usize, block_size: usize },
    /// The input is malformed (for example an empty batch or token ids past the vocabulary).
    #[error("invalid input: {0}")]
    InvalidInput(String),
    /// A weight cannot be quantized to the requested format.
    #[error("cannot quantize `{name}`: {source}")]
    Quantize { name: String, source: burn_gemma_kernels::quant::QuantError },
    /// A weight cannot be put in the backend's layout (GGUF blocks that do not convert).
    #[error("cannot upload `{name}`: {source}")]
    Upload { name: String, source: burn_gemma_kernels::quant::QuantError },
    /// A result could not be read back from the device.
    #[error("reading {what} back from the device failed: {reason}")]
    ReadBack { what: &'static str, reason: String },
    /// A layer's KV store was lost when an earlier step failed (a device read failed while the
    /// store was being written); make a new cache.
    #[error("the KV cache lost a layer's store when an earlier step failed; make a new cache")]
    CacheLost,
    /// A sequence copied between KV caches (or within one) that do not hold it alike, or to a
    /// sequence the cache does not have.
    #[error("cannot copy a KV cache sequence: {0}")]
    CacheMismatch(String),
    /// A model cannot be split over the devices asked for, or the shards could not meet.
    #[error("tensor parallelism: {0}")]
    TensorParallel(String),
    /// Decode could not be recorded or replayed as a CUDA graph.
    #[error(transparent)]
    Graph(#[from] burn_gemma_kernels::graph::GraphError),
    /// The weight source failed (I/O, format).
    #[error(transparent)]
    Source(Box<dyn std::error::Error + Send + Sync>),
}

impl From<burn_gemma_kernels::ReadBackError> for ModelError {
    fn from(e: burn_gemma_kernels::ReadBackError) -> Self {
        Self::ReadBack { what: e.what, reason: e.reason }
    }
}
