//! The KV cache: one [`LayerCache`] per decoder layer, each typed once when the cache is built
//! (full or ring, dense or int8, its own KV heads and head size).

use super::ring::{ring_writes, window_in_order, Span};
use crate::{GemmaConfig, ModelError};
use burn::tensor::{s, DType, Tensor};
use burn_gemma_kernels::{
    AttentionMask, AttentionOptions, GemmaBackend, KvFormat, KvStore, KvView, QkvLayout, ReadBackError,
};

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
    /// Where later layers share this layer's keys (Gemma 4): what the last chunk of a ring
    /// attended over (the previous window and the chunk's own rows), for them to attend over
    /// too; the ring itself no longer holds the first rows once the chunk is written.
    shared_chunk: Option<SharedChunk<B>>,
    shared: bool,
    /// What the store holds right after its next write ([`KvCache::pin_next_write`]).
    pinned: Pin<B>,
}

/// Keys and values a store takes right after a write in place of what the write stored, or
/// nothing to replace.
#[derive(Debug)]
struct Pin<B: GemmaBackend>(Option<StoredRows<B>>);

impl<B: GemmaBackend> Pin<B> {
    /// The pinned rows, leaving none.
    fn take(&mut self) -> Self {
        Self(self.0.take())
    }

    /// `store` after a write: holding the pinned rows (stored in its own format), or as it is.
    fn apply(self, store: KvStore<B>) -> KvStore<B> {
        match self.0 {
            Some(rows) => B::kv_write(store, rows.keys, rows.values, 0),
            None => store,
        }
    }
}

/// Every slot of one layer's store, `[batch, kv_heads, slots, head_dim]` in f32 (an int8
/// store's codes times their scales).
#[derive(Debug, Clone)]
pub struct StoredRows<B: GemmaBackend> {
    pub keys: Tensor<B, 4>,
    pub values: Tensor<B, 4>,
}

/// The keys and values a multi-position chunk attended over, and their mask.
#[derive(Debug, Clone)]
struct SharedChunk<B: GemmaBackend> {
    keys: Tensor<B, 4>,
    values: Tensor<B, 4>,
    mask: AttentionMask,
}

impl<B: GemmaBackend> LayerCache<B> {
    /// A zeroed store of `[batch, kv_heads, slots, head_dim]` for a layer with `window`;
    /// `shared`: later layers attend over it.
    fn new(shape: LayerShape, window: Option<usize>, format: KvFormat, shared: bool, device: &B::Device) -> Self {
        let span = Span::new(window, shape.capacity);
        let dims = [shape.batch, shape.kv_heads, span.slots(shape.capacity), shape.head_dim];
        Self { store: Some(B::kv_zeros(dims, format, device)), span, shared_chunk: None, shared, pinned: Pin(None) }
    }

    /// Runs `f` on the store and keeps the store it returns. Where `f` fails (a device read
    /// failed) the store is lost with it, and this layer refuses every later step
    /// ([`ModelError::CacheLost`]).
    fn update<T>(
        &mut self,
        f: impl FnOnce(KvStore<B>) -> Result<(T, KvStore<B>), ReadBackError>,
    ) -> Result<T, ModelError> {
        let store = self.store.take().ok_or(ModelError::CacheLost)?;
        let (out, store) = f(store)?;
        self.store = Some(store);
        Ok(out)
    }

