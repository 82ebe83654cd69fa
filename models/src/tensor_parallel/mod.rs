//! Tensor parallelism (Megatron-style): one model split over `world` devices, each holding a
//! shard of every layer's attention and MLP and computing its part of every token.
//!
//! - `q_proj`, `k_proj` and `v_proj` are split by heads and `gate_proj` / `up_proj` by their
//!   output rows ("column parallel"): a shard computes its own heads and its own slice of the
//!   MLP's width from the whole hidden state, with no communication.
//! - `o_proj` and `down_proj` are split by their input columns ("row parallel"): each shard's
//!   product is a partial sum of the layer's output, and an all-reduce ([`AllReduce`]) adds the
//!   shards' partial sums before the post-norm, so every shard continues with the same hidden
//!   state.
//! - Keys and values follow their query heads: a model with fewer KV heads than shards (MQA, or
//!   Gemma 4's full-attention layers) gives each shard the one KV head its queries read, so the
//!   KV cache splits with the heads where it can and is replicated where it cannot.
//! - The tied embedding table stays whole on each shard for the lookup (one row per token); the
//!   lm_head reads only the shard's slice of the vocabulary, and the slices are joined before
//!   sampling.
//! - Everything else (norms, Gemma 4's per-layer inputs and routed experts) is replicated.
//!
//! Only one operation crosses devices: the all-reduce. [`HostAllReduce`] runs it through the
//! host (the shards of one process on CPU backends, and the tests); on CUDA the crate's
//! `tensor_parallel` module runs it through NCCL.

mod host;
mod source;

pub use host::HostAllReduce;
pub use source::ShardedSource;

use crate::{GemmaConfig, ModelError};
use burn::tensor::{backend::Backend, Tensor};
use std::{any::Any, ops::Range, sync::Arc};

/// One device's part of a model split over `world` devices.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shard {
    rank: usize,
    world: usize,
}

impl Shard {
    /// Shard `rank` of `world` (`rank < world`).
    pub fn new(rank: usize, world: usize) -> Result<Self, ModelError> {
        if world == 0 || rank >= world {
            return Err(ModelError::TensorParallel(format!(
                "shard {rank} of {world}: the rank must be below the shard count"
            )));
        }
        Ok(Self { rank, world })
    }

    /// This shard's index.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// How many shards the model is split into.
    pub fn world(&self) -> usize {
        self.world
    }

    /// This shard's part of `n` items split into `world` consecutive parts of near-equal size.
    pub fn part(&self, n: usize) -> Range<usize> {
        n * self.rank / self.world..n * (self.rank + 1) / self.world
    }

    /// The KV heads (of `kv_heads`) this shard's query heads read: its part where the heads
    /// split among the shards, else the one head its queries share.
    pub(crate) fn kv_heads(&self, kv_heads: usize) -> Range<usize> {
        if kv_heads >= self.world {
            self.part(kv_heads)
        } else {
            let head = self.rank * kv_heads / self.world;
            head..head + 1
        }
    }

    /// The config of this shard's layers: `config` with its query heads, KV heads and MLP width
    /// divided among the shards (the vocabulary, hidden size and everything replicated kept).
    /// Refuses a model whose heads or MLP width do not divide by the shard count.
    pub fn config(&self, config: &GemmaConfig) -> Result<GemmaConfig, ModelError> {
        let world = self.world;
        let refuse = |what: &str, n: usize| {
            Err(ModelError::TensorParallel(format!(
                "{what} ({n}) do not split over {world} devices; choose a tensor-parallel size that divides it"
            )))
        };
        if !config.num_attention_heads.is_multiple_of(world) {
            return refuse("the model's attention heads", config.num_attention_heads);
        }
        for (what, kv) in [
            ("the model's KV heads", config.num_key_value_heads),
            ("the model's full-attention KV heads", config.num_global_key_value_heads),
        ] {
            if !kv.is_multiple_of(world) && !world.is_multiple_of(kv) {
                return Err(ModelError::TensorParallel(format!(
                    "{what} ({kv}) neither split over {world} devices nor divide that count; choose a \
                     tensor-parallel size that divides the heads or that they divide"
                )));
            }
        }
        if !config.intermediate_size.is_multiple_of(world) {
            return refuse("the MLP's width (intermediate_size)", config.intermediate_size);
        }
        let mut local = config.clone();
        local.num_attention_heads /= world;
        local.num_key_value_heads = self.kv_heads(config.num_key_value_heads).len();
        local.num_global_key_value_heads = self.kv_heads(config.num_global_key_value_heads).len();
        local.intermediate_size /= world;
        local.validate()?;
        Ok(local)
    }
}

