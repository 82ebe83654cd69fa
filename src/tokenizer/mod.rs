//! Gemma tokenizers: `tokenizer.json` through the `tokenizers` crate, or the vocabulary embedded
//! in a GGUF file: SentencePiece-style BPE by piece scores (Gemma 1-3, `spm`) or Gemma 4's BPE
//! by merge ranks (`bpe`), both with byte fallback.
//!
//! Special tokens (GGUF control and user-defined types, e.g. `<start_of_turn>`, `<|tool_call>`,
//! runs of newlines) are matched in the text as single tokens (`specials`), as Hugging Face
//! tokenizers and llama.cpp do.

mod bpe;
mod merge;
mod specials;
mod spm;

use crate::{error::TokenizerError, Error};
use specials::{Fragment, Specials};
use std::{collections::HashMap, path::Path};

/// Token types as stored in GGUF `tokenizer.ggml.token_type`.
const TYPE_NORMAL: i32 = 1;
const TYPE_CONTROL: i32 = 3;
const TYPE_USER_DEFINED: i32 = 4;
const TYPE_BYTE: i32 = 6;

/// The space marker of SentencePiece vocabularies.
const SPACE: char = '\u{2581}';

/// Whether an encoded text starts a sequence (`<bos>` first) or continues one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Bos {
    /// `<bos>` first: the text starts a sequence.
    Prepend,
    /// The text continues a sequence.
    Omit,
}

/// A Gemma tokenizer.
pub struct Tokenizer {
    engine: Engine,
    /// Raw bytes each token stands for (empty for control tokens), used for decoding and streaming.
    token_bytes: Vec<Vec<u8>>,
    pieces: HashMap<String, u32>,
    bos: u32,
}

enum Engine {
    Hf(Box<tokenizers::Tokenizer>),
    Gguf { specials: Specials, merges: Box<GgufMerges> },
}

/// How a GGUF vocabulary merges symbols.
enum GgufMerges {
    Spm(spm::Spm),
    Bpe(bpe::Bpe),
}

/// The byte-fallback tokens (`<0xXX>`) of a vocabulary.
struct ByteTokens([Option<u32>; 256]);

impl ByteTokens {
    /// Appends the token of each merged symbol of `text` (`symbols`: byte ranges), spelling a
    /// symbol that is not a token with byte tokens.
    fn emit(
        &self,
        text: &str,
        symbols: Vec<std::ops::Range<usize>>,
        pieces: &HashMap<String, u32>,
        out: &mut Vec<u32>,
    ) -> Result<(), Error> {
        for range in symbols {
            let piece = &text[range];
            match pieces.get(piece) {
                Some(&id) => out.push(id),
                None => {
                    for &b in piece.as_bytes() {
                        out.push(self.0[b as usize].ok_or(TokenizerError::NoByteFallback(b))?);
                    }
                }
            }
        }
        Ok(())
    }
}

/// The parts of a GGUF vocabulary both merge schemes share.
struct GgufParts {
    token_bytes: Vec<Vec<u8>>,
    pieces: HashMap<String, u32>,
    specials: Specials,
    bytes: ByteTokens,
}

impl GgufParts {
    fn new(tokens: Vec<String>, types: &[i32]) -> Self {
        let mut pieces = HashMap::with_capacity(tokens.len());
        let mut specials = Specials::default();
        let mut byte_tokens = [None; 256];
        let mut token_bytes = Vec::with_capacity(tokens.len());
        for (id, (piece, &ty)) in tokens.into_iter().zip(types).enumerate() {
            let id = id as u32;
            let bytes = piece_bytes(&piece);
            if ty == TYPE_BYTE {
                if let [b] = bytes[..] {
                    byte_tokens[b as usize] = Some(id);
                }
            }
            if ty == TYPE_CONTROL || ty == TYPE_USER_DEFINED {
                specials.insert(&piece, id);
            }
            token_bytes.push(bytes);
            pieces.entry(piece).or_insert(id);
        }
        specials.finish();
        Self { token_bytes, pieces, specials, bytes: ByteTokens(byte_tokens) }
    }
}

/// Tokens that mark sequence structure and decode to nothing.
const SILENT: [&str; 3] = ["<bos>", "<eos>", "<pad>"];

fn piece_bytes(piece: &str) -> Vec<u8> {
    if SILENT.contains(&piece) {
        return Vec::new();
    }
    if let Some(hex) = piece.strip_prefix("<0x").and_then(|p| p.strip_suffix('>')) {
        if hex.len() == 2 {
            if let Ok(b) = u8::from_str_radix(hex, 16) {
                return vec![b];
            }
        }
    }
    piece.replace(SPACE, " ").into_bytes()
}

