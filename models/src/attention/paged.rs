//! The blocks of a paged KV cache ([`crate::KvCache::paged`]): per group of layers with the
//! same slots per sequence (the full-attention layers, the sliding-window rings), a pool of
//! blocks of `block_size` slots shared by every sequence, and the table of each sequence's
//! blocks (see [`burn_gemma_kernels::kv::paged`]).
//!
//! A sequence's blocks are promised when it is admitted ([`Reservation`]) and taken when it
//! joins the cache ([`crate::KvCache::attach`]): a sequence holds blocks for the positions it
//! can reach (its prompt and the tokens it may generate), not for the cache's capacity, and a
//! ring holds at most its window. Nothing is ever taken from a sequence that holds it: a
//! reservation the pools cannot cover now is refused, and the caller waits for blocks to come
//! back.

use super::ring::WindowStore;
use burn_gemma_kernels::{BlockTable, GemmaBackend};
use std::collections::BTreeSet;

/// How a paged cache is sized.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PagedLayout {
    /// Sequences that can hold blocks at once (rows of the block tables).
    pub sequences: usize,
    /// Positions per sequence at most.
    pub capacity: usize,
    /// Slots per block: it must divide the capacity and every sliding window's ring
    /// ([`PagedLayout::block_size_for`] finds one).
    pub block_size: usize,
    /// Positions the full-attention layers hold over all sequences (each a pool of
    /// `positions / block_size` blocks); `None`: `sequences * capacity`, every sequence at
    /// full length at once. A ring's pool holds as many, up to `sequences` rings.
    pub positions: Option<usize>,
    /// Positions each sliding-window ring pool holds beyond the sequences' rings, for block
    /// copies kept outside them ([`crate::KvCache::take_block_set`]): a prefix cache keeps up
    /// to a sequence's length (`capacity`); 0 keeps none.
    pub ring_copies: usize,
    /// How the sliding-window layers keep their keys: rings of the window (the least memory),
    /// or a slot per position masked by the window, in the full-attention layers' pool, which
    /// draft rows need ([`crate::KvCache::set_draft_rows`]).
    pub window_store: WindowStore,
    /// Table rows past the `sequences` that hold no blocks of their own: a step's row there
    /// reads and writes the blocks of the sequence [`crate::KvCache::set_draft_rows`] points it
    /// at (a sequence's drafted positions in one batched verify step).
    pub draft_rows: usize,
}

impl PagedLayout {
    /// `sequences` of up to `capacity` positions in blocks of `block_size`, every sequence at
    /// full length at once, sliding windows in rings, no ring copies, no draft rows.
    pub fn new(sequences: usize, capacity: usize, block_size: usize) -> Self {
        Self {
            sequences,
            capacity,
            block_size,
            positions: None,
            ring_copies: 0,
            window_store: WindowStore::Ring,
            draft_rows: 0,
        }
    }

    /// The largest power of two up to `preferred` that divides `capacity` and the ring of every
    /// sliding-window layer (its window, or the capacity where that is smaller).
    pub fn block_size_for(config: &crate::GemmaConfig, capacity: usize, preferred: usize) -> usize {
        let mut slots: Vec<usize> = vec![capacity];
        slots.extend(config.layer_types.iter().filter_map(|&t| config.window(t)).map(|w| w.min(capacity)));
        let mut size = preferred.max(1).next_power_of_two();
        if size > preferred.max(1) {
            size /= 2;
        }
        while size > 1 && slots.iter().any(|s| !s.is_multiple_of(size)) {
            size /= 2;
        }
        size
    }
}

/// Blocks promised to one sequence before it joins a paged cache ([`crate::KvCache::reserve`]),
/// taken by [`crate::KvCache::attach`] or given back by [`crate::KvCache::release_reservation`].
#[derive(Debug)]
#[must_use = "a reservation holds blocks until it is attached or released"]
pub struct Reservation {
    pub(crate) cache: u64,
    pub(crate) positions: usize,
    /// Blocks promised per pool.
    pub(crate) blocks: Vec<usize>,
    /// Per pool, the cached prefix's blocks the sequence will share (the full-attention
    /// pools'), held for it.
    pub(crate) shared: Vec<Vec<u32>>,
    /// Per pool, the prefix's ring copies (the sliding-window pools'), held until they are
    /// copied into the prompt's cache ([`crate::KvCache::fill_prefix`]).
    pub(crate) rings: Vec<Vec<u32>>,
    /// Positions of the prefix it shares (the block sets it was made with).
    pub(crate) cached: usize,
}

