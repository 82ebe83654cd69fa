//! The KV cache: one [`LayerCache`] per decoder layer, each typed once when the cache is built
//! (full or ring, dense or int8, its own KV heads and head size).

use super::ring::{ring_writes, window_in_order, Span};
use crate::{GemmaConfig, ModelError};
use burn::tensor::{s, DType, Tensor};
use burn_gemma_kernels::{AttentionMask, AttentionOptions, GemmaBackend, KvFormat, KvStore, KvView, QkvLayout};

/// The score settings of a layer's attention: scale and optional logit softcap.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Scores {
    pub scale: f64,
    pub softcap: Option<f64>,
}

impl Scores {
    fn with(self, mask: AttentionMask) -> AttentionOptions {
        AttentionOptions { mask, scale: self.scale, softcap: self.softcap }
    }
}

/// The keys and values of one layer, and which slots its positions occupy.
#[derive(Debug)]
pub struct LayerCache<B: GemmaBackend> {
    /// Taken while a backend operation consumes it (the kernels write its buffers in place,
    /// which needs the only handle), put back at once.
    store: Option<KvStore<B>>,
    span: Span,
}

impl<B: GemmaBackend> LayerCache<B> {
    /// A zeroed store of `[batch, kv_heads, slots, head_dim]` for a layer with `window`.
    fn new(shape: LayerShape, window: Option<usize>, format: KvFormat, device: &B::Device) -> Self {
        let span = Span::new(window, shape.capacity);
        let dims = [shape.batch, shape.kv_heads, span.slots(shape.capacity), shape.head_dim];
        Self { store: Some(B::kv_zeros(dims, format, device)), span }
    }

    /// Runs `f` on the store and keeps the store it returns.
    fn update<T>(&mut self, f: impl FnOnce(KvStore<B>) -> (T, KvStore<B>)) -> T {
        let Some(store) = self.store.take() else { unreachable!("the store is put back after every update") };
        let (out, store) = f(store);
        self.store = Some(store);
        out
    }

    /// Decode: appends one position per sequence from the joined projection `qkv` (`[batch,
    /// width]`, see [`QkvLayout`]; `layout.position` is the position, on the host or the
    /// device) and attends to the layer's positions. Returns `[batch, q_heads, 1, head_dim]`.
    ///
    /// The slot and the visible slots follow from the position and the store's size
    /// ([`burn_gemma_kernels::step`]), which [`Span`] sized: a full store has a slot per
    /// position, a sliding-window store is a ring of the window.
    pub fn decode(&mut self, qkv: Tensor<B, 2>, layout: &QkvLayout<B>, scores: Scores) -> Tensor<B, 4> {
        let mask = AttentionMask { q_offset: 0, k_offset: 0, window: self.span.window() };
        self.update(|store| {
            let (q, store) = B::qkv_rope_append(qkv, layout, store);
            let view = KvView::Decode { store: &store, position: layout.position.clone() };
            let out = B::grouped_attention(q, view, &scores.with(mask));
            (out, store)
        })
    }

    /// Appends the keys and values of positions `position..position + t` and attends to them
    /// and the layer's earlier positions (causal, within the layer's window).
    ///
    /// - `q`: `[batch, q_heads, t, head_dim]`; `keys`, `values`: `[batch, kv_heads, t, head_dim]`;
    /// - returns `[batch, q_heads, t, head_dim]`.
    pub fn prefill(
        &mut self,
        q: Tensor<B, 4>,
        keys: Tensor<B, 4>,
        values: Tensor<B, 4>,
        position: usize,
        scores: Scores,
    ) -> Tensor<B, 4> {
        let t = keys.dims()[2];
        match self.span {
            Span::Full => self.update(|store| {
                let store = B::kv_write(store, keys, values, position);
                let mask = AttentionMask { q_offset: position, k_offset: 0, window: None };
                let out = B::grouped_attention(q, store.view(position + t), &scores.with(mask));
                (out, store)
            }),
            Span::Ring(w) => self.update(|store| {
                // Attend over [the previous window in order] ++ [the new rows], then keep the
                // last `w` positions in the ring.
                let dtype = q.dtype();
                let mut old_k = Vec::new();
                let mut old_v = Vec::new();
                for range in window_in_order(position, w) {
                    let (k, v) = B::kv_read(&store, range, dtype);
                    old_k.push(k);
                    old_v.push(v);
                }
                old_k.push(keys.clone());
                old_v.push(values.clone());
                let kv = KvView::Dense { keys: Tensor::cat(old_k, 2), values: Tensor::cat(old_v, 2) };
                let mask = AttentionMask { q_offset: position, k_offset: position - position.min(w), window: Some(w) };
                let out = B::grouped_attention(q, kv, &scores.with(mask));
                let mut store = store;
                for (rows, slot) in ring_writes(position, t, w) {
                    let rows = s![.., .., rows, ..];
                    store = B::kv_write(store, keys.clone().slice(rows), values.clone().slice(rows), slot);
                }
                (out, store)
            }),
        }
    }

    /// Bytes on the device.
    pub fn device_bytes(&self) -> usize {
        self.store.as_ref().map_or(0, KvStore::device_bytes)
    }
}

/// What every layer's store is sized by.
#[derive(Debug, Clone, Copy)]
struct LayerShape {
    batch: usize,
    capacity: usize,
    kv_heads: usize,
    head_dim: usize,
}

/// The KV cache of a whole model, for a fixed batch size and capacity.
#[derive(Debug)]
pub struct KvCache<B: GemmaBackend> {
    layers: Vec<LayerCache<B>>,
    len: usize,
    capacity: usize,
    batch: usize,
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
            KvFormat::Int8 if !config.head_dim.is_multiple_of(4) => {
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
        let shape = LayerShape { batch, capacity, kv_heads: config.num_key_value_heads, head_dim: config.head_dim };
        let layers = config
            .layer_types
            .iter()
            .map(|&layer_type| LayerCache::new(shape, config.window(layer_type), format, device))
            .collect();
        Ok(Self { layers, len: 0, capacity, batch })
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

    /// The per-layer caches, in layer order.
    pub(crate) fn layers_mut(&mut self) -> &mut [LayerCache<B>] {
        &mut self.layers
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

    /// Bytes the keys and values occupy on the device.
    pub fn device_bytes(&self) -> usize {
        self.layers.iter().map(LayerCache::device_bytes).sum()
    }
}
