//! The KV cache: one [`LayerCache`] per decoder layer, each typed once when the cache is built
//! (full or ring, dense or int8, its own KV heads and head size).

mod blocks;

use super::paged::{BlockPool, PagedLayout};
use super::rewind::{ring_slots, RewindPoint};
use super::ring::{ring_writes, window_in_order, Span, WindowStore};
use crate::{GemmaConfig, ModelError};
use burn::tensor::{s, DType, Tensor};
use burn_gemma_kernels::{
    step, AttentionMask, AttentionOptions, BlockTable, GemmaBackend, KvFormat, KvStore, KvView, QkvLayout,
    ReadBackError, StepPosition,
};
use std::ops::Range;

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
    /// too; the ring itself no longer holds the first rows once the chunk is written. One for
    /// the whole chunk, or one per row ([`QueryRows::Each`]).
    shared_chunk: Option<Vec<SharedChunk<B>>>,
    shared: bool,
    /// How a chunk's rows attend ([`KvCache::set_query_rows`]).
    query_rows: QueryRows,
    /// Positions of the next chunk that attend to each other both ways, block by block (an
    /// image's soft tokens, [`KvCache::set_bidirectional`]).
    bidirectional: Vec<Range<usize>>,
    /// What the store holds right after its next write ([`KvCache::pin_next_write`]).
    pinned: Pin<B>,
    /// In a paged cache: its pool's index, and the pool's table as last uploaded.
    pool: Option<usize>,
    blocks: Option<BlockTable<B>>,
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
    /// The zeroed store `plan` describes ([`LayerPlan::store_dims`]).
    fn new(plan: &LayerPlan, format: KvFormat, device: &B::Device) -> Self {
        Self {
            store: Some(B::kv_zeros(plan.store_dims(), format, device)),
            span: Span::new(plan.window, plan.shape.capacity, plan.window_store),
            shared_chunk: None,
            shared: plan.shared,
            query_rows: QueryRows::Together,
            bidirectional: Vec::new(),
            pinned: Pin(None),
            pool: plan.paged.map(|p| p.pool),
            blocks: None,
        }
    }

    /// Where each sequence's slots lie, for a paged cache (the table as last uploaded).
    pub fn blocks(&self) -> Option<BlockTable<B>> {
        self.blocks.clone()
    }

    /// Fails for a paged cache, which takes decode steps only.
    fn check_unpaged(&self) -> Result<(), ModelError> {
        match self.pool {
            Some(_) => Err(ModelError::InvalidInput(
                "a paged KV cache takes decode steps only: run prompts in a cache of their own and copy them in \
                 (KvCache::copy_sequence)"
                    .into(),
            )),
            None => Ok(()),
        }
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
            let view =
                KvView::Decode { store: &store, position: layout.position.clone(), blocks: layout.blocks.as_ref() };
            let out = B::grouped_attention(q, view, &scores.with(mask))?;
            Ok((out, store))
        })
    }

    /// Appends the keys and values of positions `position..position + t` and attends to them
    /// and the layer's earlier positions (causal, within the layer's window), all rows in one
    /// attention call or each on its own ([`QueryRows`]).
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
        self.check_unpaged()?;
        let t = keys.dims()[2];
        let blocks = self.take_bidirectional(position, t)?;
        let pinned = self.pinned.take();
        let rows = self.query_rows;
        // A windowed layer keeps every position as a full one does, masked by its window.
        let window = self.span.window();
        match self.span {
            Span::Windowed(_) if !blocks.is_empty() => Err(ModelError::InvalidInput(
                "image tokens attending both ways in a cache that keeps every position of its sliding-window layers \
                 (WindowStore::EveryPosition)"
                    .into(),
            )),
            Span::Full | Span::Windowed(_) => self.update(|store| {
                let store = pinned.apply(B::kv_write(store, keys, values, position));
                let out = match rows {
                    QueryRows::Together if !blocks.is_empty() => by_segment(q, position, &blocks, |rows, block| {
                        // A block's rows see every key up to its end.
                        let (end, q_pos) = match block {
                            Some(end) => (end, end - 1),
                            None => (position + t, position + rows.start),
                        };
                        let mask = AttentionMask { q_offset: q_pos, k_offset: 0, window: None };
                        vec![(store.view(end), scores.with(mask))]
                    })?,
                    QueryRows::Together => {
                        let mask = AttentionMask { q_offset: position, k_offset: 0, window };
                        B::grouped_attention(q, store.view(position + t), &scores.with(mask))?
                    }
                    // What a one-position step at each row's position reads.
                    QueryRows::Each => each_row(q, |i| {
                        let (visible, mask) = step::decode_visible(position + i, usize::MAX, window);
                        (store.view(visible), scores.with(mask))
                    })?,
                };
                Ok((out, store))
            }),
            Span::Ring(w) if rows == QueryRows::Each && t <= w && blocks.is_empty() => {
                let shared = self.shared;
                let (out, chunks) = self.update(|store| {
                    let chunk = Chunk { q, keys, values, position };
                    let EachRow { out, shared, store } = ring_each_row(store, chunk, w, scores, shared)?;
                    Ok(((out, shared), pinned.apply(store)))
                })?;
                self.shared_chunk = chunks;
                Ok(out)
            }
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
                    let chunk = shared.then(|| vec![SharedChunk { keys: all_k.clone(), values: all_v.clone(), mask }]);
                    let out = ring_attention(q, &all_k, &all_v, (position, w), &blocks, scores)?;
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
        self.check_unpaged()?;
        let blocks = self.take_bidirectional(position, t)?;
        let rows = self.query_rows;
        match (self.span, &self.shared_chunk) {
            // The keys and values the producing layer's chunk attended over, with the same
            // bidirectional blocks (an image's tokens, as on the producing layer).
            (Span::Ring(w), Some(chunks)) if chunks.len() == 1 => {
                let chunk = &chunks[0];
                Ok(ring_attention(q, &chunk.keys, &chunk.values, (position, w), &blocks, scores)?)
            }
            _ if !blocks.is_empty() => Err(ModelError::InvalidInput(
                "image tokens attending both ways on a full-attention layer that shares another's keys and values"
                    .into(),
            )),
            (Span::Ring(_), Some(chunks)) if chunks.len() == t => Ok(each_row(q, |i| {
                let chunk = &chunks[i];
                (KvView::Dense { keys: chunk.keys.clone(), values: chunk.values.clone() }, scores.with(chunk.mask))
            })?),
            _ => {
                let window = self.span.window();
                self.update(|store| {
                    let out = match rows {
                        QueryRows::Together => {
                            let mask = AttentionMask { q_offset: position, k_offset: 0, window };
                            B::grouped_attention(q, store.view(position + t), &scores.with(mask))?
                        }
                        QueryRows::Each => each_row(q, |i| {
                            let mask = AttentionMask { q_offset: position + i, k_offset: 0, window };
                            (store.view(position + i + 1), scores.with(mask))
                        })?,
                    };
                    Ok((out, store))
                })
            }
        }
    }

    /// The bidirectional blocks set for a chunk at `position..position + t` (cleared, except
    /// on a layer whose chunk KV-sharing layers attend over again: they read the same blocks,
    /// and [`KvCache::set_bidirectional`] clears them after the chunk): each must lie inside the
    /// chunk, and rows attending each on their own take none.
    fn take_bidirectional(&mut self, position: usize, t: usize) -> Result<Vec<Range<usize>>, ModelError> {
        let blocks = if self.shared { self.bidirectional.clone() } else { std::mem::take(&mut self.bidirectional) };
        if let Some(b) = blocks.iter().find(|b| b.start < position || b.end > position + t || b.is_empty()) {
            return Err(ModelError::InvalidInput(format!(
                "image tokens at positions {b:?} are not all in the chunk at {position}..{}: an image's tokens run in \
                 one chunk",
                position + t
            )));
        }
        if !blocks.is_empty() && self.query_rows == QueryRows::Each {
            return Err(ModelError::InvalidInput("image tokens in a chunk whose rows attend each on their own".into()));
        }
        Ok(blocks)
    }

    /// Another model's query over this layer's positions before `position`, read only: `q`
    /// (`[batch, q_heads, 1, head_dim]`, rotated at `position`) attends over what a
    /// one-position step at `position - 1` reads, a ring's whole window ending there (a Gemma 4
    /// assistant drafting at the position after its target's last). Returns `[batch, q_heads,
    /// 1, head_dim]`.
    pub fn attend_before(&self, q: Tensor<B, 4>, position: usize, scores: Scores) -> Result<Tensor<B, 4>, ModelError> {
        let last = position
            .checked_sub(1)
            .ok_or_else(|| ModelError::InvalidInput("a query before position 0 attends over nothing".into()))?;
        let store = self.store.as_ref().ok_or(ModelError::CacheLost)?;
        let view = KvView::Decode { store, position: StepPosition::Host(last), blocks: self.blocks.as_ref() };
        let mask = AttentionMask { q_offset: 0, k_offset: 0, window: self.span.window() };
        Ok(B::grouped_attention(q, view, &scores.with(mask))?)
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

    /// For a ring: the rows of the slots positions `span` (at most the ring's slots) occupy,
    /// in position order and in f32; nothing for a full store, which a rewind leaves as it is.
    fn saved(&self, span: &Range<usize>) -> Result<Option<StoredRows<B>>, ModelError> {
        let Span::Ring(w) = self.span else { return Ok(None) };
        if span.is_empty() {
            return Ok(None);
        }
        let store = self.store.as_ref().ok_or(ModelError::CacheLost)?;
        let (keys, values): (Vec<_>, Vec<_>) =
            ring_slots(span, w).into_iter().map(|(slots, _)| B::kv_read(store, slots, DType::F32)).unzip();
        Ok(Some(StoredRows { keys: Tensor::cat(keys, 2), values: Tensor::cat(values, 2) }))
    }

    /// Puts back what `saved` (from [`LayerCache::saved`] over positions from `start`) holds
    /// for the slots of positions `rejected`.
    fn restore(&mut self, saved: &StoredRows<B>, start: usize, rejected: Range<usize>) -> Result<(), ModelError> {
        let Span::Ring(w) = self.span else { return Ok(()) };
        let mut store = self.store.take().ok_or(ModelError::CacheLost)?;
        let base = rejected.start - start;
        for (slots, offset) in ring_slots(&rejected, w) {
            let rows = s![.., .., base + offset..base + offset + slots.len(), ..];
            store = B::kv_write(store, saved.keys.clone().slice(rows), saved.values.clone().slice(rows), slots.start);
        }
        self.store = Some(store);
        Ok(())
    }

    /// Every slot of the store, in f32.
    fn stored(&self) -> Result<StoredRows<B>, ModelError> {
        let store = self.store.as_ref().ok_or(ModelError::CacheLost)?;
        let (keys, values) = B::kv_read(store, 0..store.shape()[2], DType::F32);
        Ok(StoredRows { keys, values })
    }
}