impl Reservation {
    /// Positions the blocks cover.
    pub fn positions(&self) -> usize {
        self.positions
    }

    /// The prompt's first positions it shares ([`crate::KvCache::reserve_sharing`]): the
    /// prompt runs from there ([`crate::KvCache::fill_prefix`]).
    pub fn cached_positions(&self) -> usize {
        self.cached
    }
}

/// One block of every pool of a paged cache, held for a block of positions kept outside the
/// sequences ([`crate::KvCache::take_block_set`]): a prefix cache's node. Its blocks stay held
/// until [`crate::KvCache::release_block_set`] gives them up.
#[derive(Debug)]
pub struct BlockSet {
    pub(crate) cache: u64,
    /// One block per pool.
    pub(crate) blocks: Vec<u32>,
}

/// Why [`crate::KvCache::take_block_set`] took nothing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BlockShortfall {
    /// The cache is not paged, or the reservation is another cache's.
    NotThisCache,
    /// The reservation has no promised block left in a full-attention pool.
    Promise,
    /// A sliding-window pool has no free block that is not promised.
    Free,
}

/// The blocks of one group of layers.
///
/// A block is held by the sequences whose rows name it, by block sets
/// ([`BlockSet`]: a prefix cache's) and by reservations that pin it; it is free when none holds it
/// (`refs` counts the holders).
#[derive(Debug)]
pub(crate) struct BlockPool<B: GemmaBackend> {
    /// Logical slots per sequence.
    pub slots: usize,
    /// Blocks sequences can take (the sink excluded).
    pub total: usize,
    free: BTreeSet<u32>,
    /// Holders of each block (the sink's is never counted).
    refs: Vec<u32>,
    /// Free blocks promised to reservations.
    promised: usize,
    /// Each sequence's blocks, in slot order.
    rows: Vec<Vec<u32>>,
    /// Per sequence, how many of its first blocks it shares (a cached prefix's): written by
    /// nobody, so a copy into the sequence skips them.
    shared: Vec<usize>,
    /// Per table row, the sequence whose blocks a draft row reads and writes (its own row
    /// holds none).
    pointed: Vec<Option<usize>>,
    /// A block no sequence takes: table entries past a sequence's blocks point to it (never
    /// read for a sequence's own positions: it never reaches the slots it holds no block for),
    /// and writes meant for no block go to it.
    sink: u32,
    /// The device table, `None` after a change until it is uploaded again.
    table: Option<BlockTable<B>>,
    /// Changes of the rows so far (a recorded step writes the table again after one).
    pub changes: u64,
}

impl<B: GemmaBackend> BlockPool<B> {
    /// A pool of `total` blocks (and the sink) for `sequences` of `slots` slots.
    pub fn new(slots: usize, total: usize, sequences: usize) -> Self {
        Self {
            slots,
            total,
            free: (0..total as u32).collect(),
            refs: vec![0; total],
            promised: 0,
            rows: vec![Vec::new(); sequences],
            shared: vec![0; sequences],
            pointed: vec![None; sequences],
            sink: total as u32,
            table: None,
            changes: 0,
        }
    }

    /// Blocks in the store, the sink included.
    pub fn store_blocks(&self) -> usize {
        self.total + 1
    }

    /// The block that takes writes meant for no block.
    pub fn sink(&self) -> u32 {
        self.sink
    }

    /// Blocks a sequence of `positions` positions holds.
    pub fn needed(&self, positions: usize, block_size: usize) -> usize {
        positions.min(self.slots).div_ceil(block_size)
    }

    /// Free blocks not promised.
    pub fn available(&self) -> usize {
        self.free.len().saturating_sub(self.promised)
    }

    /// Blocks some holder holds.
    pub fn in_use(&self) -> usize {
        self.total - self.free.len()
    }

    /// Holders of `block`.
    pub fn holders(&self, block: u32) -> u32 {
        self.refs.get(block as usize).copied().unwrap_or(0)
    }

    pub fn promise(&mut self, n: usize) {
        self.promised += n;
    }

    pub fn unpromise(&mut self, n: usize) {
        self.promised = self.promised.saturating_sub(n);
    }

    /// Sequence `row`'s blocks.
    pub fn row(&self, row: usize) -> &[u32] {
        self.rows.get(row).map_or(&[], Vec::as_slice)
    }

