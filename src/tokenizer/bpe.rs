//! Gemma 4's BPE from GGUF metadata (`tokenizer.ggml.model = "gemma4"`), as llama.cpp reads it
//! (`LLAMA_VOCAB_PRE_TYPE_GEMMA4`): spaces become `▁`; the text is cut into runs of newlines and
//! runs of everything else; a run of newlines that is a token is that token, anything else
//! merges by the file's merge list (lowest rank first, leftmost on ties); a symbol that is not
//! a token is spelled with `<0xXX>` byte tokens. Special tokens are cut out before all this
//! (see [`super::specials`]).

use super::{merge::merge, ByteTokens, SPACE};
use crate::{error::TokenizerError, Error};
use std::{cmp::Reverse, collections::HashMap};

pub(super) struct Bpe {
    /// Merge ranks by left piece, then right piece.
    ranks: HashMap<String, HashMap<String, u32>>,
    pub(super) bytes: ByteTokens,
}

impl Bpe {
    /// Reads the `"left right"` merge list (the first space after the first byte separates the
    /// two, as llama.cpp splits them).
    pub(super) fn new(merges: &[String], bytes: ByteTokens) -> Result<Self, Error> {
        let mut ranks: HashMap<String, HashMap<String, u32>> = HashMap::new();
        for (rank, merge) in merges.iter().enumerate() {
            let split = merge.char_indices().skip(1).find(|&(_, c)| c == ' ').map(|(i, _)| i);
            let Some(split) = split else {
                return Err(TokenizerError::BadMerge { index: rank, merge: merge.clone() }.into());
            };
            let rank =
                u32::try_from(rank).map_err(|_| TokenizerError::BadMerge { index: rank, merge: merge.clone() })?;
            // An earlier rank of the same pair wins, as in llama.cpp's map insert.
            ranks.entry(merge[..split].to_string()).or_default().entry(merge[split + 1..].to_string()).or_insert(rank);
        }
        Ok(Self { ranks, bytes })
    }

    /// Encodes text without special tokens.
    pub(super) fn encode(&self, text: &str, pieces: &HashMap<String, u32>, out: &mut Vec<u32>) -> Result<(), Error> {
        let escaped: String = text.chars().map(|c| if c == ' ' { SPACE } else { c }).collect();
        for word in newline_runs(&escaped) {
            if word.starts_with('\n') {
                if let Some(&id) = pieces.get(word) {
                    out.push(id);
                    continue;
                }
            }
            let symbols = merge(word, |left, right| self.ranks.get(left)?.get(right).map(|&rank| Reverse(rank)));
            self.bytes.emit(word, symbols, pieces, out)?;
        }
        Ok(())
    }
}

/// `text` cut into maximal runs of `\n` and maximal runs of anything else (llama.cpp's
/// `[^\n]+|[\n]+`).
fn newline_runs(text: &str) -> impl Iterator<Item = &str> {
    let mut rest = text;
    std::iter::from_fn(move || {
        let first = rest.chars().next()?;
        let newline = first == '\n';
        let end = rest.find(|c: char| (c == '\n') != newline).unwrap_or(rest.len());
        let (word, tail) = rest.split_at(end);
        rest = tail;
        Some(word)
    })
}

#[cfg(test)]
mod tests {
    use super::newline_runs;

    #[test]
    fn runs_of_newlines_and_the_rest() {
        let runs: Vec<&str> = newline_runs("a b\n\n\ncd\n").collect();
        assert_eq!(runs, ["a b", "\n\n\n", "cd", "\n"]);
        assert_eq!(newline_runs("").count(), 0);
        assert_eq!(newline_runs("\n").collect::<Vec<_>>(), ["\n"]);
    }
}
