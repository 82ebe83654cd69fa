//! A paged cache's block-level operations: sizes and counts, reservations, block sets (a
//! prefix cache's copies), sequences joining and leaving, draft rows and the block tables.
//! The policy over them (what a prefix cache keeps) is the engine's.

use super::super::paged::{BlockSet, BlockShortfall, PagedLayout, Reservation, Source};
use super::KvCache;
use crate::ModelError;
use burn_gemma_kernels::{BlockTable, GemmaBackend};

impl<B: GemmaBackend> KvCache<B> {
    /// Slots per block of a paged cache.
    pub fn block_size(&self) -> Option<usize> {
        self.paging.as_ref().map(|p| p.layout.block_size)
    }

    /// A paged cache's blocks: `(held, in all)`, summed over its pools. A block is held by a
    /// sequence, a reservation or a block set ([`KvCache::take_block_set`]).
    pub fn blocks_in_use(&self) -> Option<(usize, usize)> {
        let paging = self.paging.as_ref()?;
        Some(paging.pools.iter().fold((0, 0), |(used, all), pool| (used + pool.in_use(), all + pool.total)))
    }

    /// The most positions one sequence of a paged cache can ever hold blocks for (all its
    /// pools' blocks); `None` for an unpaged cache.
    pub fn reservable_positions(&self) -> Option<usize> {
        let paging = self.paging.as_ref()?;
        let bs = paging.layout.block_size;
        // A sequence needs at most a pool's slots per sequence (a ring: its window's): only a
        // pool holding fewer than that limits.
        let smallest = paging.pools.iter().filter(|p| p.total * bs < p.slots).map(|p| p.total * bs).min();
        Some(smallest.map_or(self.capacity, |held| held.min(self.capacity)))
    }

    /// The fewest slots per sequence of a paged cache's sliding-window rings (`None` without
    /// rings or paging): a prompt run in chunks of at most this many positions can have every
    /// block copied out ([`KvCache::copy_into_block_sets`]), as each ring still holds a chunk's
    /// positions after it.
    pub fn ring_slots(&self) -> Option<usize> {
        let paging = self.paging.as_ref()?;
        (0..paging.pools.len()).filter(|&p| paging.is_ring(p)).map(|p| paging.pools[p].slots).min()
    }

    /// Whether [`KvCache::reserve_sharing`] of `positions` sharing `sharing` block sets would
    /// succeed now. [`ModelError::KvBlocks`]: not now (blocks come back as holders leave);
    /// [`ModelError::InvalidInput`]: never (more positions than the pools hold, or no paging).
    pub fn check_reservable(&self, positions: usize, sharing: usize) -> Result<(), ModelError> {
        let positions = positions.min(self.capacity);
        if let Some(limit) = self.reservable_positions().filter(|&limit| positions > limit) {
            return Err(ModelError::InvalidInput(format!(
                "a sequence of {positions} positions: the paged KV cache's pools hold {limit} at most"
            )));
        }
        let paging = self
            .paging
            .as_ref()
            .ok_or_else(|| ModelError::InvalidInput("a reservation in an unpaged KV cache".into()))?;
        let bs = paging.layout.block_size;
        for (p, pool) in paging.pools.iter().enumerate() {
            let shared = if paging.is_ring(p) { 0 } else { sharing };
            let needed = pool.needed(positions, bs).saturating_sub(shared);
            if pool.available() < needed {
                return Err(ModelError::KvBlocks { needed, available: pool.available(), block_size: bs });
            }
        }
        Ok(())
    }

    /// Promises a sequence of up to `positions` positions the blocks it needs in every pool of
    /// a paged cache, for [`KvCache::attach`]. Fails, promising nothing, where the pools cannot
    /// cover it now ([`ModelError::KvBlocks`]: wait for sequences to leave) or ever.
    pub fn reserve(&mut self, positions: usize) -> Result<Reservation, ModelError> {
        self.reserve_sharing(positions, &[])
    }

