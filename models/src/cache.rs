//! Preallocated KV cache.
//!
//! Global layers keep every position up to the cache capacity. Sliding-window layers keep a ring
//! of the last `W` positions (slot `pos % W`), so their memory does not grow with the context.
//! The cache also holds the RoPE tables for its capacity, since both are sized by the longest
//! sequence it serves.

use crate::{GemmaConfig, LayerType, ModelError};
use burn::tensor::{backend::Backend, s, DType, Tensor};
use burn_gemma_kernels::{rope, AttentionMask};

/// cos/sin tables `[capacity, head_dim / 2]` (f32) for one layer type.
#[derive(Debug, Clone)]
pub struct RopeTables<B: Backend> {
    pub cos: Tensor<B, 2>,
    pub sin: Tensor<B, 2>,
}

/// Keys and values of one layer: `[batch, kv_heads, slots, head_dim]`.
#[derive(Debug)]
struct LayerCache<B: Backend> {
    keys: Option<Tensor<B, 4>>,
    values: Option<Tensor<B, 4>>,
    /// Ring size for sliding-window layers, `None` for global layers.
    window: Option<usize>,
}

/// The KV cache of a whole model, for a fixed batch size and capacity.
#[derive(Debug)]
pub struct KvCache<B: Backend> {
    layers: Vec<LayerCache<B>>,
    len: usize,
    capacity: usize,
    batch: usize,
    rope_full: RopeTables<B>,
    rope_sliding: RopeTables<B>,
}

impl<B: Backend> KvCache<B> {
    /// Allocates a cache for `batch` sequences of up to `capacity` positions, in `dtype`.
    pub fn new(config: &GemmaConfig, batch: usize, capacity: usize, dtype: DType, device: &B::Device) -> Result<Self, ModelError> {
        if batch == 0 || capacity == 0 {
            return Err(ModelError::InvalidInput(format!("KV cache needs a positive batch and capacity, got {batch} and {capacity}")));
        }
        let layers = config
            .layer_types
            .iter()
            .map(|&layer_type| {
                let window = config.window(layer_type);
                let slots = window.map_or(capacity, |w| w.min(capacity));
                let shape = [batch, config.num_key_value_heads, slots, config.head_dim];
                LayerCache {
                    keys: Some(Tensor::zeros(shape, (device, dtype))),
                    values: Some(Tensor::zeros(shape, (device, dtype))),
                    window: window.map(|_| slots),
                }
            })
            .collect();
        let tables = |layer_type: LayerType| {
            let rope_config = config.rope(layer_type);
            let (cos, sin) = rope::tables(capacity, config.head_dim, rope_config.rope_theta, rope_config.factor);
            let shape = [capacity, config.head_dim / 2];
            RopeTables {
                cos: Tensor::from_data(burn::tensor::TensorData::new(cos, shape), (device, DType::F32)),
                sin: Tensor::from_data(burn::tensor::TensorData::new(sin, shape), (device, DType::F32)),
            }
        };
        Ok(Self {
            layers,
            len: 0,
            capacity,
            batch,
            rope_full: tables(LayerType::FullAttention),
            rope_sliding: tables(LayerType::SlidingAttention),
        })
    }

    /// Positions processed so far.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether no position has been processed.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Most positions this cache can hold.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Batch size the cache was allocated for.
    pub fn batch(&self) -> usize {
        self.batch
    }

    /// Forgets every position; the memory is kept for the next sequence.
    pub fn reset(&mut self) {
        self.len = 0;
    }

    /// RoPE tables of a layer type.
    pub fn rope(&self, layer_type: LayerType) -> &RopeTables<B> {
        match layer_type {
            LayerType::FullAttention => &self.rope_full,
            LayerType::SlidingAttention => &self.rope_sliding,
        }
    }

    /// Fails unless `new_tokens` more positions fit.
    pub(crate) fn check_room(&self, new_tokens: usize) -> Result<(), ModelError> {
        let needed = self.len + new_tokens;
        if needed > self.capacity {
            return Err(ModelError::ContextOverflow { needed, capacity: self.capacity });
        }
        Ok(())
    }

    /// Marks `new_tokens` positions as processed (after every layer appended them).
    pub(crate) fn advance(&mut self, new_tokens: usize) {
        self.len += new_tokens;
    }