impl Tokenizer {
    /// Loads a Hugging Face `tokenizer.json`. The text is checked as JSON first (syntax, and
    /// nesting at most 128 deep), since the tokenizers crate panics on some malformed files
    /// (found by `tests/process/fuzz.rs`); a panic left inside it is turned into an error as well.
    pub fn from_file(path: &Path) -> Result<Self, Error> {
        let fail = |reason: String| TokenizerError::File { path: path.into(), reason };
        let text = std::fs::read_to_string(path).map_err(|e| fail(e.to_string()))?;
        serde_json::from_str::<serde_json::Value>(&text).map_err(|e| fail(format!("not valid JSON: {e}")))?;
        let inner = std::panic::catch_unwind(|| text.parse::<tokenizers::Tokenizer>())
            .map_err(|_| fail("the tokenizers crate failed on this file (it panicked)".into()))?
            .map_err(|e| fail(e.to_string()))?;
        let size = inner.get_vocab_size(true);
        let mut token_bytes = vec![Vec::new(); size];
        let mut pieces = HashMap::with_capacity(size);
        for (piece, id) in inner.get_vocab(true) {
            if let Some(slot) = token_bytes.get_mut(id as usize) {
                *slot = piece_bytes(&piece);
            }
            pieces.insert(piece, id);
        }
        let bos = pieces.get("<bos>").copied().unwrap_or(2);
        Ok(Self { engine: Engine::Hf(Box::new(inner)), token_bytes, pieces, bos })
    }

    /// Builds a SentencePiece tokenizer (GGUF `tokenizer.ggml.model = "llama"`, Gemma 1-3) from
    /// the GGUF vocabulary arrays.
    pub fn from_vocab(tokens: Vec<String>, scores: Vec<f32>, types: Vec<i32>, bos: u32) -> Result<Self, Error> {
        if tokens.is_empty() || tokens.len() != scores.len() || tokens.len() != types.len() {
            return Err(TokenizerError::VocabularyArrays {
                tokens: tokens.len(),
                scores: scores.len(),
                types: types.len(),
            }
            .into());
        }
        Self::from_gguf_parts(tokens, types, bos, |bytes, types| Ok(GgufMerges::Spm(spm::Spm { scores, types, bytes })))
    }

    /// Builds Gemma 4's BPE tokenizer (GGUF `tokenizer.ggml.model = "gemma4"`) from the GGUF
    /// vocabulary, token types and merges (`"left right"`, in rank order).
    pub fn from_bpe_vocab(tokens: Vec<String>, types: Vec<i32>, merges: &[String], bos: u32) -> Result<Self, Error> {
        if tokens.is_empty() || tokens.len() != types.len() {
            return Err(TokenizerError::VocabularyArrays {
                tokens: tokens.len(),
                scores: tokens.len(),
                types: types.len(),
            }
            .into());
        }
        Self::from_gguf_parts(tokens, types, bos, |bytes, _| Ok(GgufMerges::Bpe(bpe::Bpe::new(merges, bytes)?)))
    }

    /// A GGUF vocabulary's tokenizer: the parts both merge schemes share, and the scheme `merges`
    /// builds from the byte tokens and the token types.
    fn from_gguf_parts(
        tokens: Vec<String>,
        types: Vec<i32>,
        bos: u32,
        merges: impl FnOnce(ByteTokens, Vec<i32>) -> Result<GgufMerges, Error>,
    ) -> Result<Self, Error> {
        let parts = GgufParts::new(tokens, &types);
        let merges = Box::new(merges(parts.bytes, types)?);
        Ok(Self {
            engine: Engine::Gguf { specials: parts.specials, merges },
            token_bytes: parts.token_bytes,
            pieces: parts.pieces,
            bos,
        })
    }

    /// Vocabulary size.
    pub fn vocab_size(&self) -> usize {
        self.token_bytes.len()
    }

    /// The `<bos>` id.
    pub fn bos_id(&self) -> u32 {
        self.bos
    }

    /// The id of a piece such as `<end_of_turn>`.
    pub fn token_id(&self, piece: &str) -> Option<u32> {
        self.pieces.get(piece).copied()
    }

    /// Encodes `text`, with `<bos>` first where `bos` says so.
    pub fn encode(&self, text: &str, bos: Bos) -> Result<Vec<u32>, Error> {
        let mut ids = Vec::new();
        if bos == Bos::Prepend {
            ids.push(self.bos);
        }
        match &self.engine {
            Engine::Hf(t) => {
                let enc = t.encode(text, false).map_err(|e| TokenizerError::Encode(e.to_string()))?;
                ids.extend_from_slice(enc.get_ids());
            }
            Engine::Gguf { specials, merges } => {
                for fragment in specials.split(text) {
                    match (fragment, merges.as_ref()) {
                        (Fragment::Token(id), _) => ids.push(id),
                        (Fragment::Text(t), GgufMerges::Spm(spm)) => spm.encode(t, &self.pieces, &mut ids)?,
                        (Fragment::Text(t), GgufMerges::Bpe(bpe)) => bpe.encode(t, &self.pieces, &mut ids)?,
                    }
                }
            }
        }
        Ok(ids)
    }