    /// [`KvCache::reserve`] for a sequence whose first positions are `prefix`, block sets of
    /// this cache in order (a cached prompt prefix): the sequence shares their full-attention
    /// blocks and is promised only the rest; their ring copies are held until
    /// [`KvCache::fill_prefix`] puts the prefix into the prompt's cache. Fails as
    /// [`KvCache::check_reservable`] says, holding nothing.
    pub fn reserve_sharing(&mut self, positions: usize, prefix: &[&BlockSet]) -> Result<Reservation, ModelError> {
        let id = self.id;
        if prefix.iter().any(|set| set.cache != id) {
            return Err(ModelError::CacheMismatch("a block set of another KV cache".into()));
        }
        self.check_reservable(positions, prefix.len())?;
        let positions = positions.min(self.capacity);
        let paging = self
            .paging
            .as_mut()
            .ok_or_else(|| ModelError::InvalidInput("a reservation in an unpaged KV cache".into()))?;
        let bs = paging.layout.block_size;
        let pools = paging.pools.len();
        let (mut shared, mut rings) = (vec![Vec::new(); pools], vec![Vec::new(); pools]);
        for set in prefix {
            for (p, &b) in set.blocks.iter().enumerate().take(pools) {
                paging.pools[p].retain(b);
                if paging.is_ring(p) { &mut rings[p] } else { &mut shared[p] }.push(b);
            }
        }
        let blocks: Vec<usize> =
            paging.pools.iter().zip(&shared).map(|(p, s)| p.needed(positions, bs).saturating_sub(s.len())).collect();
        for (pool, &need) in paging.pools.iter_mut().zip(&blocks) {
            pool.promise(need);
        }
        Ok(Reservation { cache: id, positions, blocks, shared, rings, cached: prefix.len() * bs })
    }

    /// Puts the prefix `reservation` shares into `prompt`, an empty unpaged cache of one
    /// sequence for the same model and capacity: afterwards it holds the prefix's positions (its
    /// length is [`Reservation::cached_positions`]) and the prompt runs on from there. The
    /// reservation's ring copies are given up.
    pub fn fill_prefix(&mut self, reservation: &mut Reservation, prompt: &mut KvCache<B>) -> Result<(), ModelError> {
        if reservation.cached == 0 {
            return Ok(());
        }
        let fail = |why: String| Err(ModelError::CacheMismatch(why));
        if reservation.cache != self.id {
            return fail("a reservation made in another KV cache".into());
        }
        if prompt.paging.is_some() || prompt.batch != 1 || !prompt.is_empty() {
            return fail("a cached prefix goes into an empty unpaged cache of one sequence".into());
        }
        if prompt.layer_of != self.layer_of || prompt.capacity != self.capacity {
            return fail("a cached prefix into a cache of another shape".into());
        }
        let Some(paging) = &self.paging else { return fail("a prefix from an unpaged KV cache".into()) };
        let bs = paging.layout.block_size;
        let m = reservation.cached / bs;
        for (layer, into) in self.layers.iter().zip(&mut prompt.layers) {
            let p = layer.pool.ok_or(ModelError::CacheLost)?;
            // A ring holds the prefix's last window: its last `width` blocks.
            let held = if paging.is_ring(p) { &reservation.rings[p] } else { &reservation.shared[p] };
            let width = paging.pools[p].slots / bs;
            let row = paging.row_of(p, held.iter().copied().enumerate().skip(m.saturating_sub(width)));
            let table = BlockTable::<B>::from_rows(&[row], bs, &paging.device);
            let store = layer.store.as_ref().ok_or(ModelError::CacheLost)?;
            into.assign_sequence(0, burn_gemma_kernels::kv::paged::gather_reference(store, &table, 1))?;
        }
        prompt.len = reservation.cached;
        self.release_rings(reservation);
        Ok(())
    }

    /// Gives up the ring copies `reservation` holds.
    fn release_rings(&mut self, reservation: &mut Reservation) {
        if let Some(paging) = self.paging.as_mut().filter(|_| reservation.cache == self.id) {
            for (pool, rings) in paging.pools.iter_mut().zip(&mut reservation.rings) {
                rings.drain(..).for_each(|b| pool.release(b));
            }
        }
    }

    /// A block of every pool, held for a block of positions kept outside the sequences (a
    /// prefix cache's node): each full-attention pool's taken from `reservation`'s promise (its
    /// sequence shares the block when it joins), each ring pool's from the free blocks (a copy
    /// of the ring's positions). Takes nothing where a pool cannot give one.
    pub fn take_block_set(&mut self, reservation: &mut Reservation) -> Result<BlockSet, BlockShortfall> {
        let id = self.id;
        let Some(paging) = self.paging.as_mut().filter(|_| reservation.cache == id) else {
            return Err(BlockShortfall::NotThisCache);
        };
        let pools = paging.pools.len();
        if (0..pools).any(|p| !paging.is_ring(p) && reservation.blocks.get(p).is_none_or(|&n| n == 0)) {
            return Err(BlockShortfall::Promise);
        }
        if (0..pools).any(|p| paging.is_ring(p) && paging.pools[p].available() == 0) {
            return Err(BlockShortfall::Free);
        }
        let mut blocks = Vec::with_capacity(pools);
        for p in 0..pools {
            let source = if paging.is_ring(p) { Source::Available } else { Source::Promised };
            let Some(taken) = paging.pools[p].hold(1, source) else {
                // Checked above: nothing else takes blocks in between.
                blocks.iter().enumerate().for_each(|(q, &b)| paging.pools[q].release(b));
                return Err(BlockShortfall::Free);
            };
            let b = taken[0];
            if !paging.is_ring(p) {
                reservation.blocks[p] -= 1;
                // Held by the set and by the sequence, which shares it.
                paging.pools[p].retain(b);
                reservation.shared[p].push(b);
            }
            blocks.push(b);
        }
        Ok(BlockSet { cache: id, blocks })
    }

