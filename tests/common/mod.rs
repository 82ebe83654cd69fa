//! Helpers shared by the integration tests.
#![allow(dead_code)]

pub mod gguf;

use std::ops::Deref;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

/// A directory of one test's own under the system's temp dir, removed with what is in it when
/// dropped (a failing test's too), so that test runs leave nothing behind.
pub struct Scratch(PathBuf);

impl Scratch {
    /// A fresh, empty directory whose name holds `name`, the process and a counter (tests run in
    /// parallel, and several processes may run the suite at once).
    pub fn new(name: &str) -> Self {
        static NEXT: AtomicUsize = AtomicUsize::new(0);
        let n = NEXT.fetch_add(1, Ordering::SeqCst);
        let dir = std::env::temp_dir().join(format!("burn-gemma-test-{}-{n}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
        Self(dir)
    }

    /// `name` in this directory, which lives as long as the returned path.
    pub fn file(self, name: &str) -> ScratchFile {
        ScratchFile { path: self.0.join(name), _dir: self }
    }
}

impl Deref for Scratch {
    type Target = Path;
    fn deref(&self) -> &Path {
        &self.0
    }
}

impl AsRef<Path> for Scratch {
    fn as_ref(&self) -> &Path {
        &self.0
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A file's path in a [`Scratch`] directory that it keeps alive.
pub struct ScratchFile {
    path: PathBuf,
    _dir: Scratch,
}

impl Deref for ScratchFile {
    type Target = Path;
    fn deref(&self) -> &Path {
        &self.path
    }
}

impl AsRef<Path> for ScratchFile {
    fn as_ref(&self) -> &Path {
        &self.path
    }
}

/// `$BURN_GEMMA_FIXTURES`, else the repository's `tests/fixtures` (the override lets test
/// binaries built here run on a GPU machine with the fixtures copied elsewhere).
pub fn fixtures() -> PathBuf {
    match std::env::var_os("BURN_GEMMA_FIXTURES") {
        Some(dir) => PathBuf::from(dir),
        None => PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures"),
    }
}

/// `BURN_GEMMA_LONG_TESTS=1`: the tests that shorten their work by default (cases of the real
/// model on wgpu, ...) run all of it.
pub fn long_tests() -> bool {
    std::env::var_os("BURN_GEMMA_LONG_TESTS").is_some_and(|v| v == "1")
}

/// The real Gemma 3 270M GGUF: `$BURN_GEMMA_MODEL`, else the default model, fetched through the
/// library (`fetch::default_model`, as the README's first command does) when it is not cached.
/// The fetch runs once per test binary; a failure fails the test that asked.
pub fn real_model() -> PathBuf {
    static MODEL: std::sync::OnceLock<Result<PathBuf, String>> = std::sync::OnceLock::new();
    let model = MODEL.get_or_init(|| match std::env::var_os("BURN_GEMMA_MODEL") {
        Some(p) => Ok(PathBuf::from(p)),
        None => burn_gemma::fetch::default_model(|step, total| {
            eprintln!("fetching the default model: step {step} of {total}");
        })
        .map_err(|e| e.to_string()),
    });
    match model {
        Ok(path) => path.clone(),
        Err(e) => panic!("the real model could not be fetched ({e}); set BURN_GEMMA_MODEL to a copy of it"),
    }
}

/// Load options for the f32 reference runs: dense weights and cache in f32 on `device`.
pub fn dense_f32<B: burn_gemma::GemmaBackend>(device: &B::Device) -> burn_gemma::LoadOptions<B> {
    burn_gemma::LoadOptions::new()
        .device(device.clone())
        .dtype(burn::tensor::DType::F32)
        .weights(burn_gemma::WeightFormat::Dense)
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

/// SplitMix64: the tests' seeded random numbers.
pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
}

/// The f32 tensors of a safetensors file's bytes: name -> (shape, values).
pub fn f32_tensors(bytes: &[u8]) -> std::collections::BTreeMap<String, (Vec<usize>, Vec<f32>)> {
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: serde_json::Map<String, serde_json::Value> = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let data = &bytes[8 + n..];
    header
        .into_iter()
        .filter(|(k, _)| k != "__metadata__")
        .map(|(name, entry)| {
            assert_eq!(entry["dtype"], "F32", "{name}");
            let shape = entry["shape"].as_array().unwrap().iter().map(|d| d.as_u64().unwrap() as usize).collect();
            let offsets = entry["data_offsets"].as_array().unwrap();
            let (s, e) = (offsets[0].as_u64().unwrap() as usize, offsets[1].as_u64().unwrap() as usize);
            (name, (shape, data[s..e].chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect()))
        })
        .collect()
}
