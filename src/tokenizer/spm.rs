//! SentencePiece BPE from GGUF metadata (`tokenizer.ggml.model = "llama"`, Gemma 1-3): merge the
//! adjacent pair whose merged piece scores highest, leftmost first; pieces not in the vocabulary
//! fall back to byte tokens.

use super::{merge::merge, ByteTokens, SPACE, TYPE_NORMAL};
use crate::Error;
use std::collections::HashMap;

/// A score with a total order, for the merge queue.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Score(f32);
impl Eq for Score {}
impl PartialOrd for Score {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Score {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        self.0.total_cmp(&other.0)
    }
}

pub(super) struct Spm {
    pub(super) scores: Vec<f32>,
    pub(super) types: Vec<i32>,
    pub(super) bytes: ByteTokens,
}

impl Spm {
    /// Encodes text without special tokens (spaces become `▁`).
    pub(super) fn encode(&self, text: &str, pieces: &HashMap<String, u32>, out: &mut Vec<u32>) -> Result<(), Error> {
        let norm: String = text.chars().map(|c| if c == ' ' { SPACE } else { c }).collect();
        let mut merged = String::new();
        let symbols = merge(&norm, |left, right| {
            merged.clear();
            merged.push_str(left);
            merged.push_str(right);
            let id = *pieces.get(merged.as_str())? as usize;
            (self.types.get(id) == Some(&TYPE_NORMAL)).then(|| Score(self.scores[id]))
        });
        self.bytes.emit(&norm, symbols, pieces, out)
    }
}