/// How the rows of a chunk of several positions attend.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum QueryRows {
    /// All rows in one attention call (prompts).
    #[default]
    Together,
    /// Each row on its own, over exactly the keys a one-position step at its position reads,
    /// in the same order: each row's output is the one such a step computes, bit for bit,
    /// where the rest of the step is the same row by row (speculative decoding's verify step,
    /// whose greedy choices must be those of decoding without drafts).
    Each,
}

/// `[batch, q_heads, t, head_dim]` of a chunk at `position` with bidirectional `blocks`
/// (absolute, in order, inside the chunk): its rows split into runs outside the blocks and the
/// blocks; `attend(rows, block_end)` gives for each run (rows relative to the chunk; the block's
/// end for a block) the views and masks its rows attend with: one for the whole run, or one per
/// row.
fn by_segment<'a, B: GemmaBackend>(
    q: Tensor<B, 4>,
    position: usize,
    blocks: &[Range<usize>],
    mut attend: impl FnMut(Range<usize>, Option<usize>) -> Vec<(KvView<'a, B>, AttentionOptions)>,
) -> Result<Tensor<B, 4>, ReadBackError> {
    let t = q.dims()[2];
    let mut runs = Vec::new();
    let mut at = 0;
    for b in blocks {
        let (start, end) = (b.start - position, b.end - position);
        if start > at {
            runs.push((at..start, None));
        }
        runs.push((start..end, Some(b.end)));
        at = end;
    }
    if at < t {
        runs.push((at..t, None));
    }
    let mut outs = Vec::new();
    for (rows, block) in runs {
        let views = attend(rows.clone(), block);
        let q_rows = q.clone().slice(s![.., .., rows.clone(), ..]);
        match <[_; 1]>::try_from(views) {
            Ok([(kv, options)]) => outs.push(B::grouped_attention(q_rows, kv, &options)?),
            Err(views) => {
                for (i, (kv, options)) in views.into_iter().enumerate() {
                    outs.push(B::grouped_attention(q_rows.clone().slice(s![.., .., i..i + 1, ..]), kv, &options)?);
                }
            }
        }
    }
    Ok(Tensor::cat(outs, 2))
}

