//! The merge loop shared by both GGUF vocabularies: a text starts as one symbol per character,
//! and the adjacent pair with the best priority merges until none is left (ties: leftmost
//! first). SentencePiece ranks pairs by the merged piece's score, BPE by the merge's rank.

use std::{cmp::Ordering, collections::BinaryHeap, ops::Range};

#[derive(Debug, Clone, Copy)]
struct Symbol {
    start: usize,
    end: usize,
    prev: Option<usize>,
    next: Option<usize>,
}

struct Candidate<P> {
    priority: P,
    left: usize,
    /// Byte length of the merged text when pushed, to detect stale entries.
    len: usize,
}

impl<P: Ord> PartialEq for Candidate<P> {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}
impl<P: Ord> Eq for Candidate<P> {}
impl<P: Ord> PartialOrd for Candidate<P> {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl<P: Ord> Ord for Candidate<P> {
    fn cmp(&self, other: &Self) -> Ordering {
        // Highest priority first, then leftmost.
        self.priority.cmp(&other.priority).then_with(|| other.left.cmp(&self.left))
    }
}

/// The byte ranges of `text`'s symbols after merging: `priority(left, right)` says whether
/// two adjacent symbols merge and how urgently (higher first), `None` for never.
pub(super) fn merge<P: Ord>(text: &str, mut priority: impl FnMut(&str, &str) -> Option<P>) -> Vec<Range<usize>> {
    let mut symbols: Vec<Symbol> = Vec::new();
    for (start, c) in text.char_indices() {
        let n = symbols.len();
        symbols.push(Symbol { start, end: start + c.len_utf8(), prev: n.checked_sub(1), next: None });
        if n > 0 {
            symbols[n - 1].next = Some(n);
        }
    }
    let mut heap = BinaryHeap::new();
    let mut push = |heap: &mut BinaryHeap<Candidate<P>>, symbols: &[Symbol], left: usize| {
        let Some(right) = symbols[left].next else { return };
        let (l, r) = (symbols[left], symbols[right]);
        if let Some(p) = priority(&text[l.start..l.end], &text[r.start..r.end]) {
            heap.push(Candidate { priority: p, left, len: r.end - l.start });
        }
    };
    for left in 0..symbols.len() {
        push(&mut heap, &symbols, left);
    }
    while let Some(Candidate { left, len, .. }) = heap.pop() {
        let Some(right) = symbols[left].next else { continue };
        if symbols[left].end == symbols[left].start || symbols[right].end - symbols[left].start != len {
            continue; // stale: one side merged since
        }
        symbols[left].end = symbols[right].end;
        symbols[left].next = symbols[right].next;
        if let Some(n) = symbols[right].next {
            symbols[n].prev = Some(left);
        }
        symbols[right].start = symbols[right].end; // dead
        if let Some(p) = symbols[left].prev {
            push(&mut heap, &symbols, p);
        }
        push(&mut heap, &symbols, left);
    }
    let mut out = Vec::new();
    let mut cursor = (!symbols.is_empty()).then_some(0);
    while let Some(idx) = cursor {
        out.push(symbols[idx].start..symbols[idx].end);
        cursor = symbols[idx].next;
    }
    out
}