    /// Sequence `row`'s blocks as a copy into it writes them: the shared ones at the sink.
    pub fn row_for_writes(&self, row: usize) -> Vec<u32> {
        let shared = self.shared.get(row).copied().unwrap_or(0);
        self.row(row).iter().enumerate().map(|(i, &b)| if i < shared { self.sink } else { b }).collect()
    }

    /// `n` free blocks (the lowest, so that a sequence's blocks tend to lie in runs), each
    /// held once by the caller; `promised`: taken from the promised ones.
    fn take_free(&mut self, n: usize, promised: bool) -> Vec<u32> {
        let taken: Vec<u32> = self.free.iter().take(n).copied().collect();
        for &b in &taken {
            self.free.remove(&b);
            self.refs[b as usize] = 1;
        }
        if promised {
            self.unpromise(n);
        }
        taken
    }

    /// Gives sequence `row` `n` promised blocks, after any it holds.
    pub fn take(&mut self, row: usize, n: usize) {
        let taken = self.take_free(n, true);
        self.rows[row].extend(taken);
        self.changed();
    }

    /// `n` blocks for a block set: promised ones (`Promised`), or ones free and not
    /// promised; `None`, taking nothing, where there are not `n` of them.
    pub fn hold(&mut self, n: usize, from: Source) -> Option<Vec<u32>> {
        match from {
            Source::Promised if self.promised >= n && self.free.len() >= n => Some(self.take_free(n, true)),
            Source::Available if self.available() >= n => Some(self.take_free(n, false)),
            _ => None,
        }
    }

    /// One more holder of `block`.
    pub fn retain(&mut self, block: u32) {
        if let Some(r) = self.refs.get_mut(block as usize) {
            *r += 1;
        }
    }

    /// One holder less of `block`, which is free when none is left.
    pub fn release(&mut self, block: u32) {
        if let Some(r) = self.refs.get_mut(block as usize).filter(|r| **r > 0) {
            *r -= 1;
            if *r == 0 {
                self.free.insert(block);
            }
        }
    }

    /// Sequence `row` takes `blocks` as its first blocks, shared (their holds pass to it): it
    /// must hold none yet.
    pub fn share(&mut self, row: usize, blocks: &[u32]) {
        if blocks.is_empty() {
            return;
        }
        self.rows[row].splice(0..0, blocks.iter().copied());
        self.shared[row] = blocks.len();
        self.changed();
    }

    /// Sequence `row`'s holds given up.
    pub fn give_back(&mut self, row: usize) {
        let blocks = std::mem::take(&mut self.rows[row]);
        self.shared[row] = 0;
        if !blocks.is_empty() {
            for b in blocks {
                self.release(b);
            }
            self.changed();
        }
    }

    /// Sequence `from`'s blocks become sequence `to`'s (which gives its own back first).
    pub fn move_row(&mut self, from: usize, to: usize) {
        self.give_back(to);
        self.rows[to] = std::mem::take(&mut self.rows[from]);
        self.shared[to] = std::mem::take(&mut self.shared[from]);
        self.changed();
    }

    /// Points each draft row `(row, sequence)` of `rows` at the sequence's blocks, and every
    /// other row at its own (the caller checked the rows: see [`crate::KvCache::set_draft_rows`]).
    pub fn point(&mut self, rows: &[(usize, usize)]) {
        if rows.is_empty() && self.pointed.iter().all(Option::is_none) {
            return;
        }
        let mut pointed = vec![None; self.rows.len()];
        for &(row, sequence) in rows {
            pointed[row] = Some(sequence);
        }
        if pointed != self.pointed {
            self.pointed = pointed;
            self.repointed();
        }
    }

    /// The rows changed: the device table is stale, and draft rows point nowhere (the
    /// sequences they pointed at may have moved or left).
    fn changed(&mut self) {
        self.pointed.iter_mut().for_each(|p| *p = None);
        self.table = None;
        self.changes += 1;
    }

    /// The draft rows changed: the device table is stale.
    fn repointed(&mut self) {
        self.table = None;
        self.changes += 1;
    }

    /// The table on the host: a row per sequence, `slots / block_size` wide, entries past a
    /// sequence's blocks at the sink.
    pub fn table_rows(&self, block_size: usize) -> Vec<Vec<u32>> {
        let width = self.slots / block_size.max(1);
        let blocks = |row: usize| self.pointed[row].map_or(&self.rows[row], |sequence| &self.rows[sequence]);
        (0..self.rows.len())
            .map(|row| blocks(row).iter().copied().chain(std::iter::repeat(self.sink)).take(width).collect())
            .collect()
    }