/// A sliding layer's chunk `q` (`[batch, q_heads, t, head_dim]` at `position`) attended over
/// `keys` and `values`: the ring's previous window in order, then the chunk's rows (what
/// [`LayerCache::prefill`] gathers, and what its KV-sharing layers attend over again). Rows of a
/// bidirectional block see every key up to the block's end as well.
fn ring_attention<B: GemmaBackend>(
    q: Tensor<B, 4>,
    keys: &Tensor<B, 4>,
    values: &Tensor<B, 4>,
    (position, w): (usize, usize),
    blocks: &[Range<usize>],
    scores: Scores,
) -> Result<Tensor<B, 4>, ReadBackError> {
    let t = q.dims()[2];
    let k_offset = position - position.min(w);
    if blocks.is_empty() {
        let mask = AttentionMask { q_offset: position, k_offset, window: Some(w) };
        let kv = KvView::Dense { keys: keys.clone(), values: values.clone() };
        return B::grouped_attention(q, kv, &scores.with(mask));
    }
    by_segment(q, position, blocks, |rows, block| {
        let dense = |end: usize| {
            let range = s![.., .., 0..end - k_offset, ..];
            KvView::Dense { keys: keys.clone().slice(range), values: values.clone().slice(range) }
        };
        let window = |q_offset, window| scores.with(AttentionMask { q_offset, k_offset, window });
        match block {
            None => vec![(dense(position + t), window(position + rows.start, Some(w)))],
            // Every key of the window before the block's last row is in the window of each of
            // its rows: one call up to the block's end.
            Some(end) if end <= k_offset + w => vec![(dense(end), window(end - 1, None))],
            // Row `i` sees keys after `i - w` up to the block's end: at the end's position, a
            // window wider by the rows after `i`.
            Some(end) => (position + rows.start..position + rows.end)
                .map(|i| (dense(end), window(end - 1, Some(w + end - 1 - i))))
                .collect(),
        }
    })
}

