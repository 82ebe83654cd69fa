//! The engine's KV manager: the batched paged cache's blocks for the sequences, and the prefix
//! cache on top of them.
//!
//! The model crate keeps the mechanism: pools, block tables, reservations and block sets
//! ([`KvCache::reserve_sharing`], [`KvCache::take_block_set`]). This holds the policy: which
//! prompt prefixes stay cached ([`prefix::PrefixIndex`]), which are given up for room (the
//! least recently used first), and what a prompt finds cached at admission.

mod prefix;

use super::config::PrefixCache;
use crate::{BlockSet, BlockShortfall, GemmaBackend, KvCache, ModelError, Reservation};
use prefix::{NodeKey, PrefixIndex};

/// What the prefix cache holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct PrefixStats {
    /// Blocks, summed over the pools, that only the index holds (no sequence shares them).
    pub held_only: usize,
    /// Prompt blocks given up for room so far.
    pub given_up: u64,
}

/// The blocks a running prompt will hold in the batched cache, and its prefix in the index.
#[derive(Debug)]
#[must_use = "prompt blocks hold KV blocks until they are attached or released"]
pub(super) struct PromptBlocks {
    reservation: Reservation,
    /// The prefix's nodes: found at admission, then the ones the prompt adds.
    prefix: Vec<NodeKey>,
}

impl PromptBlocks {
    /// Positions the blocks cover.
    pub(super) fn positions(&self) -> usize {
        self.reservation.positions()
    }

    /// The prompt's first positions found cached at admission: the prompt runs from there.
    pub(super) fn cached_positions(&self) -> usize {
        self.reservation.cached_positions()
    }

    /// Blocks of the prompt's prefix in the index: found at admission, and cached since.
    pub(super) fn prefix_blocks(&self) -> usize {
        self.prefix.len()
    }
}

/// The batched cache and its prefix index.
pub(super) struct KvManager<B: GemmaBackend> {
    /// The generating sequences' keys and values: its first sequences.
    pub(super) rows: KvCache<B>,
    /// Cached prompt prefixes ([`PrefixCache::On`]; `None` for an unpaged cache).
    prefix: Option<PrefixIndex<BlockSet>>,
    /// Nodes the index gave up for room so far.
    given_up: u64,
}

impl<B: GemmaBackend> KvManager<B> {
    /// A manager of `rows` (paged, with [`crate::PagedLayout::ring_copies`] for the prefix
    /// index's ring copies where `prefix_cache` is on).
    pub(super) fn new(rows: KvCache<B>, prefix_cache: PrefixCache) -> Self {
        let prefix = match (prefix_cache, rows.block_size()) {
            (PrefixCache::On, Some(_)) => Some(PrefixIndex::default()),
            _ => None,
        };
        Self { rows, prefix, given_up: 0 }
    }

    /// Gives up the index's least recently used node (none of `keep`); whether there was one.
    fn give_up_one(&mut self, keep: &[NodeKey]) -> bool {
        let Some(set) = self.prefix.as_mut().and_then(|index| index.evict(keep)) else { return false };
        self.given_up += 1;
        self.rows.release_block_set(set);
        true
    }

    /// The longest cached chain `prompt` starts with: whole blocks, within its first `limit`
    /// positions and without its last token (whose logits a prompt needs).
    fn longest(&mut self, prompt: &[u32], limit: usize) -> Vec<NodeKey> {
        let (Some(index), Some(bs)) = (self.prefix.as_mut(), self.rows.block_size()) else { return Vec::new() };
        let max_blocks = prompt.len().saturating_sub(1).min(limit) / bs;
        index.longest(prompt, bs, max_blocks)
    }

    /// Positions of `prompt` the index holds (whole blocks, its last token left out).
    pub(super) fn cached_prefix(&mut self, prompt: &[u32]) -> usize {
        let capacity = self.rows.capacity();
        self.longest(prompt, capacity).len() * self.rows.block_size().unwrap_or(0)
    }

    /// Promises a sequence of up to `positions` positions whose prompt is `prompt` the blocks
    /// it needs ([`KvCache::reserve`]): the longest prefix of it the index holds is shared,
    /// and only the rest promised. Blocks only the index holds are given up for it, the least
    /// recently used first. [`ModelError::KvBlocks`]: not now (wait for sequences to leave).
    pub(super) fn reserve(&mut self, positions: usize, prompt: &[u32]) -> Result<PromptBlocks, ModelError> {
        let prefix = self.longest(prompt, positions.min(self.rows.capacity()));
        loop {
            match self.rows.check_reservable(positions, prefix.len()) {
                Ok(()) => break,
                Err(ModelError::KvBlocks { .. }) if self.give_up_one(&prefix) => {}
                Err(e) => return Err(e),
            }
        }
        let sets: Vec<&BlockSet> = match &self.prefix {
            Some(index) => prefix.iter().filter_map(|&k| index.blocks(k)).collect(),
            None => Vec::new(),
        };
        if sets.len() != prefix.len() {
            return Err(ModelError::CacheMismatch("a prefix node without blocks".into()));
        }
        let reservation = self.rows.reserve_sharing(positions, &sets)?;
        Ok(PromptBlocks { reservation, prefix })
    }

