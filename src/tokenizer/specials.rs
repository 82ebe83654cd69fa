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

/// The special tokens of a vocabulary, grouped by first character; within a group, by byte
/// length, the lengths longest first.
///
/// Gemma 3's vocabulary has over 6,000 special pieces beginning with `<` (`<unused0>` ...):
/// scanning them at every `<` made a 2 MiB prompt of `<` take minutes. A hash lookup per
/// distinct length (a few dozen) keeps a position's cost independent of the piece count.
#[derive(Debug, Default)]
pub(super) struct Specials(HashMap<char, Group>);

#[derive(Debug, Default)]
struct Group {
    /// The distinct byte lengths of the group's pieces, longest first.
    lengths: Vec<usize>,
    pieces: HashMap<String, u32>,
}

impl Specials {
    pub(super) fn insert(&mut self, piece: &str, id: u32) {
        if let Some(first) = piece.chars().next() {
            let group = self.0.entry(first).or_default();
            // The first id of a piece given twice wins, as the first match of a scan did.
            group.pieces.entry(piece.to_string()).or_insert(id);
            group.lengths.push(piece.len());
        }
    }

    /// Call once every token is in: each group's lengths, distinct and longest first.
    pub(super) fn finish(&mut self) {
        for group in self.0.values_mut() {
            group.lengths.sort_unstable_by(|a, b| b.cmp(a));
            group.lengths.dedup();
        }
    }

    /// The longest special piece `rest` begins with, and its id.
    fn longest_at(&self, rest: &str) -> Option<(usize, u32)> {
        let group = self.0.get(&rest.chars().next()?)?;
        group.lengths.iter().find_map(|&len| Some((len, *group.pieces.get(rest.get(..len)?)?)))
    }

    /// `text` cut at every special token (empty texts left out).
    pub(super) fn split<'a>(&self, text: &'a str) -> Vec<Fragment<'a>> {
        let mut out = Vec::new();
        let mut segment_start = 0;
        let mut i = 0;
        while let Some(c) = text[i..].chars().next() {
            match self.longest_at(&text[i..]) {
                Some((len, id)) => {
                    if segment_start < i {
                        out.push(Fragment::Text(&text[segment_start..i]));
                    }
                    out.push(Fragment::Token(id));
                    i += len;
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

#[cfg(test)]
mod tests {
    use super::*;

    fn specials(pieces: &[(&str, u32)]) -> Specials {
        let mut s = Specials::default();
        for &(p, id) in pieces {
            s.insert(p, id);
        }
        s.finish();
        s
    }

    #[test]
    fn the_longest_piece_wins_and_text_between_is_kept() {
        let s = specials(&[("<a>", 1), ("<a><b>", 2), ("<b>", 3), ("\n\n", 4), ("é<", 5)]);
        use Fragment::{Text, Token};
        assert_eq!(s.split("x<a><b>y<a>z"), [Text("x"), Token(2), Text("y"), Token(1), Text("z")]);
        assert_eq!(s.split("<<a>\n\n\n"), [Text("<"), Token(1), Token(4), Text("\n")]);
        assert_eq!(s.split("éé<b>"), [Text("é"), Token(5), Text("b>")]);
        assert_eq!(s.split(""), []);
        assert_eq!(s.split("plain"), [Text("plain")]);
    }

    #[test]
    fn a_long_run_of_a_special_first_character_is_quick() {
        // As many `<` pieces as Gemma 3 has, and a 2 MiB prompt of `<`: each position costs a
        // lookup per distinct length, not a scan of the pieces.
        let names: Vec<String> = (0..6500).map(|i| format!("<unused{i}>")).collect();
        let pieces: Vec<(&str, u32)> = names.iter().zip(0..).map(|(n, i)| (n.as_str(), i)).collect();
        let s = specials(&pieces);
        let text = "<".repeat(2 << 20);
        let started = std::time::Instant::now();
        assert_eq!(s.split(&text), [Fragment::Text(&text)]);
        // A scan of the 6,500 pieces at each of the 2 Mi positions took minutes; the lookups a
        // fraction of a second (the bound leaves room for a slow, shared machine).
        assert!(started.elapsed() < std::time::Duration::from_secs(5), "{:?}", started.elapsed());
    }
}