/// `[batch, q_heads, t, head_dim]`: row `i` of `q` attended over what `view(i)` gives.
fn each_row<'a, B: GemmaBackend>(
    q: Tensor<B, 4>,
    view: impl Fn(usize) -> (KvView<'a, B>, AttentionOptions),
) -> Result<Tensor<B, 4>, ReadBackError> {
    let t = q.dims()[2];
    let outs = (0..t)
        .map(|i| {
            let (kv, options) = view(i);
            B::grouped_attention(q.clone().slice(s![.., .., i..i + 1, ..]), kv, &options)
        })
        .collect::<Result<Vec<_>, _>>()?;
    Ok(Tensor::cat(outs, 2))
}

/// A ring's chunk with each row on its own ([`QueryRows::Each`]; `t <= w`): the chunk is
/// written first, and row `i` (position `p = position + i`) attends over what a one-position
/// step at `p` reads (`LayerCache::decode`): the ring's first `min(p + 1, w)` slots as they lie
/// right after that step's write, i.e. with the slots of the chunk's later positions still
/// holding what they held before the chunk. Returns the output, the per-row views for
/// KV-sharing layers (`shared`), and the store.
fn ring_each_row<B: GemmaBackend>(
    store: KvStore<B>,
    chunk: Chunk<B>,
    w: usize,
    scores: Scores,
    shared: bool,
) -> Result<EachRow<B>, ReadBackError> {
    let Chunk { q, keys, values, position } = chunk;
    let (t, dtype) = (keys.dims()[2], q.dtype());
    let span = position..position + t;
    // What the chunk's slots hold before it writes them, in the chunk's position order.
    let (before_k, before_v): (Vec<_>, Vec<_>) =
        ring_slots(&span, w).into_iter().map(|(slots, _)| B::kv_read(&store, slots, dtype)).unzip();
    let (before_k, before_v) = (Tensor::cat(before_k, 2), Tensor::cat(before_v, 2));
    let mut store = store;
    for (rows, slot) in ring_writes(position, t, w) {
        let rows = s![.., .., rows, ..];
        store = B::kv_write(store, keys.clone().slice(rows), values.clone().slice(rows), slot);
    }
    let (ring_k, ring_v) = B::kv_read(&store, 0..w, dtype);
    let mut rows = Vec::with_capacity(t);
    for i in 0..t {
        let p = position + i;
        let (visible, mask) = step::decode_visible(p, w, Some(w));
        let (mut k, mut v) = (ring_k.clone(), ring_v.clone());
        for (slots, offset) in ring_slots(&(p + 1..span.end), w) {
            let saved = s![.., .., i + 1 + offset..i + 1 + offset + slots.len(), ..];
            let slots = s![.., .., slots, ..];
            k = k.slice_assign(slots, before_k.clone().slice(saved));
            v = v.slice_assign(slots, before_v.clone().slice(saved));
        }
        let visible = s![.., .., 0..visible, ..];
        rows.push(SharedChunk { keys: k.slice(visible), values: v.slice(visible), mask });
    }
    let out = each_row(q, |i| {
        let row = &rows[i];
        (KvView::Dense { keys: row.keys.clone(), values: row.values.clone() }, scores.with(row.mask))
    })?;
    Ok(EachRow { out, shared: shared.then_some(rows), store })
}