    /// The device table (uploaded again after a change): a row per sequence, entries past its
    /// blocks at the sink.
    pub fn table(&mut self, block_size: usize, device: &B::Device) -> BlockTable<B> {
        if let Some(table) = &self.table {
            return table.clone();
        }
        let table = BlockTable::from_rows(&self.table_rows(block_size), block_size, device);
        self.table = Some(table.clone());
        table
    }
}

/// Where [`BlockPool::hold`] takes its blocks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Source {
    /// Blocks a reservation promised (the sequence's own positions, held by the index instead).
    Promised,
    /// Free blocks nobody was promised.
    Available,
}

#[cfg(test)]
mod tests {
    use super::*;
    type B = burn::backend::NdArray<f32>;

    #[test]
    fn pools_take_the_lowest_blocks_and_take_them_back() {
        let mut pool = BlockPool::<B>::new(8, 6, 3);
        assert_eq!((pool.needed(5, 2), pool.needed(20, 2)), (3, 4));
        pool.promise(3);
        assert_eq!(pool.available(), 3);
        pool.take(1, 3);
        assert_eq!((pool.row(1), pool.available(), pool.in_use()), (&[0u32, 1, 2][..], 3, 3));
        pool.promise(2);
        pool.take(2, 2);
        pool.give_back(1);
        assert_eq!(pool.available(), 4);
        pool.move_row(2, 0);
        assert_eq!((pool.row(0), pool.row(2)), (&[3u32, 4][..], &[][..]));
        let table = pool.table(2, &Default::default());
        let rows = table.rows().unwrap_or_default();
        assert_eq!(rows, vec![vec![3, 4, 6, 6], vec![6; 4], vec![6; 4]]);
    }

    #[test]
    fn shared_blocks_are_free_only_when_their_last_holder_lets_go() {
        let mut pool = BlockPool::<B>::new(8, 6, 2);
        // The index holds two blocks of a promise, then a sequence shares them.
        pool.promise(3);
        let held = pool.hold(2, Source::Promised).unwrap_or_default();
        assert_eq!((held.as_slice(), pool.available(), pool.in_use()), (&[0u32, 1][..], 3, 2));
        assert_eq!(pool.hold(2, Source::Promised), None, "one promised block is left");
        for &b in &held {
            pool.retain(b);
        }
        pool.share(0, &held);
        pool.take(0, 1);
        assert_eq!((pool.row(0), pool.row_for_writes(0)), (&[0u32, 1, 2][..], vec![6, 6, 2]));
        assert_eq!(pool.holders(0), 2);
        // The sequence leaves: its own block is free, the shared ones still held by the index.
        pool.give_back(0);
        assert_eq!((pool.in_use(), pool.holders(0), pool.holders(2)), (2, 1, 0));
        for b in held {
            pool.release(b);
        }
        assert_eq!((pool.in_use(), pool.available()), (0, 6));
        assert_eq!(pool.hold(7, Source::Available), None);
    }

    #[test]
    fn draft_rows_read_their_sequences_blocks_until_the_blocks_change() {
        let mut pool = BlockPool::<B>::new(8, 6, 4);
        pool.promise(3);
        pool.take(0, 2);
        pool.take(1, 1);
        pool.point(&[(2, 0), (3, 1)]);
        let rows = pool.table(2, &Default::default()).rows().unwrap_or_default();
        assert_eq!(rows, vec![vec![0, 1, 6, 6], vec![2, 6, 6, 6], vec![0, 1, 6, 6], vec![2, 6, 6, 6]]);
        // Held by nobody: the pointing rows take none of the blocks.
        assert_eq!((pool.in_use(), pool.holders(0), pool.holders(2)), (3, 1, 1));
        // The same rows again change nothing; others re-point them, a change of the table (a
        // recorded step writes it again).
        let changes = pool.changes;
        pool.point(&[(2, 0), (3, 1)]);
        pool.point(&[(3, 0)]);
        let rows = pool.table(2, &Default::default()).rows().unwrap_or_default();
        assert_eq!((rows[2].clone(), rows[3].clone()), (vec![6; 4], vec![0, 1, 6, 6]));
        assert_eq!(pool.changes, changes + 1, "one change of the table");
        // A sequence moving or leaving points every draft row nowhere.
        pool.move_row(0, 1);
        let rows = pool.table(2, &Default::default()).rows().unwrap_or_default();
        assert_eq!(rows, vec![vec![6; 4], vec![0, 1, 6, 6], vec![6; 4], vec![6; 4]]);
    }
}
