//! Rotary position embeddings of the model, one per layer type (Gemma 3: `rope_theta` and linear
//! scaling on full-attention layers, `rope_local_base_freq` on sliding ones; Gemma 4: a quarter of
//! the pairs rotating on full layers, over their own head size).
//!
//! The kernels read cos/sin tables; the model keeps them on the device for the longest context
//! a cache was made for, building them anew (longer) when a larger cache comes.

use crate::{GemmaConfig, LayerType};
use burn::tensor::backend::Backend;
use burn_gemma_kernels::{Frequencies, RopeTables};
use std::any::Any;
use std::sync::{Arc, RwLock};

/// The rotary embedding of one layer type.
#[derive(Clone)]
pub struct RotaryEmbedding {
    frequencies: Frequencies,
    /// The device tables built last, a `RopeTables<B>` (held without the backend type, so the
    /// model's `Module` derive keeps it out of the weights).
    tables: Arc<RwLock<Option<Box<dyn Any + Send + Sync>>>>,
}

impl std::fmt::Debug for RotaryEmbedding {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RotaryEmbedding").field("frequencies", &self.frequencies).finish_non_exhaustive()
    }
}

impl RotaryEmbedding {
    /// The embedding of `layer_type`'s layers in `config`.
    pub fn new(config: &GemmaConfig, layer_type: LayerType) -> Self {
        let rope = config.rope(layer_type);
        Self {
            frequencies: Frequencies {
                head_dim: config.head_dim_of(layer_type),
                theta: rope.rope_theta,
                factor: rope.factor,
                partial_rotary_factor: rope.partial_rotary_factor,
            },
            tables: Arc::new(RwLock::new(None)),
        }
    }

    /// Tables covering at least positions `0..positions`, on `device`.
    pub fn tables<B: Backend>(&self, positions: usize, device: &B::Device) -> RopeTables<B> {
        let covering = |held: &Option<Box<dyn Any + Send + Sync>>| {
            held.as_ref()
                .and_then(|t| t.downcast_ref::<RopeTables<B>>())
                .filter(|t| t.positions() >= positions && &t.cos.device() == device)
                .cloned()
        };
        // A poisoned lock only means another thread panicked while building tables: build anew.
        if let Some(tables) = self.tables.read().ok().and_then(|held| covering(&held)) {
            return tables;
        }
        // Long-lived like the weights: in the persistent memory, out of the pools that serve every
        // step's activations (CubeCL searches a pool's slices on each allocation).
        let frequencies = self.frequencies;
        let tables = B::memory_persistent_allocations(device, positions, |positions| {
            RopeTables::<B>::new(positions, &frequencies, device)
        });
        if let Ok(mut held) = self.tables.write() {
            *held = Some(Box::new(tables.clone()));
        }
        tables
    }
}

/// One [`RotaryEmbedding`] per layer type.
#[derive(Debug, Clone)]
pub struct RotaryEmbeddings {
    full: RotaryEmbedding,
    sliding: RotaryEmbedding,
}

impl RotaryEmbeddings {
    pub fn new(config: &GemmaConfig) -> Self {
        Self {
            full: RotaryEmbedding::new(config, LayerType::FullAttention),
            sliding: RotaryEmbedding::new(config, LayerType::SlidingAttention),
        }
    }

    /// The tables of every layer type, covering positions `0..positions`.
    pub fn tables<B: Backend>(&self, positions: usize, device: &B::Device) -> LayerTables<B> {
        LayerTables { full: self.full.tables(positions, device), sliding: self.sliding.tables(positions, device) }
    }
}

/// The RoPE tables of each layer type.
#[derive(Debug, Clone)]
pub struct LayerTables<B: Backend> {
    full: RopeTables<B>,
    sliding: RopeTables<B>,
}

impl<B: Backend> LayerTables<B> {
    /// The tables of `layer_type`.
    pub fn get(&self, layer_type: LayerType) -> &RopeTables<B> {
        match layer_type {
            LayerType::FullAttention => &self.full,
            LayerType::SlidingAttention => &self.sliding,
        }
    }
}
