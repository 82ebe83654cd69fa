//! Preallocated KV cache.
//!
//! Global layers keep every position up to the cache capacity. Sliding-window layers keep a ring
//! of the last `W` positions (slot `pos % W`), so their memory does not grow with the context.
//! The cache also holds the RoPE tables for its capacity, since both are sized by the longest
//! sequence it serves.

use crate::{GemmaConfig, LayerType, ModelError};
use burn::tensor::{backend::Backend, s, DType, Tensor};
use burn_gemma_kernels::{rope, AttentionMask, GemmaBackend, Int8Kv, KvStore as Storage, QkvLayout};

/// How keys and values are stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KvFormat {
    /// Dense in this dtype (f32, f16 or bf16).
    Dense(DType),
    /// int8 codes with one f32 scale per (sequence, KV head, position), quantized on append;
    /// attention reads the codes directly.
    Int8,
}

impl std::fmt::Display for KvFormat {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Dense(DType::BF16) => f.write_str("bf16"),
            Self::Dense(DType::F16) => f.write_str("f16"),
            Self::Dense(DType::F32) => f.write_str("f32"),
            Self::Dense(other) => write!(f, "{other:?}"),
            Self::Int8 => f.write_str("int8"),
        }
    }
}

/// cos/sin tables `[capacity, head_dim / 2]` (f32) for one layer type.
#[derive(Debug, Clone)]
pub struct RopeTables<B: Backend> {
    pub cos: Tensor<B, 2>,
    pub sin: Tensor<B, 2>,
}

/// Keys and values of one layer: `[batch, kv_heads, slots, head_dim]`.
#[derive(Debug)]
struct LayerCache<B: GemmaBackend> {
    storage: Option<Storage<B>>,
    /// Ring size for sliding-window layers, `None` for global layers.
    window: Option<usize>,
}

/// The KV cache of a whole model, for a fixed batch size and capacity.
#[derive(Debug)]
pub struct KvCache<B: GemmaBackend> {
    layers: Vec<LayerCache<B>>,
    len: usize,
    capacity: usize,
    batch: usize,
    rope_full: RopeTables<B>,
    rope_sliding: RopeTables<B>,
}