    /// Puts the prefix `blocks` found cached into `prompt`, an empty unpaged cache of one
    /// sequence ([`KvCache::fill_prefix`]).
    pub(super) fn fill_prefix(&mut self, blocks: &mut PromptBlocks, prompt: &mut KvCache<B>) -> Result<(), ModelError> {
        self.rows.fill_prefix(&mut blocks.reservation, prompt)
    }

    /// Caches the blocks of a prompt running in `prompt` (an unpaged cache of one sequence
    /// holding positions `0..prompt.len()` of `tokens`) past those `blocks` holds already: each
    /// whole block whose positions every ring still holds becomes a node of the index. Stops at
    /// a block another prompt cached first, or where no block is free. Returns the blocks added.
    pub(super) fn cache_prefix(
        &mut self,
        blocks: &mut PromptBlocks,
        tokens: &[u32],
        prompt: &KvCache<B>,
    ) -> Result<usize, ModelError> {
        let (Some(bs), Some(_)) = (self.rows.block_size(), &self.prefix) else { return Ok(0) };
        let len = prompt.len().min(tokens.len());
        // Every ring must still hold a block's positions: the prompt's last `ring` positions.
        let ring = self.rows.ring_slots().unwrap_or(usize::MAX);
        let first = blocks.prefix.len();
        let mut added = Vec::new();
        loop {
            let j = first + added.len();
            let end = (j + 1) * bs;
            if end > len || (j * bs).saturating_add(ring) < len {
                break;
            }
            let block = &tokens[j * bs..end];
            let parent = blocks.prefix.last().copied();
            let Some((k, false)) = self.prefix.as_ref().map(|index| index.next(parent, block)) else { break };
            let set = loop {
                match self.rows.take_block_set(&mut blocks.reservation) {
                    Ok(set) => break Some(set),
                    Err(BlockShortfall::Free) if self.give_up_one(&blocks.prefix) => {}
                    Err(_) => break None,
                }
            };
            let Some(set) = set else { break };
            if let Some(index) = self.prefix.as_mut() {
                index.insert(k, parent, block, set);
            }
            blocks.prefix.push(k);
            added.push(k);
        }
        if added.is_empty() {
            return Ok(0);
        }
        // The new nodes' positions, copied from the prompt's cache.
        let sets: Vec<&BlockSet> = match &self.prefix {
            Some(index) => added.iter().filter_map(|&k| index.blocks(k)).collect(),
            None => Vec::new(),
        };
        self.rows.copy_into_block_sets(prompt, first, &sets, len)?;
        Ok(added.len())
    }

    /// Gives back what `blocks` promised and held (its sequence never joined).
    pub(super) fn release(&mut self, blocks: PromptBlocks) {
        self.rows.release_reservation(blocks.reservation);
    }

    /// Gives sequence `row` the blocks `blocks` promised and the prefix it shares
    /// ([`KvCache::attach`]).
    pub(super) fn attach(&mut self, row: usize, blocks: PromptBlocks) -> Result<(), ModelError> {
        self.rows.attach(row, blocks.reservation)
    }

    /// The batched cache's blocks: `(held by sequences and reservations, in all)`; the blocks
    /// only the index holds are neither in use nor free ([`KvManager::prefix_stats`]).
    pub(super) fn blocks_in_use(&self) -> Option<(usize, usize)> {
        let (used, all) = self.rows.blocks_in_use()?;
        Some((used.saturating_sub(self.held_only()), all))
    }

    /// Blocks only the index holds, summed over the pools.
    fn held_only(&self) -> usize {
        let Some(index) = &self.prefix else { return 0 };
        index.all_blocks().map(|set| self.rows.held_only_by(set)).sum()
    }

    /// What the prefix cache holds (`None` where prompts are not cached).
    pub(super) fn prefix_stats(&self) -> Option<PrefixStats> {
        self.prefix.as_ref()?;
        Some(PrefixStats { held_only: self.held_only(), given_up: self.given_up })
    }
}
