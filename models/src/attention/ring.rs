//! Slot arithmetic of a layer's cache, as pure functions.
//!
//! A full-attention layer keeps position `p` in slot `p`. A sliding-window layer keeps a ring:
//! position `p` in slot `p % slots`, where `slots` is the window (or the cache's capacity when
//! that is smaller: positions never reach the capacity, so such a ring never wraps and behaves
//! as the window). Attention does not depend on the order of its keys, so a decode query reads
//! the ring as it lies; a chunk of several positions reads the previous window in order first.
//!
//! Or a sliding-window layer keeps every position as a full layer does ([`WindowStore::EveryPosition`],
//! [`Span::Windowed`]) and masks by the window: more memory, but writing positions ahead
//! never overwrites what an earlier position still attends to, so a verify step's rows can all
//! be written before any attends, and taking rejected positions back only moves the length.

use burn_gemma_kernels::{step, AttentionMask};
use std::ops::Range;

/// How a KV cache stores the keys of sliding-window layers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum WindowStore {
    /// A ring of the window's slots (the least memory).
    #[default]
    Ring,
    /// A slot per position, as a full-attention layer, masked by the window: what a recorded
    /// verify step of speculative decoding needs (see the module docs).
    EveryPosition,
}

/// Which slots a layer's positions occupy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Span {
    /// Every position up to the capacity, slot = position.
    Full,
    /// A ring of this many slots.
    Ring(usize),
    /// Every position up to the capacity, slot = position, attending within this window.
    Windowed(usize),
}

impl Span {
    /// The span of a layer with `window` (`None` for full attention) in a cache of `capacity`
    /// storing windows as `store` says.
    pub fn new(window: Option<usize>, capacity: usize, store: WindowStore) -> Self {
        match (window, store) {
            (None, _) => Self::Full,
            (Some(w), WindowStore::Ring) => Self::Ring(w.min(capacity)),
            (Some(w), WindowStore::EveryPosition) => Self::Windowed(w),
        }
    }

    /// Slots the layer's store needs for a cache of `capacity` positions.
    pub fn slots(self, capacity: usize) -> usize {
        match self {
            Self::Full | Self::Windowed(_) => capacity,
            Self::Ring(slots) => slots,
        }
    }

    /// The sliding window, for a ring or a windowed full store.
    pub fn window(self) -> Option<usize> {
        match self {
            Self::Full => None,
            Self::Ring(w) | Self::Windowed(w) => Some(w),
        }
    }

    /// Decode at `position`: the slot it is written to, the slots attention then reads (the
    /// first `visible`), and their mask: what the decode kernels derive from the position and
    /// the store's size ([`burn_gemma_kernels::step`]; a full store has a slot per position).
    pub fn decode(self, position: usize) -> DecodeStep {
        let slots = match self {
            Self::Full | Self::Windowed(_) => usize::MAX,
            Self::Ring(w) => w,
        };
        let (visible, mask) = step::decode_visible(position, slots, self.window());
        DecodeStep { slot: step::slot(position, slots), visible, mask }
    }
}

/// Where one decode position goes and what it attends to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DecodeStep {
    pub slot: usize,
    pub visible: usize,
    pub mask: AttentionMask,
}

/// The ring's positions before `position` that a window of `w` still holds (at most `w`), as
/// slot ranges in position order: none, one range, or two when the window wraps.
#[allow(clippy::single_range_in_vec_init)] // A list of ranges, not a range of indices.
pub fn window_in_order(position: usize, w: usize) -> Vec<Range<usize>> {
    if position == 0 {
        Vec::new()
    } else if position <= w {
        vec![0..position]
    } else {
        let start = position % w;
        if start == 0 {
            vec![0..w]
        } else {
            vec![start..w, 0..start]
        }
    }
}

/// Where the last `min(t, w)` of `t` new positions (the first at `position`) go in a ring of `w`
/// slots: `(rows of the new block, first slot)`, at most two contiguous writes.
pub fn ring_writes(position: usize, t: usize, w: usize) -> Vec<(Range<usize>, usize)> {
    let kept = t.min(w);
    let first = position + t - kept;
    let start = first % w;
    let head = kept.min(w - start);
    let skip = t - kept;
    let mut writes = vec![(skip..skip + head, start)];
    if head < kept {
        writes.push((skip + head..t, 0));
    }
    writes
}

#[cfg(test)]
#[allow(clippy::single_range_in_vec_init)]
mod tests {
    use super::*;

    /// `(rows of the new block, first slot)` per write.
    type Writes = Vec<(Range<usize>, usize)>;