    /// Appends the keys and values of positions `len..len + t` to layer `layer` and returns the
    /// keys and values to attend to with their mask.
    ///
    /// - `keys`, `values`: `[batch, kv_heads, t, head_dim]`.
    pub(crate) fn append(
        &mut self,
        layer: usize,
        keys: Tensor<B, 4>,
        values: Tensor<B, 4>,
    ) -> (Tensor<B, 4>, Tensor<B, 4>, AttentionMask) {
        let offset = self.len;
        let entry = &mut self.layers[layer];
        let (cache_k, cache_v) = match (entry.keys.take(), entry.values.take()) {
            (Some(k), Some(v)) => (k, v),
            _ => unreachable!("layer cache tensors are always restored after use"),
        };
        let t = keys.dims()[2];
        let (new_k, new_v, out_k, out_v, mask) = match entry.window {
            None => {
                let end = offset + t;
                let cache_k = cache_k.slice_assign(s![.., .., offset..end, ..], keys);
                let cache_v = cache_v.slice_assign(s![.., .., offset..end, ..], values);
                let out_k = cache_k.clone().slice(s![.., .., 0..end, ..]);
                let out_v = cache_v.clone().slice(s![.., .., 0..end, ..]);
                (cache_k, cache_v, out_k, out_v, AttentionMask { q_offset: offset, k_offset: 0, window: None })
            }
            Some(w) if t == 1 => {
                // One new position: after overwriting the oldest slot the ring holds exactly the
                // window, in rotated order; attention does not depend on key order.
                let slot = offset % w;
                let cache_k = cache_k.slice_assign(s![.., .., slot..slot + 1, ..], keys);
                let cache_v = cache_v.slice_assign(s![.., .., slot..slot + 1, ..], values);
                let filled = (offset + 1).min(w);
                let out_k = cache_k.clone().slice(s![.., .., 0..filled, ..]);
                let out_v = cache_v.clone().slice(s![.., .., 0..filled, ..]);
                let mask = AttentionMask { q_offset: offset, k_offset: offset + 1 - filled, window: Some(w) };
                (cache_k, cache_v, out_k, out_v, mask)
            }
            Some(w) => {
                // Several positions: attend over [previous window in order] ++ [new keys], then
                // keep the last `w` positions in the ring.
                let previous = offset.min(w);
                let ordered = |cache: &Tensor<B, 4>| -> Option<Tensor<B, 4>> {
                    if previous == 0 {
                        None
                    } else if offset <= w {
                        Some(cache.clone().slice(s![.., .., 0..offset, ..]))
                    } else {
                        let start = offset % w;
                        Some(Tensor::cat(
                            vec![cache.clone().slice(s![.., .., start..w, ..]), cache.clone().slice(s![.., .., 0..start, ..])],
                            2,
                        ))
                    }
                };
                let join = |old: Option<Tensor<B, 4>>, new: Tensor<B, 4>| match old {
                    Some(old) => Tensor::cat(vec![old, new], 2),
                    None => new,
                };
                let out_k = join(ordered(&cache_k), keys.clone());
                let out_v = join(ordered(&cache_v), values.clone());
                let mask = AttentionMask { q_offset: offset, k_offset: offset - previous, window: Some(w) };
                let kept = t.min(w);
                let first = offset + t - kept;
                let cache_k = write_ring(cache_k, keys.slice(s![.., .., t - kept..t, ..]), first, w);
                let cache_v = write_ring(cache_v, values.slice(s![.., .., t - kept..t, ..]), first, w);
                (cache_k, cache_v, out_k, out_v, mask)
            }
        };
        entry.keys = Some(new_k);
        entry.values = Some(new_v);
        (out_k, out_v, mask)
    }
}

/// Writes `rows` (positions `first..first + n`, `n <= w`) into ring slots `pos % w`.
fn write_ring<B: Backend>(ring: Tensor<B, 4>, rows: Tensor<B, 4>, first: usize, w: usize) -> Tensor<B, 4> {
    let n = rows.dims()[2];
    let start = first % w;
    let head = n.min(w - start);
    let ring = ring.slice_assign(s![.., .., start..start + head, ..], rows.clone().slice(s![.., .., 0..head, ..]));
    if head < n {
        ring.slice_assign(s![.., .., 0..n - head, ..], rows.slice(s![.., .., head..n, ..]))
    } else {
        ring
    }
}