    /// Bytes of the vocabulary's longest token: no text of more than `n` times this many bytes
    /// encodes to `n` tokens or fewer (each token covers at most this many of its bytes).
    pub fn longest_token_bytes(&self) -> usize {
        self.token_bytes.iter().map(Vec::len).max().unwrap_or(0)
    }

    /// The raw bytes of one token (empty for `<bos>`, `<eos>`, `<pad>`; may be part of a UTF-8
    /// character).
    pub fn token_bytes(&self, id: u32) -> &[u8] {
        self.token_bytes.get(id as usize).map_or(&[], |b| b.as_slice())
    }

    /// Decodes ids to text (`<bos>`, `<eos>` and `<pad>` produce nothing; invalid UTF-8 becomes
    /// U+FFFD).
    pub fn decode(&self, ids: &[u32]) -> String {
        let bytes: Vec<u8> = ids.iter().flat_map(|&id| self.token_bytes(id).iter().copied()).collect();
        String::from_utf8_lossy(&bytes).into_owned()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A small SentencePiece-style vocabulary: control tokens, byte fallback, pieces with `▁`.
    fn vocab() -> (Vec<String>, Vec<f32>, Vec<i32>) {
        let mut tokens: Vec<String> =
            ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"].map(String::from).to_vec();
        let mut types = vec![3; 6];
        tokens.push("\n".into());
        types.push(4);
        for b in 0..=255u8 {
            tokens.push(format!("<0x{b:02X}>"));
            types.push(6);
        }
        for piece in ["a", "b", "c", "▁", "ab", "▁a", "▁ab", "abc", "bc"] {
            tokens.push(piece.into());
            types.push(1);
        }
        let scores = (0..tokens.len()).map(|i| i as f32 * 0.01).collect();
        (tokens, scores, types)
    }

    fn pieces(t: &Tokenizer, text: &str) -> Vec<String> {
        t.encode(text, Bos::Omit)
            .unwrap()
            .iter()
            .map(|&id| String::from_utf8_lossy(t.token_bytes(id)).into_owned())
            .collect()
    }

    #[test]
    fn spm_merges_by_score_with_specials_and_byte_fallback() {
        let (tokens, scores, types) = vocab();
        let t = Tokenizer::from_vocab(tokens, scores, types, 2).unwrap();
        // "bc" (higher id, higher score) beats "ab"; then nothing merges "a" + "bc" except "abc".
        assert_eq!(pieces(&t, "abc"), ["abc"]);
        assert_eq!(pieces(&t, "ab ab"), ["ab", " ab"]);
        assert_eq!(pieces(&t, "<start_of_turn>a\n"), ["<start_of_turn>", "a", "\n"]);
        // "é" is not in the vocabulary: two byte tokens that decode back to it.
        let ids = t.encode("é", Bos::Prepend).unwrap();
        assert_eq!(ids.len(), 3);
        assert_eq!(t.decode(&ids), "é");
        assert_eq!(t.decode(&t.encode("ab <end_of_turn>\nc", Bos::Prepend).unwrap()), "ab <end_of_turn>\nc");
    }

    #[test]
    fn mismatched_vocab_arrays_are_an_error() {
        let (tokens, scores, mut types) = vocab();
        types.pop();
        assert!(Tokenizer::from_vocab(tokens, scores, types, 2).is_err());
    }

    #[test]
    fn tokenizer_json_through_the_tokenizers_crate() {
        let (tokens, _, _) = vocab();
        let vocab: serde_json::Map<String, serde_json::Value> =
            tokens.iter().enumerate().map(|(i, t)| (t.clone(), i.into())).collect();
        let json = serde_json::json!({
            "version": "1.0",
            "added_tokens": [
                {"id": 2, "content": "<bos>", "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true},
                {"id": 4, "content": "<start_of_turn>", "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true}
            ],
            "normalizer": {"type": "Replace", "pattern": {"String": " "}, "content": "▁"},
            "pre_tokenizer": null,
            "post_processor": null,
            "decoder": null,
            "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
                      "end_of_word_suffix": null, "fuse_unk": true, "byte_fallback": true, "ignore_merges": false,
                      "vocab": vocab, "merges": [["a", "b"], ["▁", "ab"]]}
        });
        let path = std::env::temp_dir().join(format!("burn-gemma-tokenizer-{}.json", std::process::id()));
        std::fs::write(&path, json.to_string()).unwrap();
        let t = Tokenizer::from_file(&path);
        let _ = std::fs::remove_file(&path);
        let t = t.unwrap();
        assert_eq!(t.bos_id(), 2);
        assert_eq!(pieces(&t, "<start_of_turn>ab ab"), ["<start_of_turn>", "ab", " ab"]);
        let ids = t.encode("é ab", Bos::Prepend).unwrap();
        assert_eq!(t.decode(&ids), "é ab");
        assert!(Tokenizer::from_file(&path.with_extension("missing")).is_err());
    }
}