    /// Copies positions of `prompt` (an unpaged cache of one sequence, of this cache's shape)
    /// into block sets: `sets[i]` gets block `first + i` of its positions, up to `len`.
    pub fn copy_into_block_sets(
        &mut self,
        prompt: &KvCache<B>,
        first: usize,
        sets: &[&BlockSet],
        len: usize,
    ) -> Result<(), ModelError> {
        if sets.is_empty() {
            return Ok(());
        }
        if prompt.paging.is_some() || prompt.layer_of != self.layer_of || prompt.capacity != self.capacity {
            return Err(ModelError::CacheMismatch("a prefix cached from a cache of another shape".into()));
        }
        if sets.iter().any(|set| set.cache != self.id) {
            return Err(ModelError::CacheMismatch("a block set of another KV cache".into()));
        }
        let Some(paging) = self.paging.as_ref() else {
            return Err(ModelError::CacheMismatch("block sets of an unpaged KV cache".into()));
        };
        let bs = paging.layout.block_size;
        let len = len.min(prompt.len);
        // The sets' positions (the other blocks' writes go to the sink).
        for (layer, source) in self.layers.iter_mut().zip(&prompt.layers) {
            let p = layer.pool.ok_or(ModelError::CacheLost)?;
            let placed = sets.iter().enumerate().filter_map(|(i, set)| set.blocks.get(p).map(|&b| (first + i, b)));
            let row = paging.row_of(p, placed);
            let rows = source.store.as_ref().ok_or(ModelError::CacheLost)?.rows(0..1);
            let store = layer.store.take().ok_or(ModelError::CacheLost)?;
            let len = len.min(paging.pools[p].slots);
            layer.store = Some(B::kv_scatter_blocks(store, &rows, &row, bs, len));
        }
        Ok(())
    }

    /// Gives up a block set's holds (a set of another cache is dropped).
    pub fn release_block_set(&mut self, set: BlockSet) {
        if let Some(paging) = self.paging.as_mut().filter(|_| set.cache == self.id) {
            for (pool, &b) in paging.pools.iter_mut().zip(&set.blocks) {
                pool.release(b);
            }
        }
    }

    /// Blocks of `set` that only it holds (no sequence or reservation shares them).
    pub fn held_only_by(&self, set: &BlockSet) -> usize {
        let Some(paging) = self.paging.as_ref().filter(|_| set.cache == self.id) else { return 0 };
        paging.pools.iter().zip(&set.blocks).filter(|(pool, &b)| pool.holders(b) == 1).count()
    }

    /// Gives back the blocks `reservation` promised and the prefix it held (its sequence never
    /// joined).
    pub fn release_reservation(&mut self, mut reservation: Reservation) {
        self.release_rings(&mut reservation);
        if let Some(paging) = self.paging.as_mut().filter(|_| reservation.cache == self.id) {
            for ((pool, &n), shared) in paging.pools.iter_mut().zip(&reservation.blocks).zip(&reservation.shared) {
                pool.unpromise(n);
                shared.iter().for_each(|&b| pool.release(b));
            }
        }
    }

    /// Gives sequence `sequence` the blocks `reservation` promised (after any it holds) and
    /// the cached prefix's it shares (a sequence sharing a prefix must hold no blocks yet; a
    /// reservation of another cache is refused and its promise lost with it).
    pub fn attach(&mut self, sequence: usize, mut reservation: Reservation) -> Result<(), ModelError> {
        let fail = |why: String| Err(ModelError::CacheMismatch(why));
        if reservation.cache != self.id {
            return fail("a reservation made in another KV cache".into());
        }
        if sequence >= self.batch {
            return fail(format!("sequence {sequence} of a cache of {} sequences", self.batch));
        }
        let Some(paging) = self.paging.as_ref() else { return fail("blocks for an unpaged KV cache".into()) };
        if sequence >= paging.layout.sequences {
            return fail(format!("blocks for draft row {sequence}, which holds none of its own"));
        }
        let shares = reservation.shared.iter().any(|s| !s.is_empty());
        if shares && paging.pools.iter().any(|p| !p.row(sequence).is_empty()) {
            self.release_reservation(reservation);
            return fail(format!("a shared prefix for sequence {sequence}, which holds blocks already"));
        }
        self.release_rings(&mut reservation);
        let Some(paging) = self.paging.as_mut() else { return fail("blocks for an unpaged KV cache".into()) };
        for ((pool, &n), shared) in paging.pools.iter_mut().zip(&reservation.blocks).zip(&reservation.shared) {
            pool.share(sequence, shared);
            pool.take(sequence, n);
        }
        Ok(())
    }