/// A layer's chunk of rows at positions `position..`: `q` `[batch, q_heads, t, head_dim]`,
/// `keys` and `values` `[batch, kv_heads, t, head_dim]`.
struct Chunk<B: GemmaBackend> {
    q: Tensor<B, 4>,
    keys: Tensor<B, 4>,
    values: Tensor<B, 4>,
    position: usize,
}

/// What [`ring_each_row`] leaves: the output, each row's view for KV-sharing layers, the store.
struct EachRow<B: GemmaBackend> {
    out: Tensor<B, 4>,
    shared: Option<Vec<SharedChunk<B>>>,
    store: KvStore<B>,
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
///
/// Or paged ([`KvCache::paged`]): every layer's store a pool of blocks, each sequence holding
/// the blocks its positions need ([`super::paged`]).
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
    paging: Option<Paging<B>>,
    window_store: WindowStore,
}

/// The pools of a paged cache.
#[derive(Debug)]
struct Paging<B: GemmaBackend> {
    pools: Vec<BlockPool<B>>,
    device: B::Device,
    /// What the cache was made with: its blocks' size, positions per sequence (a pool with
    /// fewer slots is a sliding window's ring).
    layout: PagedLayout,
}

impl<B: GemmaBackend> Paging<B> {
    /// Whether pool `p` holds sliding-window rings.
    fn is_ring(&self, p: usize) -> bool {
        self.pools[p].slots < self.layout.capacity
    }

    /// A one-sequence table row of pool `p`: block `b` of each `(j, b)` at the `j`-th block of
    /// slots (`j % width` for a ring), the sink elsewhere.
    fn row_of(&self, p: usize, placed: impl IntoIterator<Item = (usize, u32)>) -> Vec<u32> {
        let pool = &self.pools[p];
        let width = pool.slots / self.layout.block_size;
        let mut row = vec![pool.sink(); width];
        for (j, b) in placed {
            row[j % width] = b;
        }
        row
    }
}

/// A layer with keys of its own, as a cache allocates it.
struct LayerPlan {
    layer: usize,
    shape: LayerShape,
    window: Option<usize>,
    /// How a sliding window is stored.
    window_store: WindowStore,
    /// Later layers attend over its keys (Gemma 4's KV sharing).
    shared: bool,
    paged: Option<InPool>,
}

/// Where a paged layer's store lies: its pool, and the pool's blocks.
#[derive(Debug, Clone, Copy)]
struct InPool {
    pool: usize,
    blocks: usize,
    block_size: usize,
}

