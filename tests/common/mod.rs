//! Helpers shared by the integration tests.
#![allow(dead_code)]

use std::path::PathBuf;

/// `$BURN_GEMMA_FIXTURES`, else `../shared/fixtures` beside the repository (the override lets
/// test binaries built here run on a GPU machine with the fixtures copied elsewhere).
pub fn fixtures() -> PathBuf {
    match std::env::var_os("BURN_GEMMA_FIXTURES") {
        Some(dir) => PathBuf::from(dir),
        None => PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../shared/fixtures"),
    }
}

/// The real Gemma 3 270M GGUF: `$BURN_GEMMA_MODEL`, or the default model's cache location.
/// In CI (`CI` set) a missing model fails the test; locally the test is skipped with a reason.
pub fn real_model() -> Option<PathBuf> {
    let path = match std::env::var_os("BURN_GEMMA_MODEL") {
        Some(p) => PathBuf::from(p),
        None => burn_gemma::fetch::cache_dir().expect("cache dir").join(burn_gemma::fetch::DEFAULT_MODEL_FILE),
    };
    if path.exists() {
        return Some(path);
    }
    if std::env::var_os("CI").is_some() {
        panic!("real model not found at {} (CI must fetch it: see .ci/run)", path.display());
    }
    eprintln!(
        "SKIPPED: real model not found at {}; run `cargo run --release --example generate` once to fetch it, or set BURN_GEMMA_MODEL",
        path.display()
    );
    None
}

pub fn read_json(path: PathBuf) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display())))
        .expect("fixture JSON")
}

pub fn ids(v: &serde_json::Value) -> Vec<u32> {
    v.as_array().expect("id array").iter().map(|x| x.as_u64().expect("id") as u32).collect()
}

/// A 512-token SentencePiece-style vocabulary matching the tiny fixtures' ids.
pub fn tiny_tokenizer() -> burn_gemma::Tokenizer {
    let mut tokens = vec!["<pad>".to_string(), "<eos>".into(), "<bos>".into(), "<unk>".into()];
    let mut types = vec![3, 3, 3, 3];
    tokens.push("<start_of_turn>".into());
    tokens.push("<end_of_turn>".into());
    types.extend([3, 3]);
    for b in 0..=255u8 {
        tokens.push(format!("<0x{b:02X}>"));
        types.push(6);
    }
    while tokens.len() < 512 {
        tokens.push(format!("w{}", tokens.len()));
        types.push(1);
    }
    let scores = (0..tokens.len()).map(|i| -(i as f32)).collect();
    burn_gemma::Tokenizer::from_vocab(tokens, scores, types, 2).unwrap()
}