    /// Gives sequence `sequence`'s blocks back to the pools of a paged cache.
    pub fn release(&mut self, sequence: usize) {
        if let Some(paging) = self.paging.as_mut().filter(|_| sequence < self.batch) {
            for pool in &mut paging.pools {
                pool.give_back(sequence);
            }
        }
    }

    /// The layout a paged cache was made with (`None` for an unpaged cache): a fresh cache of
    /// the same shape takes it.
    pub fn paged_layout(&self) -> Option<PagedLayout> {
        self.paging.as_ref().map(|p| p.layout)
    }

    /// Points draft rows at sequences for the next decode steps, until set again (an empty
    /// list: no draft rows): each `(row, sequence)` makes step row `row` read and write the
    /// blocks of `sequence`, so that a step can run a sequence's drafted positions
    /// `p + 1, ..., p + k` as rows of their own beside its own row at `p` (every row's keys and
    /// values are written before any row attends; each attends up to its own position).
    ///
    /// The cache must keep every position of its sliding windows ([`WindowStore::EveryPosition`]:
    /// a ring would wrap a drafted position over a key an earlier row reads). A draft row is a
    /// row past the generating sequences that holds no blocks of its own, the sequence one
    /// that holds blocks for the drafted positions. Refused, changing nothing, otherwise.
    pub fn set_draft_rows(&mut self, rows: &[(usize, usize)]) -> Result<(), ModelError> {
        let fail = |why: String| Err(ModelError::InvalidInput(why));
        let batch = self.batch;
        let Some(paging) = self.paging.as_mut() else { return fail("draft rows in an unpaged KV cache".into()) };
        if !rows.is_empty() && (0..paging.pools.len()).any(|p| paging.is_ring(p)) {
            return fail(
                "draft rows in a paged KV cache whose sliding windows are rings (PagedLayout::window_store: \
                 WindowStore::EveryPosition)"
                    .into(),
            );
        }
        let mut taken = vec![false; batch];
        for &(row, sequence) in rows {
            if row >= batch || sequence >= batch {
                return fail(format!("draft row {row} for sequence {sequence} in a cache of {batch} rows"));
            }
            if std::mem::replace(&mut taken[row], true) {
                return fail(format!("draft row {row} given twice"));
            }
            if paging.pools.iter().any(|p| !p.row(row).is_empty()) {
                return fail(format!("draft row {row} holds blocks of its own"));
            }
            if paging.pools.iter().any(|p| p.row(sequence).is_empty()) {
                return fail(format!("draft row {row} for sequence {sequence}, which holds no blocks"));
            }
        }
        for pool in &mut paging.pools {
            pool.point(rows);
        }
        Ok(())
    }

    /// A paged cache's block tables as its layers read them (uploaded where they changed): a
    /// recorded step keeps their buffers, and has the rows of [`KvCache::table_rows`] written
    /// into them before each replay. None for an unpaged cache.
    pub(crate) fn block_tables(&mut self) -> Vec<BlockTable<B>> {
        self.sync_blocks();
        let Some(paging) = self.paging.as_mut() else { return Vec::new() };
        paging.pools.iter_mut().map(|p| p.table(paging.layout.block_size, &paging.device)).collect()
    }

    /// Changes of a paged cache's block tables so far (0 for an unpaged cache): while it stays
    /// the same, so do the tables.
    pub(crate) fn blocks_version(&self) -> u64 {
        self.paging.as_ref().map_or(0, |p| p.pools.iter().map(|pool| pool.changes).sum())
    }

    /// The host rows of a paged cache's block tables, in the order of [`KvCache::block_tables`].
    pub(crate) fn table_rows(&self) -> Vec<Vec<Vec<u32>>> {
        self.paging
            .as_ref()
            .map_or(Vec::new(), |p| p.pools.iter().map(|pool| pool.table_rows(p.layout.block_size)).collect())
    }

    /// Uploads a paged cache's block tables where they changed, and hands each layer its
    /// pool's (before a decode step).
    pub(crate) fn sync_blocks(&mut self) {
        let Some(paging) = self.paging.as_mut() else { return };
        let tables: Vec<BlockTable<B>> =
            paging.pools.iter_mut().map(|p| p.table(paging.layout.block_size, &paging.device)).collect();
        for layer in &mut self.layers {
            layer.blocks = layer.pool.and_then(|p| tables.get(p).cloned());
        }
    }
}