/// The sum of a tensor over every shard: each shard calls it with its own partial sum, in the
/// same order of calls on every shard, and gets the total.
pub trait AllReduce<B: Backend>: Send + Sync + std::fmt::Debug {
    /// `x` summed over the shards (the same shape and dtype on each), on `x`'s device.
    fn all_reduce(&self, x: Tensor<B, 2>) -> Result<Tensor<B, 2>, ModelError>;

    /// Every shard's `x` (`[rows, cols]`, the same shape on each) stacked in rank order:
    /// `[world * rows, cols]`, shard `r`'s rows at `r * rows`.
    fn all_gather(&self, x: Tensor<B, 2>) -> Result<Tensor<B, 2>, ModelError>;

    /// Releases shards waiting in an all-reduce for a shard that failed, where the
    /// implementation can (the host's can; a device's collective cannot be called back).
    fn abort(&self) {}
}

/// What a shard's model needs at run time: its place and the all-reduce joining it to the
/// others.
#[derive(Debug, Clone)]
pub struct TensorParallel<B: Backend> {
    pub shard: Shard,
    pub reduce: Arc<dyn AllReduce<B>>,
}

impl<B: Backend> TensorParallel<B> {
    /// The shards' partial sums of a layer's output added up: `[batch, seq, hidden]`.
    pub(crate) fn sum(&self, x: Tensor<B, 3>) -> Result<Tensor<B, 3>, ModelError> {
        let [batch, seq, hidden] = x.dims();
        Ok(self.reduce.all_reduce(x.reshape([batch * seq, hidden]))?.reshape([batch, seq, hidden]))
    }

    /// Logits of the whole vocabulary (`vocab` columns) from each shard's slice of them
    /// (`local`, `[rows, part]`, this shard's [`Shard::part`] of the vocabulary): for one row
    /// and a vocabulary that splits evenly (a decode step's, which a CUDA graph records), the
    /// gathered `[world, part]` is the joined row as it is; otherwise each shard places its
    /// slice among zeros and the all-reduce adds them.
    pub(crate) fn join_vocab(&self, local: Tensor<B, 2>, vocab: usize) -> Result<Tensor<B, 2>, ModelError> {
        let [rows, part] = local.dims();
        if rows == 1 && part * self.shard.world == vocab {
            return Ok(self.reduce.all_gather(local)?.reshape([1, vocab]));
        }
        let range = self.shard.part(vocab);
        let (dtype, device) = (local.dtype(), local.device());
        let zeros = |n: usize| Tensor::<B, 2>::zeros([rows, n], (&device, dtype));
        let mut parts = Vec::with_capacity(3);
        if range.start > 0 {
            parts.push(zeros(range.start));
        }
        parts.push(local);
        if range.end < vocab {
            parts.push(zeros(vocab - range.end));
        }
        self.reduce.all_reduce(Tensor::cat(parts, 1))
    }
}

/// A [`TensorParallel`] with its backend type erased, so that a model can hold it beside its
/// modules: Burn's `Module` derive takes any field whose type names the backend for a module.
#[derive(Clone)]
pub(crate) struct ShardLink(Arc<dyn Any + Send + Sync>);

impl ShardLink {
    pub(crate) fn new<B: Backend>(parallel: TensorParallel<B>) -> Self {
        Self(Arc::new(parallel))
    }

    /// The link as it was made (`None` only for another backend, which a model never asks).
    pub(crate) fn get<B: Backend>(&self) -> Option<&TensorParallel<B>> {
        self.0.downcast_ref()
    }
}

impl std::fmt::Debug for ShardLink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ShardLink")
    }
}