impl LayerPlan {
    /// `[batch, kv_heads, slots, head_dim]` (slots: the window's for a ring), or paged
    /// `[blocks, kv_heads, block_size, head_dim]`.
    fn store_dims(&self) -> [usize; 4] {
        let s = self.shape;
        match self.paged {
            Some(p) => [p.blocks, s.kv_heads, p.block_size, s.head_dim],
            None => {
                let slots = Span::new(self.window, s.capacity, self.window_store).slots(s.capacity);
                [s.batch, s.kv_heads, slots, s.head_dim]
            }
        }
    }
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
        Self::build(config, (batch, capacity, WindowStore::Ring), format, None, device)
    }

    /// [`KvCache::new`] with sliding windows stored as `windows` says:
    /// [`WindowStore::EveryPosition`] for recorded verify steps of speculative decoding
    /// ([`crate::VerifyGraphs`]), which costs a full layer's memory per sliding layer.
    pub fn with_window_store(
        config: &GemmaConfig,
        (batch, capacity): (usize, usize),
        windows: WindowStore,
        format: KvFormat,
        device: &B::Device,
    ) -> Result<Self, ModelError> {
        Self::build(config, (batch, capacity, windows), format, None, device)
    }

    /// How the sliding-window layers store their keys.
    pub fn window_store(&self) -> WindowStore {
        self.window_store
    }

    /// Whether a step's rows may be consecutive positions of the first sequence, all written
    /// before any attends ([`burn_gemma_kernels::StepRows::Consecutive`]): unpaged, and no
    /// sliding-window ring shorter than the capacity (a later row's write would replace a key
    /// an earlier row reads).
    pub fn takes_consecutive_rows(&self) -> bool {
        self.paging.is_none()
            && self.layers.iter().all(|layer| !matches!(layer.span, Span::Ring(w) if w < self.capacity))
    }

    /// Allocates a paged cache (see [`PagedLayout`]): sequences take blocks as they join
    /// ([`KvCache::reserve`], [`KvCache::attach`]) and give them back as they leave
    /// ([`KvCache::release`]). It takes decode steps ([`crate::Gemma::decode_logits`]) over
    /// its first sequences; prompts run in a cache of their own and join it with
    /// [`KvCache::copy_sequence`].
    pub fn paged(
        config: &GemmaConfig,
        layout: PagedLayout,
        format: KvFormat,
        device: &B::Device,
    ) -> Result<Self, ModelError> {
        let rows = layout.sequences.checked_add(layout.draft_rows).ok_or_else(|| {
            ModelError::InvalidInput(format!("{} sequences and {} draft rows", layout.sequences, layout.draft_rows))
        })?;
        Self::build(config, (rows, layout.capacity, layout.window_store), format, Some(layout), device)
    }

    fn build(
        config: &GemmaConfig,
        (batch, capacity, window_store): (usize, usize, WindowStore),
        format: KvFormat,
        paged: Option<PagedLayout>,
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
        let (plans, pools) = Self::plan(config, (batch, capacity, window_store), paged)?;
        Self::check_memory(&plans, batch, capacity, format, device)?;
        let mut layers = Vec::new();
        let mut layer_of = Vec::with_capacity(config.num_hidden_layers);
        let mut plans = plans.into_iter().peekable();
        for i in 0..config.num_hidden_layers {
            let entry = match config.kv_producer(i) {
                Some(producer) => layer_of[producer],
                None => match plans.next_if(|p| p.layer == i) {
                    Some(p) => {
                        layers.push(LayerCache::new(&p, format, device));
                        layers.len() - 1
                    }
                    None => return Err(ModelError::InvalidInput(format!("no KV store planned for layer {i}"))),
                },
            };
            layer_of.push(entry);
        }
        static NEXT_ID: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
        let id = NEXT_ID.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let paging = paged.map(|p| Paging { pools, device: device.clone(), layout: p });
        Ok(Self { layers, layer_of, len: 0, capacity, batch, id, paging, window_store })
    }

    /// The store of every layer with keys of its own, and a paged cache's pools (one per
    /// distinct count of slots per sequence).
    fn plan(
        config: &GemmaConfig,
        (batch, capacity, window_store): (usize, usize, WindowStore),
        paged: Option<PagedLayout>,
    ) -> Result<(Vec<LayerPlan>, Vec<BlockPool<B>>), ModelError> {
        let producers: Vec<usize> = (0..config.num_hidden_layers).filter_map(|i| config.kv_producer(i)).collect();
        let mut pools: Vec<BlockPool<B>> = Vec::new();
        let mut plans = Vec::new();
        for (i, &layer_type) in config.layer_types.iter().enumerate() {
            if config.kv_producer(i).is_some() {
                continue;
            }
            let window = config.window(layer_type);
            let shape = LayerShape {
                batch,
                capacity,
                kv_heads: config.kv_heads_of(layer_type),
                head_dim: config.head_dim_of(layer_type),
            };
            let paged = match paged {
                None => None,
                Some(layout) => {
                    let slots = Span::new(window, capacity, window_store).slots(capacity);
                    let bs = layout.block_size;
                    if bs == 0 || !slots.is_multiple_of(bs) {
                        return Err(ModelError::InvalidInput(format!(
                            "KV blocks of {bs} slots do not divide layer {i}'s {slots} slots per sequence \
                             (PagedLayout::block_size_for finds a size that does)"
                        )));
                    }
                    let pool = match pools.iter().position(|p| p.slots == slots) {
                        Some(pool) => pool,
                        None => {
                            // Blocks for the sequences (draft rows hold none).
                            let sequences = layout.sequences;
                            let positions = layout.positions.unwrap_or(sequences.saturating_mul(capacity));
                            // Rings hold the copies kept outside the sequences too.
                            let cached = if slots < capacity { layout.ring_copies } else { 0 };
                            let most = sequences.saturating_mul(slots).saturating_add(cached);
                            let blocks = positions.min(most).div_ceil(bs);
                            if blocks == 0 || blocks >= u32::MAX as usize {
                                return Err(ModelError::InvalidInput(format!(
                                    "a paged KV cache of {positions} positions in blocks of {bs}"
                                )));
                            }
                            pools.push(BlockPool::new(slots, blocks, batch));
                            pools.len() - 1
                        }
                    };
                    Some(InPool { pool, blocks: pools[pool].store_blocks(), block_size: bs })
                }
            };
            plans.push(LayerPlan { layer: i, shape, window, window_store, shared: producers.contains(&i), paged });
        }
        Ok((plans, pools))
    }

    /// Refuses a cache the device cannot hold, before any of it is allocated: one layer's keys
    /// past the largest buffer, or the whole cache past the memory available.
    fn check_memory(
        plans: &[LayerPlan],
        batch: usize,
        capacity: usize,
        format: KvFormat,
        device: &B::Device,
    ) -> Result<(), ModelError> {
        let limits = B::memory_limits(device);
        let mut total = 0u64;
        for plan in plans {
            let i = plan.layer;
            let what = || format!("KV cache of {capacity} positions x {batch} sequences ({format})");
            let store = format
                .store_bytes(plan.store_dims())
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

    /// The cache decoder layer `layer` reads, read only.
    pub fn layer(&self, layer: usize) -> Option<&LayerCache<B>> {
        self.layers.get(*self.layer_of.get(layer)?)
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

    /// How the rows of the next multi-position chunks attend (until set again): together (the
    /// default) or each on its own, as a one-position step computes it ([`QueryRows`]).
    pub fn set_query_rows(&mut self, rows: QueryRows) {
        for layer in &mut self.layers {
            layer.query_rows = rows;
        }
    }

    /// Positions of the next chunk whose rows attend to each other both ways, block by block
    /// (absolute positions, in order, each inside the chunk): an image's soft tokens (HF's
    /// `token_type_ids`). Rows of a block see every key up to the block's end (and a sliding
    /// layer's window before their own position); the other rows attend causally. Used by the
    /// next chunk only.
    pub fn set_bidirectional(&mut self, blocks: &[Range<usize>]) {
        self.set_bidirectional_on(blocks, |_| true);
    }

    /// [`KvCache::set_bidirectional`] on the decoder layers `on` picks (by index); the others
    /// attend causally (Gemma 4: images attend both ways on sliding layers only). A KV-sharing
    /// layer reads the blocks of the layer whose cache it shares (a layer of its own type).
    pub fn set_bidirectional_on(&mut self, blocks: &[Range<usize>], on: impl Fn(usize) -> bool) {
        for layer in &mut self.layers {
            layer.bidirectional = Vec::new();
        }
        for (i, &entry) in self.layer_of.iter().enumerate() {
            if on(i) {
                self.layers[entry].bidirectional = blocks.to_vec();
            }
        }
    }

    /// Most positions a [`KvCache::checkpoint`] covers: the fewest slots of a sliding-window
    /// ring (a ring's positions further ahead would overwrite what the span itself wrote), or
    /// the capacity where no layer has a ring.
    pub fn checkpoint_limit(&self) -> usize {
        self.layers
            .iter()
            .filter_map(|layer| match layer.span {
                Span::Ring(w) => Some(w),
                Span::Full | Span::Windowed(_) => None,
            })
            .min()
            .unwrap_or(self.capacity)
    }

    /// Keeps what writing the next `ahead` positions (from the cache's length) overwrites in
    /// the sliding-window rings, so that [`KvCache::rewind`] can take any of those positions
    /// back: speculative decoding writes every drafted position in its verify step and rewinds
    /// the rejected ones. `ahead` is at most [`KvCache::checkpoint_limit`]; a paged cache takes
    /// no checkpoints.
    pub fn checkpoint(&self, ahead: usize) -> Result<RewindPoint<B>, ModelError> {
        if self.paging.is_some() {
            return Err(ModelError::InvalidInput(
                "a paged KV cache takes no checkpoints: rewind a sequence in a cache of its own".into(),
            ));
        }
        let limit = self.checkpoint_limit();
        if ahead > limit {
            return Err(ModelError::InvalidInput(format!(
                "a checkpoint over {ahead} positions ahead, more than the {limit} slots of the smallest sliding \
                 window"
            )));
        }
        let span = self.len..self.len + ahead;
        let rings = self.layers.iter().map(|layer| layer.saved(&span)).collect::<Result<_, _>>()?;
        Ok(RewindPoint { cache: self.id, span, rings })
    }

    /// Takes the cache back to `len` positions, as if those after it had never been written:
    /// `len` and the cache's length lie within `checkpoint`'s span (taken of this cache, which
    /// has written no further since). A refused rewind changes nothing.
    pub fn rewind(&mut self, checkpoint: &RewindPoint<B>, len: usize) -> Result<(), ModelError> {
        let span = checkpoint.span();
        if checkpoint.cache != self.id || checkpoint.rings.len() != self.layers.len() {
            return Err(ModelError::InvalidInput("a checkpoint of another KV cache".into()));
        }
        if !(span.start <= len && len <= self.len && self.len <= span.end) {
            return Err(ModelError::InvalidInput(format!(
                "a rewind to {len} positions of a cache holding {}, with a checkpoint over positions {span:?}",
                self.len
            )));
        }
        let rejected = len..self.len;
        for (layer, saved) in self.layers.iter_mut().zip(&checkpoint.rings) {
            if let Some(saved) = saved {
                layer.restore(saved, span.start, rejected.clone())?;
            }
        }
        self.len = len;
        Ok(())
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
    ///
    /// Into a paged cache: `from` must be unpaged, and sequence `to` must hold blocks for
    /// `from`'s positions ([`KvCache::attach`]); its first `from.len()` positions are copied.
    pub fn copy_sequence(&mut self, to: usize, from: &KvCache<B>, from_sequence: usize) -> Result<(), ModelError> {
        self.check_sequences(to, from, from_sequence)?;
        if let Some(paging) = &self.paging {
            if from.paging.is_some() {
                return Err(ModelError::CacheMismatch("a sequence of a paged cache into another".into()));
            }
            let bs = paging.layout.block_size;
            for (layer, source) in self.layers.iter_mut().zip(&from.layers) {
                let pool = &paging.pools[layer.pool.ok_or(ModelError::CacheLost)?];
                // Shared blocks (a cached prefix's) are never written: their writes go to the sink.
                let blocks = pool.row_for_writes(to);
                if blocks.len() < pool.needed(from.len, bs) {
                    return Err(ModelError::CacheMismatch(format!(
                        "sequence {to} holds {} blocks of {bs} slots, {} positions need {}",
                        blocks.len(),
                        from.len,
                        pool.needed(from.len, bs)
                    )));
                }
                let source = source.store.as_ref().ok_or(ModelError::CacheLost)?;
                let rows = source.rows(from_sequence..from_sequence + 1);
                let store = layer.store.take().ok_or(ModelError::CacheLost)?;
                if let Err(mismatch) = store.check_blocks(&rows) {
                    layer.store = Some(store);
                    return Err(ModelError::CacheMismatch(mismatch.to_string()));
                }
                layer.store = Some(B::kv_scatter_blocks(store, &rows, &blocks, bs, from.len));
            }
            return Ok(());
        }
        for (layer, source) in self.layers.iter_mut().zip(&from.layers) {
            let rows = source.store.as_ref().ok_or(ModelError::CacheLost)?.rows(from_sequence..from_sequence + 1);
            layer.assign_sequence(to, rows)?;
        }
        Ok(())
    }

    /// Makes sequence `to` hold what sequence `from` holds (when `from` leaves the sequences
    /// that step together, the last one takes its place). In a paged cache `from`'s blocks
    /// become `to`'s (whose own go back to the pools) and `from` holds none.
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
        if let Some(paging) = &mut self.paging {
            for pool in &mut paging.pools {
                pool.move_row(from, to);
            }
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