impl<B: GemmaBackend> KvCache<B> {
    /// Allocates a cache for `batch` sequences of up to `capacity` positions, stored as `format`.
    pub fn new(
        config: &GemmaConfig,
        batch: usize,
        capacity: usize,
        format: KvFormat,
        device: &B::Device,
    ) -> Result<Self, ModelError> {
        if batch == 0 || capacity == 0 {
            return Err(ModelError::InvalidInput(format!(
                "KV cache needs a positive batch and capacity, got {batch} and {capacity}"
            )));
        }
        match format {
            KvFormat::Int8 if config.head_dim % 4 != 0 => {
                return Err(ModelError::InvalidInput(format!(
                    "an int8 KV cache needs head_dim divisible by 4, the model has {}",
                    config.head_dim
                )));
            }
            KvFormat::Dense(dtype)
                if !matches!(dtype, DType::F32 | DType::F16 | DType::BF16) || !B::supports_dtype(device, dtype) =>
            {
                return Err(ModelError::BackendDtype { backend: B::name(device), dtype });
            }
            _ => {}
        }
        let layers = config
            .layer_types
            .iter()
            .map(|&layer_type| {
                let window = config.window(layer_type);
                let slots = window.map_or(capacity, |w| w.min(capacity));
                let shape = [batch, config.num_key_value_heads, slots, config.head_dim];
                let storage = match format {
                    KvFormat::Dense(dtype) => Storage::Dense {
                        keys: Tensor::zeros(shape, (device, dtype)),
                        values: Tensor::zeros(shape, (device, dtype)),
                    },
                    KvFormat::Int8 => {
                        Storage::Int8 { keys: B::kv_int8_zeros(shape, device), values: B::kv_int8_zeros(shape, device) }
                    }
                };
                LayerCache { storage: Some(storage), window: window.map(|_| slots) }
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

    /// Appends the keys and values of positions `len..len + t` to layer `layer` and attends to
    /// them and the layer's earlier positions (causal, the layer's window).
    ///
    /// - `q`: `[batch, q_heads, t, head_dim]`; `keys`, `values`: `[batch, kv_heads, t, head_dim]`;
    /// - returns `[batch, q_heads, t, head_dim]`.
    pub(crate) fn attend(
        &mut self,
        layer: usize,
        q: Tensor<B, 4>,
        keys: Tensor<B, 4>,
        values: Tensor<B, 4>,
        scale: f64,
        softcap: Option<f64>,
    ) -> Tensor<B, 4> {
        let offset = self.len;
        let entry = &mut self.layers[layer];
        let window = entry.window;
        let Some(storage) = entry.storage.take() else { unreachable!("layer storage is always restored after use") };
        let (storage, out) = match storage {
            Storage::Dense { keys: cache_k, values: cache_v } => {
                let (cache_k, cache_v, out_k, out_v, mask) =
                    append_dense(cache_k, cache_v, keys, values, offset, window);
                let out = B::grouped_attention(q, out_k, out_v, mask, scale, softcap);
                (Storage::Dense { keys: cache_k, values: cache_v }, out)
            }
            Storage::Int8 { keys: cache_k, values: cache_v } => {
                attend_int8(cache_k, cache_v, q, keys, values, offset, window, scale, softcap)
            }
        };
        entry.storage = Some(storage);
        out
    }

    /// Decode: appends one position per sequence from the joined projection `qkv` (`[batch,
    /// width]`, see [`QkvLayout`]; its `position` is this cache's length) and attends to the
    /// layer's positions. Returns `[batch, q_heads, 1, head_dim]`.
    pub(crate) fn attend_decode(
        &mut self,
        layer: usize,
        qkv: Tensor<B, 2>,
        layout: &QkvLayout<B>,
        scale: f64,
        softcap: Option<f64>,
    ) -> Tensor<B, 4> {
        let offset = self.len;
        let entry = &mut self.layers[layer];
        let Some(storage) = entry.storage.take() else { unreachable!("layer storage is always restored after use") };
        // A ring holds the window in rotated order once full; attention does not depend on key
        // order, and every key in the ring is inside the window.
        let (slot, filled, mask) = match entry.window {
            None => (offset, offset + 1, AttentionMask { q_offset: offset, k_offset: 0, window: None }),
            Some(w) => {
                let filled = (offset + 1).min(w);
                (offset % w, filled, ring_mask(offset, filled, w))
            }
        };
        let (q, storage) = B::qkv_rope_append(qkv, layout, storage, slot);
        let out = match &storage {
            Storage::Dense { keys, values } => {
                let (k, v) =
                    (keys.clone().slice(s![.., .., 0..filled, ..]), values.clone().slice(s![.., .., 0..filled, ..]));
                B::grouped_attention(q, k, v, mask, scale, softcap)
            }
            Storage::Int8 { keys, values } => B::grouped_attention_int8(q, keys, values, filled, mask, scale, softcap),
        };
        entry.storage = Some(storage);
        out
    }

    /// Bytes the keys and values occupy on the device.
    pub fn device_bytes(&self) -> usize {
        let size4 = |t: &Tensor<B, 4>| t.shape().num_elements() * t.dtype().size();
        let int8 = |kv: &Int8Kv<B>| {
            kv.codes.shape().num_elements() * kv.codes.dtype().size() + kv.scales.shape().num_elements() * 4
        };
        self.layers
            .iter()
            .map(|l| match &l.storage {
                Some(Storage::Dense { keys, values }) => size4(keys) + size4(values),
                Some(Storage::Int8 { keys, values }) => int8(keys) + int8(values),
                None => 0,
            })
            .sum()
    }
}

/// Dense append: writes positions `offset..offset + t` and returns the caches and the keys and
/// values to attend to with their mask.
fn append_dense<B: Backend>(
    cache_k: Tensor<B, 4>,
    cache_v: Tensor<B, 4>,
    keys: Tensor<B, 4>,
    values: Tensor<B, 4>,
    offset: usize,
    window: Option<usize>,
) -> (Tensor<B, 4>, Tensor<B, 4>, Tensor<B, 4>, Tensor<B, 4>, AttentionMask) {
    let t = keys.dims()[2];
    match window {
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
            (cache_k, cache_v, out_k, out_v, ring_mask(offset, filled, w))
        }
        Some(w) => {
            // Several positions: attend over [previous window in order] ++ [new keys], then
            // keep the last `w` positions in the ring.
            let ordered = |cache: &Tensor<B, 4>| ordered_window(offset, w, |r| cache.clone().slice(s![.., .., r, ..]));
            let out_k = join(ordered(&cache_k), keys.clone());
            let out_v = join(ordered(&cache_v), values.clone());
            let mask = AttentionMask { q_offset: offset, k_offset: offset - offset.min(w), window: Some(w) };
            let (mut cache_k, mut cache_v) = (cache_k, cache_v);
            for (rows, slot) in ring_writes(offset, t, w) {
                let slots = s![.., .., slot..slot + rows.len(), ..];
                cache_k = cache_k.slice_assign(slots, keys.clone().slice(s![.., .., rows.clone(), ..]));
                cache_v = cache_v.slice_assign(slots, values.clone().slice(s![.., .., rows, ..]));
            }
            (cache_k, cache_v, out_k, out_v, mask)
        }
    }
}

/// int8 append and attention: decode and global layers attend over the codes directly;
/// a multi-position window attends over the dequantized window and the new (unquantized) rows.
#[allow(clippy::too_many_arguments)]
fn attend_int8<B: GemmaBackend>(
    cache_k: Int8Kv<B>,
    cache_v: Int8Kv<B>,
    q: Tensor<B, 4>,
    keys: Tensor<B, 4>,
    values: Tensor<B, 4>,
    offset: usize,
    window: Option<usize>,
    scale: f64,
    softcap: Option<f64>,
) -> (Storage<B>, Tensor<B, 4>) {
    let t = keys.dims()[2];
    match window {
        None => {
            let cache_k = B::kv_int8_store(cache_k, keys, offset);
            let cache_v = B::kv_int8_store(cache_v, values, offset);
            let mask = AttentionMask { q_offset: offset, k_offset: 0, window: None };
            let out = B::grouped_attention_int8(q, &cache_k, &cache_v, offset + t, mask, scale, softcap);
            (Storage::Int8 { keys: cache_k, values: cache_v }, out)
        }
        Some(w) if t == 1 => {
            let slot = offset % w;
            let cache_k = B::kv_int8_store(cache_k, keys, slot);
            let cache_v = B::kv_int8_store(cache_v, values, slot);
            let filled = (offset + 1).min(w);
            let out =
                B::grouped_attention_int8(q, &cache_k, &cache_v, filled, ring_mask(offset, filled, w), scale, softcap);
            (Storage::Int8 { keys: cache_k, values: cache_v }, out)
        }
        Some(w) => {
            let dtype = q.dtype();
            let out_k = join(ordered_window(offset, w, |r| B::kv_int8_load(&cache_k, r, dtype)), keys.clone());
            let out_v = join(ordered_window(offset, w, |r| B::kv_int8_load(&cache_v, r, dtype)), values.clone());
            let mask = AttentionMask { q_offset: offset, k_offset: offset - offset.min(w), window: Some(w) };
            let out = B::grouped_attention(q, out_k, out_v, mask, scale, softcap);
            let (mut cache_k, mut cache_v) = (cache_k, cache_v);
            for (rows, slot) in ring_writes(offset, t, w) {
                cache_k = B::kv_int8_store(cache_k, keys.clone().slice(s![.., .., rows.clone(), ..]), slot);
                cache_v = B::kv_int8_store(cache_v, values.clone().slice(s![.., .., rows, ..]), slot);
            }
            (Storage::Int8 { keys: cache_k, values: cache_v }, out)
        }
    }
}

/// Mask of one query at `offset` over a ring holding `filled` positions in rotated order: every
/// key in the ring is inside the window, so the order does not matter.
fn ring_mask(offset: usize, filled: usize, w: usize) -> AttentionMask {
    AttentionMask { q_offset: offset, k_offset: offset + 1 - filled, window: Some(w) }
}

/// The ring's previous positions (up to `w` before `offset`) in position order, read through
/// `slots(range)`; `None` when there are none.
fn ordered_window<B: Backend>(
    offset: usize,
    w: usize,
    slots: impl Fn(std::ops::Range<usize>) -> Tensor<B, 4>,
) -> Option<Tensor<B, 4>> {
    if offset == 0 {
        None
    } else if offset <= w {
        Some(slots(0..offset))
    } else {
        let start = offset % w;
        Some(Tensor::cat(vec![slots(start..w), slots(0..start)], 2))
    }
}

fn join<B: Backend>(old: Option<Tensor<B, 4>>, new: Tensor<B, 4>) -> Tensor<B, 4> {
    match old {
        Some(old) => Tensor::cat(vec![old, new], 2),
        None => new,
    }
}

/// Where the last `min(t, w)` of `t` new positions (starting at `offset`) go in a ring of `w`
/// slots: `(rows of the new block, first slot)`, at most two contiguous writes.
fn ring_writes(offset: usize, t: usize, w: usize) -> Vec<(std::ops::Range<usize>, usize)> {
    let kept = t.min(w);
    let first = offset + t - kept;
    let start = first % w;
    let head = kept.min(w - start);
    let skip = t - kept;
    let mut writes = vec![(skip..skip + head, start)];
    if head < kept {
        writes.push((skip + head..t, 0));
    }
    writes
}