    #[test]
    fn window_larger_than_capacity_keeps_capacity_slots() {
        let ring = WindowStore::Ring;
        assert_eq!(Span::new(Some(512), 100, ring), Span::Ring(100));
        assert_eq!(Span::new(Some(8), 100, ring), Span::Ring(8));
        assert_eq!(Span::new(None, 100, ring), Span::Full);
        assert_eq!(Span::new(None, 100, WindowStore::EveryPosition), Span::Full);
        assert_eq!(Span::new(Some(8), 100, WindowStore::EveryPosition), Span::Windowed(8));
        assert_eq!(Span::Windowed(8).slots(100), 100);
        assert_eq!((Span::Ring(100).slots(100), Span::Full.slots(100)), (100, 100));
        // A ring of the capacity never wraps: every position up to it is visible.
        let step = Span::Ring(100).decode(99);
        assert_eq!((step.slot, step.visible, step.mask.k_offset), (99, 100, 0));
    }

    #[test]
    fn decode_steps_wrap_around() {
        // (span, position) -> (slot, visible, k_offset)
        let table = [
            (Span::Full, 0, (0, 1, 0)),
            (Span::Full, 37, (37, 38, 0)),
            (Span::Ring(4), 0, (0, 1, 0)),
            (Span::Ring(4), 3, (3, 4, 0)),
            (Span::Ring(4), 4, (0, 4, 1)),
            (Span::Ring(4), 9, (1, 4, 6)),
            (Span::Ring(1), 5, (0, 1, 5)),
            // Every position kept: the whole history is visible to the kernels, whose mask
            // keeps the window.
            (Span::Windowed(4), 9, (9, 10, 0)),
        ];
        for (span, position, (slot, visible, k_offset)) in table {
            let step = span.decode(position);
            assert_eq!(
                (step.slot, step.visible, step.mask.k_offset),
                (slot, visible, k_offset),
                "{span:?} at {position}"
            );
            assert_eq!(step.mask.q_offset, position);
            // The keys the mask places are exactly the ones in the window.
            let keys = step.mask.k_offset..step.mask.k_offset + step.visible;
            let seen = keys.clone().filter(|&k| step.mask.visible(position, k)).count();
            assert_eq!(seen, step.visible.min(span.window().unwrap_or(usize::MAX)), "{span:?} at {position}: {keys:?}");
        }
    }

    #[test]
    fn previous_window_in_position_order() {
        // (position, w) -> slot ranges
        let table: [(usize, usize, Vec<Range<usize>>); 6] = [
            (0, 4, vec![]),
            (3, 4, vec![0..3]),
            (4, 4, vec![0..4]),
            (6, 4, vec![2..4, 0..2]),
            (8, 4, vec![0..4]),
            (9, 4, vec![1..4, 0..1]),
        ];
        for (position, w, expected) in table {
            let ranges = window_in_order(position, w);
            assert_eq!(ranges, expected, "position {position}, window {w}");
            // Slot s of the ring holds the latest position p < `position` with p % w == s.
            let held: Vec<usize> = ranges.into_iter().flatten().collect();
            let positions: Vec<usize> = (position.saturating_sub(w)..position).collect();
            assert_eq!(held, positions.iter().map(|p| p % w).collect::<Vec<_>>());
        }
    }

    #[test]
    fn chunked_prefill_into_a_partly_filled_ring() {
        // (position, t, w) -> writes
        let table: [(usize, usize, usize, Writes); 6] = [
            // An empty ring, a chunk shorter than the window.
            (0, 3, 8, vec![(0..3, 0)]),
            // A partly filled ring: the chunk wraps past the last slot.
            (5, 6, 8, vec![(0..3, 5), (3..6, 0)]),
            // A chunk longer than the window keeps its last w rows.
            (2, 11, 4, vec![(7..10, 1), (10..11, 0)]),
            (0, 8, 8, vec![(0..8, 0)]),
            (13, 1, 8, vec![(0..1, 5)]),
            (16, 4, 4, vec![(0..4, 0)]),
        ];
        for (position, t, w, expected) in table {
            let writes = ring_writes(position, t, w);
            assert_eq!(writes, expected, "position {position}, {t} rows, window {w}");
            // Every kept row lands in its position's slot, once.
            for (rows, slot) in writes {
                for (i, row) in rows.enumerate() {
                    assert_eq!((slot + i) % w, (position + row) % w);
                    assert!(row >= t - t.min(w));
                }
            }
        }
    }
}
