//! The prefix index: the keys and values of prompts' first blocks in the paged KV cache, kept
//! after their sequences end, so that a later prompt starting with the same tokens (a shared
//! system prompt, the other choices of one request) runs only the rest through the model.
//!
//! Block `i` of a prompt (positions `i * block_size..(i + 1) * block_size`) is a node named
//! by a hash chained over every token up to its end, so that two prompts share node `i` only
//! where they agree on all of them (each node also keeps its tokens and its parent, and a
//! lookup compares them: a hash collision is a miss, never a wrong prefix). A node holds a
//! block set ([`crate::BlockSet`]), one block per pool of the cache:
//! - of the full-attention pools, the block of those positions, which the sequences that reuse
//!   it share: nobody writes a prompt's positions again;
//! - of the sliding-window pools, a copy of the block's positions as the window's ring held them
//!   (a sequence writes over its own ring as it wraps, so rings are never shared): a sequence
//!   that reuses `m` nodes gets the rings' last window rebuilt from the copies of the nodes
//!   `m - window / block_size..m`.
//!
//! The index holds its blocks until it needs room: then the least recently used nodes without
//! children go first. A block that a sequence still shares stays with the sequence.

use std::collections::{hash_map::DefaultHasher, HashMap};
use std::hash::{Hash, Hasher};

/// The name of a node: its chain's hash.
pub(crate) type NodeKey = u64;

/// One cached block of a prompt, holding `T` (its blocks in the cache).
#[derive(Debug)]
struct Node<T> {
    parent: Option<NodeKey>,
    /// The block's tokens.
    tokens: Vec<u32>,
    /// Its blocks.
    blocks: T,
    /// Nodes continuing it.
    children: usize,
    /// When it was last used (the index's clock).
    used: u64,
}

/// The nodes of every cached prefix.
#[derive(Debug)]
pub(crate) struct PrefixIndex<T> {
    nodes: HashMap<NodeKey, Node<T>>,
    clock: u64,
}

impl<T> Default for PrefixIndex<T> {
    fn default() -> Self {
        Self { nodes: HashMap::new(), clock: 0 }
    }
}

/// A chain's next key: the hash of its parent's and the block's tokens.
fn key(parent: Option<NodeKey>, tokens: &[u32]) -> NodeKey {
    let mut h = DefaultHasher::new();
    parent.hash(&mut h);
    tokens.hash(&mut h);
    h.finish()
}

impl<T> PrefixIndex<T> {
    /// The keys of the longest cached chain `tokens` starts with, at most `max_blocks` blocks of
    /// `block_size`; the nodes found count as used.
    pub fn longest(&mut self, tokens: &[u32], block_size: usize, max_blocks: usize) -> Vec<NodeKey> {
        self.clock += 1;
        let mut chain = Vec::new();
        let mut parent = None;
        for block in tokens.chunks_exact(block_size.max(1)).take(max_blocks) {
            let k = key(parent, block);
            match self.nodes.get_mut(&k) {
                Some(node) if node.parent == parent && node.tokens == block => {
                    node.used = self.clock;
                    chain.push(k);
                    parent = Some(k);
                }
                _ => break,
            }
        }
        chain
    }

    /// The key the block `tokens` after `parent` has, and whether a node has it already.
    pub fn next(&self, parent: Option<NodeKey>, tokens: &[u32]) -> (NodeKey, bool) {
        let k = key(parent, tokens);
        (k, self.nodes.contains_key(&k))
    }

    /// Adds the node `k` ([`PrefixIndex::next`]) for the block `tokens` after `parent`,
    /// holding `blocks`.
    pub fn insert(&mut self, k: NodeKey, parent: Option<NodeKey>, tokens: &[u32], blocks: T) {
        if let Some(p) = parent.and_then(|p| self.nodes.get_mut(&p)) {
            p.children += 1;
        }
        self.nodes.insert(k, Node { parent, tokens: tokens.to_vec(), blocks, children: 0, used: self.clock });
    }

    /// Node `k`'s blocks.
    pub fn blocks(&self, k: NodeKey) -> Option<&T> {
        self.nodes.get(&k).map(|n| &n.blocks)
    }

    /// Takes out the least recently used node without children, none of `keep`; returns its
    /// blocks, whose holds the caller gives up.
    pub fn evict(&mut self, keep: &[NodeKey]) -> Option<T> {
        let (&k, _) =
            self.nodes.iter().filter(|(k, n)| n.children == 0 && !keep.contains(k)).min_by_key(|(_, n)| n.used)?;
        let node = self.nodes.remove(&k)?;
        if let Some(p) = node.parent.and_then(|p| self.nodes.get_mut(&p)) {
            p.children = p.children.saturating_sub(1);
        }
        Some(node.blocks)
    }

    /// Every node's blocks.
    pub fn all_blocks(&self) -> impl Iterator<Item = &T> {
        self.nodes.values().map(|n| &n.blocks)
    }

    /// Nodes cached.
    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.nodes.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chains_match_only_where_every_token_before_agrees() {
        let mut index = PrefixIndex::default();
        let prompt = [1u32, 2, 3, 4, 5, 6, 7];
        let mut parent = None;
        for (i, block) in prompt.chunks_exact(2).enumerate() {
            let (k, present) = index.next(parent, block);
            assert!(!present);
            index.insert(k, parent, block, vec![i as u32 * 10]);
            parent = Some(k);
        }
        assert_eq!(index.len(), 3);
        assert_eq!(index.longest(&prompt, 2, 8).len(), 3);
        assert_eq!(index.longest(&prompt, 2, 2).len(), 2);
        // The same second block after another first one is another node.
        assert_eq!(index.longest(&[1, 2, 9, 4, 5, 6], 2, 8).len(), 1);
        assert_eq!(index.longest(&[9, 2, 3, 4], 2, 8).len(), 0);
        // Only the leaf goes, and the least recently used first; a kept one stays.
        let chain = index.longest(&prompt, 2, 8);
        assert_eq!(index.evict(&chain), None);
        assert_eq!(index.evict(&[]), Some(vec![20]));
        assert_eq!(index.evict(&[]), Some(vec![10]));
        assert_eq!(index.longest(&prompt, 2, 8).len(), 1);
        assert_eq!(index.blocks(chain[0]), Some(&vec![0u32]));
    }
}
