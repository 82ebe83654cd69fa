//! Prompt lookup (Saxena 2023; llama.cpp's `ngram` drafts): the tokens that followed the last
//! earlier occurrence of the context's final n-gram, proposed as the continuation. No model
//! runs; it pays where the reply copies from the prompt or repeats itself (editing,
//! summarizing, code), and proposes nothing elsewhere.

/// Drafts by matching the context's last `n` tokens earlier in it, the longest `n` first.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PromptLookup {
    /// Longest suffix matched.
    pub max_ngram: usize,
    /// Shortest suffix matched: below it nothing is proposed.
    pub min_ngram: usize,
}

impl Default for PromptLookup {
    /// Suffixes of 3 down to 2 tokens: a single token matches too often to be worth a draft.
    fn default() -> Self {
        Self { max_ngram: 3, min_ngram: 2 }
    }
}

impl PromptLookup {
    /// Up to `k` tokens that followed the latest earlier occurrence of `tokens`' final n-gram
    /// (for the longest `n` that has one); empty where none occurs.
    pub fn draft(&self, tokens: &[u32], k: usize) -> Vec<u32> {
        let len = tokens.len();
        let longest = self.max_ngram.min(len.saturating_sub(1));
        for n in (self.min_ngram.max(1)..=longest).rev() {
            let suffix = &tokens[len - n..];
            // Latest start first; the match must end before the suffix starts to continue it.
            let found = (0..len - n).rev().find(|&start| &tokens[start..start + n] == suffix);
            if let Some(start) = found {
                let from = start + n;
                return tokens[from..(from + k).min(len)].to_vec();
            }
        }
        Vec::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn continues_the_latest_match_of_the_longest_suffix() {
        let lookup = PromptLookup::default();
        // "1 2 3 4 5 ... 9 1 2 3": the suffix 1 2 3 occurred at the start.
        let tokens = [1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2, 3];
        assert_eq!(lookup.draft(&tokens, 4), vec![4, 5, 6, 7]);
        // The continuation stops at the end of the context.
        assert_eq!(lookup.draft(&[7, 8, 9, 7, 8], 5), vec![9, 7, 8]);
        // The latest occurrence wins: "5 6" was followed by 1, then by 2.
        assert_eq!(lookup.draft(&[5, 6, 1, 5, 6, 2, 0, 5, 6], 1), vec![2]);
        // The longer suffix wins over a later match of a shorter one.
        assert_eq!(lookup.draft(&[4, 5, 6, 10, 9, 5, 6, 11, 4, 5, 6], 1), vec![10]);
    }

    #[test]
    fn proposes_nothing_without_a_match() {
        let lookup = PromptLookup::default();
        assert!(lookup.draft(&[1, 2, 3, 4, 5], 4).is_empty());
        assert!(lookup.draft(&[], 4).is_empty());
        assert!(lookup.draft(&[3], 4).is_empty());
        // A single repeated token is below the default shortest n-gram...
        assert!(lookup.draft(&[8, 1, 9, 1], 3).is_empty());
        // ...and matched where the shortest is one.
        assert_eq!(PromptLookup { max_ngram: 3, min_ngram: 1 }.draft(&[8, 1, 9, 1], 3), vec![9, 1]);
        assert!(lookup.draft(&[1, 2, 1, 2], 0).is_empty());
    }
}
