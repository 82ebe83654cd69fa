//! Control and user-defined tokens (`<start_of_turn>`, `<|tool_call>`, runs of newlines ...),
//! matched in the text as single tokens before anything else, longest first, as Hugging Face
//! and llama.cpp do.

use std::collections::HashMap;

/// A piece of text between special tokens, or a special token.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Fragment<'a> {
    Text(&'a str),
    Token(u32),
}

/// The special tokens of a vocabulary, grouped by first character, longest first.
#[derive(Debug, Default)]
pub(super) struct Specials(HashMap<char, Vec<(String, u32)>>);

impl Specials {
    pub(super) fn insert(&mut self, piece: &str, id: u32) {
        if let Some(first) = piece.chars().next() {
            self.0.entry(first).or_default().push((piece.to_string(), id));
        }
    }

    /// Call once every token is in: sorts each group longest first.
    pub(super) fn finish(&mut self) {
        for list in self.0.values_mut() {
            list.sort_by_key(|entry| std::cmp::Reverse(entry.0.len()));
        }
    }

    /// `text` cut at every special token (empty texts left out).
    pub(super) fn split<'a>(&self, text: &'a str) -> Vec<Fragment<'a>> {
        let mut out = Vec::new();
        let mut segment_start = 0;
        let mut i = 0;
        while let Some(c) = text[i..].chars().next() {
            let rest = &text[i..];
            match self.0.get(&c).and_then(|list| list.iter().find(|(p, _)| rest.starts_with(p.as_str()))) {
                Some((piece, id)) => {
                    if segment_start < i {
                        out.push(Fragment::Text(&text[segment_start..i]));
                    }
                    out.push(Fragment::Token(*id));
                    i += piece.len();
                    segment_start = i;
                }
                None => i += c.len_utf8(),
            }
        }
        if segment_start < text.len() {
            out.push(Fragment::Text(&text[segment_start..]));
        }
        out
    }
}
