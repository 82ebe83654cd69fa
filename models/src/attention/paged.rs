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
}

impl PagedLayout {
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
    /// Blocks per pool.
    pub(crate) blocks: Vec<usize>,
}

impl Reservation {
    /// Positions the blocks cover.
    pub fn positions(&self) -> usize {
        self.positions
    }
}

/// The blocks of one group of layers.
#[derive(Debug)]
pub(crate) struct BlockPool<B: GemmaBackend> {
    /// Logical slots per sequence.
    pub slots: usize,
    /// Blocks sequences can take (the sink excluded).
    pub total: usize,
    free: BTreeSet<u32>,
    /// Free blocks promised to reservations.
    promised: usize,
    /// Each sequence's blocks, in slot order.
    rows: Vec<Vec<u32>>,
    /// A block no sequence takes: table entries past a sequence's blocks point to it (never
    /// read: a sequence never reaches the slots it holds no block for).
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
            promised: 0,
            rows: vec![Vec::new(); sequences],
            sink: total as u32,
            table: None,
            changes: 0,
        }
    }

    /// Blocks in the store, the sink included.
    pub fn store_blocks(&self) -> usize {
        self.total + 1
    }

    /// Blocks a sequence of `positions` positions holds.
    pub fn needed(&self, positions: usize, block_size: usize) -> usize {
        positions.min(self.slots).div_ceil(block_size)
    }

    /// Free blocks not promised.
    pub fn available(&self) -> usize {
        self.free.len().saturating_sub(self.promised)
    }

    pub fn in_use(&self) -> usize {
        self.total - self.free.len()
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

    /// Gives sequence `row` `n` promised blocks (the lowest free ones, so that a sequence's
    /// blocks tend to lie in runs), after any it holds.
    pub fn take(&mut self, row: usize, n: usize) {
        let taken: Vec<u32> = self.free.iter().take(n).copied().collect();
        for b in &taken {
            self.free.remove(b);
        }
        self.unpromise(n);
        self.rows[row].extend(taken);
        self.changed();
    }

    /// Sequence `row`'s blocks back to the pool.
    pub fn give_back(&mut self, row: usize) {
        let blocks = std::mem::take(&mut self.rows[row]);
        if !blocks.is_empty() {
            self.free.extend(blocks);
            self.changed();
        }
    }

    /// Sequence `from`'s blocks become sequence `to`'s (which gives its own back first).
    pub fn move_row(&mut self, from: usize, to: usize) {
        self.give_back(to);
        self.rows[to] = std::mem::take(&mut self.rows[from]);
        self.changed();
    }

    /// The rows changed: the device table is stale.
    fn changed(&mut self) {
        self.table = None;
        self.changes += 1;
    }

    /// The table on the host: a row per sequence, `slots / block_size` wide, entries past a
    /// sequence's blocks at the sink.
    pub fn table_rows(&self, block_size: usize) -> Vec<Vec<u32>> {
        let width = self.slots / block_size.max(1);
        self.rows.iter().map(|r| r.iter().copied().chain(std::iter::repeat(self.sink)).take(width).collect()).collect()
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
}