    /// Decode: appends one position per sequence from the joined projection `qkv` (`[batch,
    /// width]`, see [`QkvLayout`]; `layout.position` is the position, on the host or the
    /// device) and attends to the layer's positions. Returns `[batch, q_heads, 1, head_dim]`.
    ///
    /// The slot and the visible slots follow from the position and the store's size
    /// ([`burn_gemma_kernels::step`]), which [`Span`] sized: a full store has a slot per
    /// position, a sliding-window store is a ring of the window.
    pub fn decode(
        &mut self,
        qkv: Tensor<B, 2>,
        layout: &QkvLayout<B>,
        scores: Scores,
    ) -> Result<Tensor<B, 4>, ModelError> {
        let mask = AttentionMask { q_offset: 0, k_offset: 0, window: self.span.window() };
        let pinned = self.pinned.take();
        self.update(|store| {
            let (q, store) = B::qkv_rope_append(qkv, layout, store)?;
            let store = pinned.apply(store);
            let view = KvView::Decode { store: &store, position: layout.position.clone() };
            let out = B::grouped_attention(q, view, &scores.with(mask))?;
            Ok((out, store))
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
    ) -> Result<Tensor<B, 4>, ModelError> {
        let t = keys.dims()[2];
        let pinned = self.pinned.take();
        match self.span {
            Span::Full => self.update(|store| {
                let store = pinned.apply(B::kv_write(store, keys, values, position));
                let mask = AttentionMask { q_offset: position, k_offset: 0, window: None };
                let out = B::grouped_attention(q, store.view(position + t), &scores.with(mask))?;
                Ok((out, store))
            }),
            Span::Ring(w) => {
                let shared = self.shared;
                let (out, chunk) = self.update(|store| {
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
                    let (all_k, all_v) = (Tensor::cat(old_k, 2), Tensor::cat(old_v, 2));
                    let mask =
                        AttentionMask { q_offset: position, k_offset: position - position.min(w), window: Some(w) };
                    let chunk = shared.then(|| SharedChunk { keys: all_k.clone(), values: all_v.clone(), mask });
                    let kv = KvView::Dense { keys: all_k, values: all_v };
                    let out = B::grouped_attention(q, kv, &scores.with(mask))?;
                    let mut store = store;
                    for (rows, slot) in ring_writes(position, t, w) {
                        let rows = s![.., .., rows, ..];
                        store = B::kv_write(store, keys.clone().slice(rows), values.clone().slice(rows), slot);
                    }
                    Ok(((out, chunk), pinned.apply(store)))
                })?;
                self.shared_chunk = chunk;
                Ok(out)
            }
        }
    }

    /// A KV-sharing layer's chunk (Gemma 4): attends `q` (`[batch, q_heads, t, head_dim]`, at
    /// positions `position..position + t`) over what this layer's own chunk at the same
    /// positions attended over, without writing. Returns `[batch, q_heads, t, head_dim]`.
    pub fn prefill_shared(
        &mut self,
        q: Tensor<B, 4>,
        position: usize,
        t: usize,
        scores: Scores,
    ) -> Result<Tensor<B, 4>, ModelError> {
        match (self.span, &self.shared_chunk) {
            (Span::Ring(_), Some(chunk)) => {
                let kv = KvView::Dense { keys: chunk.keys.clone(), values: chunk.values.clone() };
                Ok(B::grouped_attention(q, kv, &scores.with(chunk.mask))?)
            }
            _ => {
                let mask = AttentionMask { q_offset: position, k_offset: 0, window: self.span.window() };
                self.update(|store| {
                    let out = B::grouped_attention(q, store.view(position + t), &scores.with(mask))?;
                    Ok((out, store))
                })
            }
        }
    }

    /// Bytes on the device.
    pub fn device_bytes(&self) -> usize {
        self.store.as_ref().map_or(0, KvStore::device_bytes)
    }

    /// Sequence `at` of the store replaced by `rows` (one sequence of a store of the same shape
    /// and format). A mismatch leaves the store as it was.
    fn assign_sequence(&mut self, at: usize, rows: KvStore<B>) -> Result<(), ModelError> {
        let store = self.store.take().ok_or(ModelError::CacheLost)?;
        let checked = store.check_rows(at, &rows);
        self.store = Some(match checked {
            Ok(()) => store.replace_rows(at, rows),
            Err(_) => store,
        });
        checked.map_err(|mismatch| ModelError::CacheMismatch(mismatch.to_string()))
    }

    /// Every slot of the store, in f32.
    fn stored(&self) -> Result<StoredRows<B>, ModelError> {
        let store = self.store.as_ref().ok_or(ModelError::CacheLost)?;
        let (keys, values) = B::kv_read(store, 0..store.shape()[2], DType::F32);
        Ok(StoredRows { keys, values })
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
    /// One per layer with keys of its own.
    layers: Vec<LayerCache<B>>,
    /// For each decoder layer, its entry of `layers` (a KV-sharing layer's is the one of the
    /// layer it shares).
    layer_of: Vec<usize>,
    len: usize,
    capacity: usize,
    batch: usize,
    /// Unique per allocation (kept by [`KvCache::reset`]): a recorded decode step writes this
    /// cache's buffers and refuses any other ([`crate::DecodeGraphs`]).
    id: u64,
}

impl<B: GemmaBackend> KvCache<B> {
    /// This cache's identity: distinct for every cache allocated in the process, the same
    /// after [`KvCache::reset`].
    pub fn id(&self) -> u64 {
        self.id
    }

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
            KvFormat::Int8 if !config.head_dim.is_multiple_of(4) || !config.global_head_dim.is_multiple_of(4) => {
                return Err(ModelError::InvalidInput(format!(
                    "an int8 KV cache needs head sizes divisible by 4, the model has {} and {}",
                    config.head_dim, config.global_head_dim
                )));
            }
            KvFormat::Dense(dtype)
                if !matches!(dtype, DType::F32 | DType::F16 | DType::BF16) || !B::supports_dtype(device, dtype) =>
            {
                return Err(ModelError::BackendDtype { backend: B::name(device), dtype });
            }
            _ => {}
        }
        Self::check_memory(config, batch, capacity, format, device)?;
        let producers: Vec<usize> = (0..config.num_hidden_layers).filter_map(|i| config.kv_producer(i)).collect();
        let mut layers = Vec::new();
        let mut layer_of = Vec::with_capacity(config.num_hidden_layers);
        for (i, &layer_type) in config.layer_types.iter().enumerate() {
            let entry = match config.kv_producer(i) {
                Some(producer) => layer_of[producer],
                None => {
                    let shape = LayerShape {
                        batch,
                        capacity,
                        kv_heads: config.kv_heads_of(layer_type),
                        head_dim: config.head_dim_of(layer_type),
                    };
                    let shared = producers.contains(&i);
                    layers.push(LayerCache::new(shape, config.window(layer_type), format, shared, device));
                    layers.len() - 1
                }
            };
            layer_of.push(entry);
        }
        static NEXT_ID: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
        let id = NEXT_ID.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Ok(Self { layers, layer_of, len: 0, capacity, batch, id })
    }

    /// Refuses a cache the device cannot hold, before any of it is allocated: one layer's keys
    /// past the largest buffer, or the whole cache past the memory available.
    fn check_memory(
        config: &GemmaConfig,
        batch: usize,
        capacity: usize,
        format: KvFormat,
        device: &B::Device,
    ) -> Result<(), ModelError> {
        let limits = B::memory_limits(device);
        let mut total = 0u64;
        for (i, &layer_type) in config.layer_types.iter().enumerate() {
            if config.kv_producer(i).is_some() {
                continue;
            }
            let slots = Span::new(config.window(layer_type), capacity).slots(capacity);
            let dims = [batch, config.kv_heads_of(layer_type), slots, config.head_dim_of(layer_type)];
            let what = || format!("KV cache of {capacity} positions x {batch} sequences ({format})");
            let store = format
                .store_bytes(dims)
                .ok_or_else(|| ModelError::InvalidInput(format!("{}: its size overflows", what())))?;
            if let Some(largest) = limits.largest_buffer.filter(|&l| store > l) {
                return Err(ModelError::DeviceMemory {
                    what: format!("{}: layer {i}'s keys", what()),
                    asked: store,
                    available: largest,
                    limit: "the largest buffer the device allocates",
                });
            }
            total = total.saturating_add(store.saturating_mul(2));
            if let Some(available) = limits.available.filter(|&a| total > a) {
                return Err(ModelError::DeviceMemory {
                    what: what(),
                    asked: total,
                    available,
                    limit: "the device memory still free",
                });
            }
        }
        Ok(())
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

    /// Decoder layers the cache serves.
    pub fn num_layers(&self) -> usize {
        self.layer_of.len()
    }

    /// Batch size the cache was allocated for.
    pub fn batch(&self) -> usize {
        self.batch
    }

    /// Forgets every position; the memory is kept for the next sequence.
    pub fn reset(&mut self) {
        self.len = 0;
    }

    /// The cache decoder layer `layer` reads and writes (a KV-sharing layer: the one of the
    /// layer it shares).
    pub(crate) fn layer_mut(&mut self, layer: usize) -> &mut LayerCache<B> {
        &mut self.layers[self.layer_of[layer]]
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

    /// Makes sequence `to` of this cache hold what sequence `from_sequence` of `from` holds, in
    /// every layer: a sequence run on its own (its prompt in a cache of one sequence) joins
    /// the sequences that step together ([`crate::Gemma::decode_logits`]). Both caches must be
    /// made for the same model, capacity and format. The length is not changed: the caller
    /// keeps each sequence's position.
    pub fn copy_sequence(&mut self, to: usize, from: &KvCache<B>, from_sequence: usize) -> Result<(), ModelError> {
        self.check_sequences(to, from, from_sequence)?;
        for (layer, source) in self.layers.iter_mut().zip(&from.layers) {
            let rows = source.store.as_ref().ok_or(ModelError::CacheLost)?.rows(from_sequence..from_sequence + 1);
            layer.assign_sequence(to, rows)?;
        }
        Ok(())
    }

    /// Makes sequence `to` hold what sequence `from` holds (when `from` leaves the sequences
    /// that step together, the last one takes its place).
    pub fn move_sequence(&mut self, from: usize, to: usize) -> Result<(), ModelError> {
        if from.max(to) >= self.batch {
            return Err(ModelError::CacheMismatch(format!(
                "sequence {} of a cache of {} sequences",
                from.max(to),
                self.batch
            )));
        }
        if from == to {
            return Ok(());
        }
        for layer in &mut self.layers {
            let rows = layer.store.as_ref().ok_or(ModelError::CacheLost)?.copy_rows(from..from + 1);
            layer.assign_sequence(to, rows)?;
        }
        Ok(())
    }

    fn check_sequences(&self, to: usize, from: &KvCache<B>, from_sequence: usize) -> Result<(), ModelError> {
        let fail = |why: String| Err(ModelError::CacheMismatch(why));
        if to >= self.batch || from_sequence >= from.batch {
            return fail(format!(
                "sequence {from_sequence} of a cache of {} into sequence {to} of a cache of {}",
                from.batch, self.batch
            ));
        }
        if self.layer_of != from.layer_of || self.capacity != from.capacity {
            return fail(format!(
                "a cache of {} layers and {} positions into one of {} layers and {} positions",
                from.layer_of.len(),
                from.capacity,
                self.layer_of.len(),
                self.capacity
            ));
        }
        Ok(())
    }

    /// What every layer with keys of its own stores now, in f32 (an int8 store's codes times
    /// their scales), in layer order.
    pub fn stored(&self) -> Result<Vec<StoredRows<B>>, ModelError> {
        self.layers.iter().map(LayerCache::stored).collect()
    }

    /// Makes each layer's store hold `stored[i]` (what [`KvCache::stored`] returned for another
    /// cache of the same shape after the same step, stored again in this cache's format) right
    /// after its next write, before anything reads it, in place of what the write computed.
    ///
    /// For checking one run against another: an int8 store rounds values computed in float
    /// arithmetic, and two runs whose sums go in different orders (a reference on the CPU, kernels
    /// on a GPU) now and then round a value lying within an ulp of a code boundary to
    /// neighbouring codes. Pinning the reference's cache to the checked run's stores makes both
    /// attend over the same codes, so that what is left between them is their float arithmetic.
    pub fn pin_next_write(&mut self, stored: Vec<StoredRows<B>>) -> Result<(), ModelError> {
        if stored.len() != self.layers.len() {
            return Err(ModelError::InvalidInput(format!(
                "{} layers of stored rows for a cache of {} layers with keys of their own",
                stored.len(),
                self.layers.len()
            )));
        }
        for (i, (layer, rows)) in self.layers.iter().zip(&stored).enumerate() {
            let shape = layer.store.as_ref().ok_or(ModelError::CacheLost)?.shape();
            if rows.keys.dims() != shape || rows.values.dims() != shape {
                return Err(ModelError::InvalidInput(format!(
                    "stored rows {:?} and {:?} for layer {i}, whose store is {shape:?}",
                    rows.keys.dims(),
                    rows.values.dims()
                )));
            }
        }
        for (layer, rows) in self.layers.iter_mut().zip(stored) {
            layer.pinned = Pin(Some(rows));
        }
        Ok(())
    }
}
