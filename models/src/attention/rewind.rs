//! Taking back positions a cache was given ahead (speculative decoding): a verify step writes
//! the drafted positions, and those the target rejects must leave no trace.
//!
//! A full-attention store needs nothing: a later write at the same position replaces the
//! rejected row, and nothing reads past the cache's length. A sliding-window ring does: the
//! slot of position `p` held position `p - w`, which the queries after the rewind still see.
//! A [`RewindPoint`] keeps, for every ring, the rows the positions ahead will overwrite, so
//! that [`crate::KvCache::rewind`] can put back those of the rejected positions.

use super::ring::ring_writes;
use super::StoredRows;
use burn_gemma_kernels::GemmaBackend;
use std::ops::Range;

/// What writing a span of positions ahead of a cache's length overwrites in its rings
/// ([`crate::KvCache::checkpoint`]), to take those positions back
/// ([`crate::KvCache::rewind`]).
#[derive(Debug)]
pub struct RewindPoint<B: GemmaBackend> {
    /// The cache it was taken of ([`crate::KvCache::id`]).
    pub(crate) cache: u64,
    /// The positions it covers: from the cache's length when taken.
    pub(crate) span: Range<usize>,
    /// For each layer with keys of its own, in order: for a ring, the rows of the slots
    /// `span` overwrites, in position order (`[batch, kv_heads, span.len(), head_dim]` in
    /// f32); nothing for a full store.
    pub(crate) rings: Vec<Option<StoredRows<B>>>,
}

impl<B: GemmaBackend> RewindPoint<B> {
    /// The positions this checkpoint covers: a cache can be rewound to any length within it
    /// while its length has not passed its end.
    pub fn span(&self) -> Range<usize> {
        self.span.clone()
    }
}

/// The slot ranges of a ring of `w` slots that positions `span` (at most `w` of them) occupy,
/// each with the offset of its first position in `span`: at most two, in position order.
pub(crate) fn ring_slots(span: &Range<usize>, w: usize) -> Vec<(Range<usize>, usize)> {
    ring_writes(span.start, span.len(), w)
        .into_iter()
        .map(|(rows, slot)| (slot..slot + rows.len(), rows.start))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `(slots, offset in the span)` per range.
    type Slots = Vec<(Range<usize>, usize)>;

    #[test]
    fn slots_of_a_span_in_position_order() {
        // (span, w) -> slots
        let table: [(Range<usize>, usize, Slots); 4] = [
            (0..3, 8, vec![(0..3, 0)]),
            (6..10, 8, vec![(6..8, 0), (0..2, 2)]),
            (16..20, 4, vec![(0..4, 0)]),
            (13..14, 8, vec![(5..6, 0)]),
        ];
        for (span, w, expected) in table {
            let slots = ring_slots(&span, w);
            assert_eq!(slots, expected, "{span:?} in a ring of {w}");
            for (range, offset) in slots {
                for (i, slot) in range.enumerate() {
                    assert_eq!(slot, (span.start + offset + i) % w);
                }
            }
        }
    }
}
