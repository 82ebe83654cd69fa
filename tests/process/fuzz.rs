//! Seeded mutation fuzzing of every input the library reads: GGUF files, safetensors files,
//! `config.json`, `tokenizer.json` and prompts. Each mutated input must end in a typed error or
//! in a consistent load (the model then runs a forward pass); never a panic, an abort, or one
//! allocation larger than the input can justify.
//!
//! The allocation cap counts what the library allocates once the mutated input is written: the
//! harness's own copies come before.
//!
//! `FUZZ_CASES=N` runs N cases in all (default 20,000, about a minute in release mode);
//! `FUZZ_SEED=S` fixes the base seed (default: the clock, printed); a failing case prints the
//! `FUZZ_REPLAY=target:seed` that runs it alone.

use crate::common;

use burn_gemma::{
    backends::NdArray, generation::token_tensor, Checkpoint, GemmaConfig, GenerationConfig, Generator, Tokenizer,
};
use common::Rng;
use serde_json::Value as Json;
use std::alloc::{GlobalAlloc, Layout, System};
use std::collections::BTreeMap;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

/// The largest single allocation since the last [`reset_peak`]; an allocation past
/// [`ABORT_BYTES`] ends the process at once, naming the case (it could not be survived).
struct Counting;

static PEAK: AtomicUsize = AtomicUsize::new(0);
const ABORT_BYTES: usize = 4 << 30;

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        note(layout.size());
        unsafe { System.alloc(layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        note(layout.size());
        unsafe { System.alloc_zeroed(layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        note(new_size);
        unsafe { System.realloc(ptr, layout, new_size) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

/// The case running (index into [`TARGETS`] and seed), for the abort message.
static CASE_TARGET: AtomicUsize = AtomicUsize::new(usize::MAX);
static CASE_SEED: AtomicU64 = AtomicU64::new(0);

fn note(size: usize) {
    PEAK.fetch_max(size, Ordering::Relaxed);
    if size > ABORT_BYTES {
        // Nothing here may allocate: fixed byte strings, the seed as hex digits.
        use std::io::Write;
        let mut err = std::io::stderr();
        let _ = err.write_all(b"fuzz: an allocation past 4 GiB; replay with FUZZ_REPLAY=");
        let name = TARGETS.get(CASE_TARGET.load(Ordering::Relaxed)).map_or("?", |t| t.1);
        let _ = err.write_all(name.as_bytes());
        let mut hex = *b":0x0000000000000000\n";
        let seed = CASE_SEED.load(Ordering::Relaxed);
        for (i, digit) in hex[3..19].iter_mut().enumerate() {
            *digit = b"0123456789abcdef"[((seed >> (60 - 4 * i)) & 15) as usize];
        }
        let _ = err.write_all(&hex);
        std::process::abort();
    }
}

fn reset_peak() {
    PEAK.store(0, Ordering::Relaxed);
}

/// Draws beyond [`common::Rng`]'s.
trait Draw {
    fn below(&mut self, n: usize) -> usize;
    fn pick<'a, T>(&mut self, items: &'a [T]) -> &'a T;
}

impl Draw for Rng {
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
    fn pick<'a, T>(&mut self, items: &'a [T]) -> &'a T {
        &items[self.below(items.len())]
    }
}

/// Integers that break length and count arithmetic.
const EDGES: [u64; 10] = [0, 1, 31, 32, 255, 1 << 31, u32::MAX as u64, 1 << 40, i64::MAX as u64, u64::MAX];

/// 1 to 4 byte-level mutations, `hot` bytes (the header) chosen 4 times in 5.
fn mutate_bytes(bytes: &mut Vec<u8>, hot: usize, rng: &mut Rng) {
    for _ in 0..1 + rng.below(4) {
        let len = bytes.len().max(1);
        let at = if rng.below(5) < 4 { rng.below(hot.min(len)) } else { rng.below(len) };
        match rng.below(7) {
            0 => {
                if let Some(b) = bytes.get_mut(at) {
                    *b ^= 1 << rng.below(8);
                }
            }
            1 => {
                if let Some(b) = bytes.get_mut(at) {
                    *b = *rng.pick(&[0, 1, 0x7f, 0x80, 0xff]);
                }
            }
            2 => {
                // A huge count, length, offset or dimension.
                let v = rng.pick(&EDGES).to_le_bytes();
                let width = *rng.pick(&[4usize, 8]);
                for (i, &b) in v[..width].iter().enumerate() {
                    if let Some(slot) = bytes.get_mut(at + i) {
                        *slot = b;
                    }
                }
            }
            3 => bytes.truncate(at),
            4 => {
                // A span duplicated in place (repeated keys, records, tensors).
                let end = (at + 1 + rng.below(64)).min(bytes.len());
                let span = bytes[at.min(end)..end].to_vec();
                bytes.splice(at.min(end)..at.min(end), span);
            }
            5 => {
                let end = (at + 1 + rng.below(64)).min(bytes.len());
                bytes.drain(at.min(end)..end);
            }
            _ => {
                let v = rng.next().to_le_bytes();
                for (i, &b) in v.iter().enumerate() {
                    if let Some(slot) = bytes.get_mut(at + i) {
                        *slot = b;
                    }
                }
            }
        }
    }
}

/// Values that break config fields: zero, negative, huge, wrong types.
fn bad_value(rng: &mut Rng) -> Json {
    match rng.below(11) {
        0 => Json::from(0),
        1 => Json::from(-1),
        2 => Json::from(u64::MAX),
        3 => Json::from(1u64 << 40),
        4 => serde_json::json!(1e300),
        5 => Json::from("x"),
        6 => Json::Null,
        7 => serde_json::json!([]),
        8 => serde_json::json!({}),
        9 => Json::from(true),
        _ => Json::from(rng.below(70_000) as u64),
    }
}

/// Every path to a value in `json` (object keys and array indices).
fn paths(json: &Json, prefix: &mut Vec<Json>, out: &mut Vec<Vec<Json>>) {
    match json {
        Json::Object(map) => {
            for (k, v) in map {
                prefix.push(Json::from(k.clone()));
                out.push(prefix.clone());
                paths(v, prefix, out);
                prefix.pop();
            }
        }
        Json::Array(items) => {
            for (i, v) in items.iter().enumerate().take(64) {
                prefix.push(Json::from(i));
                out.push(prefix.clone());
                paths(v, prefix, out);
                prefix.pop();
            }
        }
        _ => {}
    }
}

/// The value at `path` in `node`.
fn at_path<'a>(node: &'a mut Json, path: &[Json]) -> Option<&'a mut Json> {
    let Some((step, rest)) = path.split_first() else { return Some(node) };
    let next = match (node, step) {
        (Json::Object(m), Json::String(k)) => m.get_mut(k)?,
        (Json::Array(a), Json::Number(i)) => a.get_mut(usize::try_from(i.as_u64()?).ok()?)?,
        _ => return None,
    };
    at_path(next, rest)
}

/// 1 to 3 JSON-level mutations (a field set to a bad value, removed, or nested deep), then
/// maybe a text-level one (a key repeated, the text cut, bytes flipped).
fn mutate_json(text: &str, rng: &mut Rng) -> Vec<u8> {
    let Ok(mut json) = serde_json::from_str::<Json>(text) else { return text.as_bytes().to_vec() };
    let mut all = Vec::new();
    paths(&json, &mut Vec::new(), &mut all);
    for _ in 0..1 + rng.below(3) {
        let Some(path) = (!all.is_empty()).then(|| rng.pick(&all).clone()) else { break };
        let Some((last, parents)) = path.split_last() else { continue };
        let Some(node) = at_path(&mut json, parents) else { continue };
        let choice = rng.below(4);
        match (node, last) {
            (Json::Object(m), Json::String(k)) if choice == 0 => {
                m.remove(k);
            }
            (Json::Object(m), Json::String(k)) if choice == 1 => {
                let deep = (0..200 + rng.below(2000)).fold(bad_value(rng), |v, _| Json::Array(vec![v]));
                m.insert(k.clone(), deep);
            }
            (Json::Object(m), Json::String(k)) => {
                m.insert(k.clone(), bad_value(rng));
            }
            (Json::Array(a), Json::Number(i)) => {
                if let Some(slot) = a.get_mut(i.as_u64().unwrap_or(0) as usize) {
                    *slot = bad_value(rng);
                }
            }
            _ => {}
        }
    }
    let mut bytes = json.to_string().into_bytes();
    match rng.below(4) {
        0 => {
            // A key repeated: the first `"key":value,` of the text inserted again.
            if let (Some(start), Some(comma)) =
                (bytes.iter().position(|&b| b == b'"'), bytes.iter().position(|&b| b == b','))
            {
                if start < comma {
                    let dup = bytes[start..=comma].to_vec();
                    bytes.splice(start..start, dup);
                }
            }
        }
        1 => {
            let len = bytes.len();
            mutate_bytes(&mut bytes, len, rng);
        }
        _ => {}
    }
    bytes
}

/// What a case ended in.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
enum Outcome {
    /// Loaded (and ran) consistently.
    Loaded,
    /// A typed error: its variant.
    Error(String),
}

/// The error's variant, and the inner error's variant where it wraps one (`Model::InvalidConfig`).
fn error_kind(e: &burn_gemma::Error) -> Outcome {
    let debug = format!("{e:?}");
    let word = |s: &str| s[..s.find(|c: char| !c.is_alphanumeric()).unwrap_or(s.len())].to_string();
    let outer = word(&debug);
    let inner = debug[outer.len()..].strip_prefix('(').map(word).filter(|w| !w.is_empty());
    Outcome::Error(inner.map_or(outer.clone(), |w| format!("{outer}::{w}")))
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Target {
    Gguf,
    Safetensors,
    Config,
    Tokenizer,
    Prompt,
}

const TARGETS: [(Target, &str, usize); 5] = [
    // (target, name, share of the cases in percent)
    (Target::Gguf, "gguf", 35),
    (Target::Safetensors, "safetensors", 25),
    (Target::Config, "config", 20),
    (Target::Tokenizer, "tokenizer", 10),
    (Target::Prompt, "prompt", 10),
];

/// The unmutated inputs, and where cases write theirs.
struct Seeds {
    dir: PathBuf,
    gguf: Vec<u8>,
    gguf_header: usize,
    safetensors: Vec<u8>,
    config: String,
    tokenizer: String,
    generator: Generator<NdArray>,
}

/// The tiny Gemma 3 fixture as llama.cpp lays out a GGUF (its names, dims innermost first, norms
/// stored as `1 + w`, a SentencePiece vocabulary): the projections in Q8_0, the rest f32.
fn tiny_gguf(config: &Json, tensors: &BTreeMap<String, (Vec<usize>, Vec<f32>)>) -> (Vec<u8>, usize) {
    let u = |k: &str| config[k].as_u64().unwrap();
    let vocab = u("vocab_size") as usize;
    let mut out = b"GGUF".to_vec();
    let string = |out: &mut Vec<u8>, s: &str| {
        out.extend((s.len() as u64).to_le_bytes());
        out.extend(s.as_bytes());
    };
    let kv_u32 = |out: &mut Vec<u8>, k: &str, v: u64| {
        string(out, k);
        out.extend(4u32.to_le_bytes());
        out.extend((v as u32).to_le_bytes());
    };
    let kv_f32 = |out: &mut Vec<u8>, k: &str, v: f32| {
        string(out, k);
        out.extend(6u32.to_le_bytes());
        out.extend(v.to_le_bytes());
    };
    let mut meta = Vec::new();
    string(&mut meta, "general.architecture");
    meta.extend(8u32.to_le_bytes());
    string(&mut meta, "gemma3");
    for (k, v) in [
        ("gemma3.block_count", u("num_hidden_layers")),
        ("gemma3.context_length", u("max_position_embeddings")),
        ("gemma3.embedding_length", u("hidden_size")),
        ("gemma3.feed_forward_length", u("intermediate_size")),
        ("gemma3.attention.head_count", u("num_attention_heads")),
        ("gemma3.attention.head_count_kv", u("num_key_value_heads")),
        ("gemma3.attention.key_length", u("head_dim")),
        ("gemma3.attention.value_length", u("head_dim")),
        ("gemma3.attention.sliding_window", u("sliding_window")),
        ("tokenizer.ggml.bos_token_id", 2),
        ("tokenizer.ggml.eos_token_id", 1),
    ] {
        kv_u32(&mut meta, k, v);
    }
    kv_f32(&mut meta, "gemma3.attention.layer_norm_rms_epsilon", 1e-6);
    kv_f32(&mut meta, "gemma3.rope.freq_base", 1e6);
    string(&mut meta, "tokenizer.ggml.model");
    meta.extend(8u32.to_le_bytes());
    string(&mut meta, "llama");
    // Pieces: control tokens, the 256 byte tokens, then letters.
    let pieces: Vec<String> = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
        .iter()
        .map(|s| s.to_string())
        .chain((0..=255u8).map(|b| format!("<0x{b:02X}>")))
        .chain((0..).map(|i| format!("▁{}", char::from(b'a' + (i % 26) as u8).to_string().repeat(1 + i / 26))))
        .take(vocab)
        .collect();
    string(&mut meta, "tokenizer.ggml.tokens");
    meta.extend(9u32.to_le_bytes());
    meta.extend(8u32.to_le_bytes());
    meta.extend((vocab as u64).to_le_bytes());
    pieces.iter().for_each(|p| string(&mut meta, p));
    string(&mut meta, "tokenizer.ggml.scores");
    meta.extend(9u32.to_le_bytes());
    meta.extend(6u32.to_le_bytes());
    meta.extend((vocab as u64).to_le_bytes());
    (0..vocab).for_each(|i| meta.extend((-(i as f32)).to_le_bytes()));
    string(&mut meta, "tokenizer.ggml.token_type");
    meta.extend(9u32.to_le_bytes());
    meta.extend(5u32.to_le_bytes());
    meta.extend((vocab as u64).to_le_bytes());
    // Control, byte, then normal pieces.
    let token_type = |i: usize| -> i32 {
        match i {
            0..6 => 3,
            6..262 => 6,
            _ => 1,
        }
    };
    (0..vocab).for_each(|i| meta.extend(token_type(i).to_le_bytes()));
    // architecture, 11 integers, 2 floats, the tokenizer model and its three arrays.
    let kvs = 1 + 11 + 2 + 1 + 3u64;

    let (mut infos, mut data, mut count) = (Vec::new(), Vec::new(), 0u64);
    for (hf, (shape, values)) in tensors {
        let name = gguf_name(hf);
        let norm = hf.ends_with("norm.weight");
        let matrix = shape.len() == 2 && !hf.contains("embed") && shape[1] % 32 == 0;
        string(&mut infos, &name);
        infos.extend((shape.len() as u32).to_le_bytes());
        shape.iter().rev().for_each(|&d| infos.extend((d as u64).to_le_bytes()));
        infos.extend((if matrix { 8u32 } else { 0 }).to_le_bytes());
        infos.extend((data.len() as u64).to_le_bytes());
        if matrix {
            let q =
                burn_gemma_kernels::HostQuantized::quantize(values, shape[0], shape[1], burn_gemma::QuantFormat::Q8)
                    .unwrap();
            data.extend(burn_gemma_kernels::GgmlBlocks::from_quantized(&q).bytes());
        } else {
            values.iter().for_each(|&v| data.extend((if norm { v + 1.0 } else { v }).to_le_bytes()));
        }
        data.resize(data.len().div_ceil(32) * 32, 0);
        count += 1;
    }
    out.extend(3u32.to_le_bytes());
    out.extend(count.to_le_bytes());
    out.extend(kvs.to_le_bytes());
    out.extend(meta);
    out.extend(infos);
    out.resize(out.len().div_ceil(32) * 32, 0);
    let header = out.len();
    out.extend(data);
    (out, header)
}

/// llama.cpp's name of an HF Gemma 3 tensor.
fn gguf_name(hf: &str) -> String {
    match hf {
        "model.embed_tokens.weight" => return "token_embd.weight".into(),
        "model.norm.weight" => return "output_norm.weight".into(),
        _ => {}
    }
    let (layer, part) = hf.strip_prefix("model.layers.").and_then(|r| r.split_once('.')).expect("a layer tensor");
    let g = match part {
        "input_layernorm.weight" => "attn_norm",
        "post_attention_layernorm.weight" => "post_attention_norm",
        "pre_feedforward_layernorm.weight" => "ffn_norm",
        "post_feedforward_layernorm.weight" => "post_ffw_norm",
        "self_attn.q_proj.weight" => "attn_q",
        "self_attn.k_proj.weight" => "attn_k",
        "self_attn.v_proj.weight" => "attn_v",
        "self_attn.o_proj.weight" => "attn_output",
        "self_attn.q_norm.weight" => "attn_q_norm",
        "self_attn.k_norm.weight" => "attn_k_norm",
        "mlp.gate_proj.weight" => "ffn_gate",
        "mlp.up_proj.weight" => "ffn_up",
        "mlp.down_proj.weight" => "ffn_down",
        other => panic!("unmapped {other}"),
    };
    format!("blk.{layer}.{g}.weight")
}

/// A small `tokenizer.json` (BPE with byte fallback and Gemma's control tokens).
fn tokenizer_json() -> String {
    let mut vocab = serde_json::Map::new();
    for (i, piece) in
        ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>", "a", "b", "ab", "▁", "▁ab"]
            .iter()
            .enumerate()
    {
        vocab.insert(piece.to_string(), i.into());
    }
    for b in 0..=255u8 {
        let n = vocab.len();
        vocab.insert(format!("<0x{b:02X}>"), n.into());
    }
    let special = |id: usize, content: &str| {
        serde_json::json!({"id": id, "content": content, "single_word": false, "lstrip": false, "rstrip": false,
                           "normalized": false, "special": true})
    };
    serde_json::json!({
        "version": "1.0",
        "added_tokens": [special(2, "<bos>"), special(4, "<start_of_turn>"), special(5, "<end_of_turn>")],
        "normalizer": {"type": "Replace", "pattern": {"String": " "}, "content": "▁"},
        "pre_tokenizer": null, "post_processor": null, "decoder": null,
        "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
                  "end_of_word_suffix": null, "fuse_unk": true, "byte_fallback": true, "ignore_merges": false,
                  "vocab": vocab, "merges": [["a", "b"], ["▁", "ab"]]}
    })
    .to_string()
}

impl Seeds {
    fn new() -> Self {
        let fixture = common::fixtures().join("tiny-gemma/gemma3");
        let config = std::fs::read_to_string(fixture.join("config.json")).unwrap();
        let safetensors = std::fs::read(fixture.join("model.safetensors")).unwrap();
        let (gguf, gguf_header) =
            tiny_gguf(&serde_json::from_str(&config).unwrap(), &common::f32_tensors(&safetensors));
        // Scratch files in memory where the system has a tmpfs.
        let base = if Path::new("/dev/shm").is_dir() { PathBuf::from("/dev/shm") } else { std::env::temp_dir() };
        let dir = base.join(format!("burn-gemma-fuzz-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(dir.join("hf")).unwrap();
        std::fs::write(dir.join("hf/config.json"), &config).unwrap();
        std::fs::write(dir.join("hf/model.safetensors"), &safetensors).unwrap();
        // The unmutated GGUF must load, or every GGUF case would test nothing.
        std::fs::write(dir.join("model.gguf"), &gguf).unwrap();
        let checkpoint = Checkpoint::open(dir.join("model.gguf")).expect("the seed GGUF opens");
        let (model, _) = checkpoint
            .load(common::dense_f32::<NdArray>(&Default::default()))
            .map(burn_gemma::Loaded::into_parts)
            .expect("the seed GGUF loads");
        let generator = Generator::new(model, checkpoint.tokenizer().expect("the seed GGUF's tokenizer")).unwrap();
        Self { dir, gguf, gguf_header, safetensors, config, tokenizer: tokenizer_json(), generator }
    }
}

/// Opens `path`, loads the model, and runs two tokens through it.
fn load_and_run(path: &Path) -> Result<Outcome, burn_gemma::Error> {
    let checkpoint = Checkpoint::open(path)?;
    let (model, _) =
        checkpoint.load(common::dense_f32::<NdArray>(&Default::default())).map(burn_gemma::Loaded::into_parts)?;
    let device = Default::default();
    let mut cache = model.new_cache(1, 4)?;
    let logits = model.forward_last(token_tensor::<NdArray>(&[2, 7], &device), &mut cache)?;
    let _ = logits.into_data();
    if let Format::Gguf = format(path) {
        checkpoint.tokenizer()?.encode("ab <start_of_turn>", burn_gemma::Bos::Prepend)?;
    }
    Ok(Outcome::Loaded)
}

enum Format {
    Gguf,
    Hf,
}

fn format(path: &Path) -> Format {
    if path.is_dir() {
        Format::Hf
    } else {
        Format::Gguf
    }
}

/// Prompt fragments: control tokens, multi-byte characters, and text cut inside characters.
const FRAGMENTS: [&str; 10] =
    ["<start_of_turn>", "<end_of_turn>", "<bos>", "<eos>", "user\n", "ab", " ", "é", "😀", "\u{0}"];

fn prompt(rng: &mut Rng) -> String {
    let mut bytes = Vec::new();
    for _ in 0..rng.below(12) {
        let f = rng.pick(&FRAGMENTS).as_bytes();
        // Sometimes cut inside a character: the lossy decoding then holds U+FFFD.
        let cut = if rng.below(4) == 0 { rng.below(f.len() + 1) } else { f.len() };
        bytes.extend_from_slice(&f[..cut]);
    }
    String::from_utf8_lossy(&bytes).into_owned()
}

/// One case of `target` from `seed`: its outcome and the bytes of every input it read (the
/// mutated one and the unmutated files beside it); `Err` carries the panic message.
fn run_case(seeds: &mut Seeds, target: Target, seed: u64) -> Result<(Outcome, usize), String> {
    let mut rng = Rng(seed);
    let dir = seeds.dir.clone();
    let result = catch_unwind(AssertUnwindSafe(|| -> (Outcome, usize) {
        let outcome = |r: Result<Outcome, burn_gemma::Error>| r.unwrap_or_else(|e| error_kind(&e));
        match target {
            Target::Gguf => {
                let mut bytes = seeds.gguf.clone();
                mutate_bytes(&mut bytes, seeds.gguf_header, &mut rng);
                let path = dir.join("case.gguf");
                std::fs::write(&path, &bytes).unwrap();
                reset_peak();
                (outcome(load_and_run(&path)), bytes.len())
            }
            Target::Safetensors => {
                let mut bytes = seeds.safetensors.clone();
                if rng.below(2) == 0 {
                    // The header as JSON.
                    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
                    let header = String::from_utf8_lossy(&bytes[8..8 + n]).into_owned();
                    let mutated = mutate_json(&header, &mut rng);
                    let mut out = (mutated.len() as u64).to_le_bytes().to_vec();
                    out.extend(mutated);
                    out.extend_from_slice(&bytes[8 + n..]);
                    bytes = out;
                } else {
                    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
                    mutate_bytes(&mut bytes, n + 8, &mut rng);
                }
                std::fs::write(dir.join("hf/model.safetensors"), &bytes).unwrap();
                reset_peak();
                let result = outcome(load_and_run(&dir.join("hf")));
                std::fs::write(dir.join("hf/model.safetensors"), &seeds.safetensors).unwrap();
                (result, bytes.len() + seeds.config.len())
            }
            Target::Config => {
                let text = mutate_json(&seeds.config, &mut rng);
                std::fs::write(dir.join("hf/config.json"), &text).unwrap();
                reset_peak();
                let direct = match std::str::from_utf8(&text) {
                    Ok(t) => GemmaConfig::from_hf_json(t).map(|_| ()).map_err(burn_gemma::Error::from),
                    Err(_) => Ok(()),
                };
                let result = match direct {
                    Err(e) => error_kind(&e),
                    Ok(()) => outcome(load_and_run(&dir.join("hf"))),
                };
                std::fs::write(dir.join("hf/config.json"), &seeds.config).unwrap();
                (result, text.len() + seeds.safetensors.len())
            }
            Target::Tokenizer => {
                let text = mutate_json(&seeds.tokenizer, &mut rng);
                let path = dir.join("tokenizer.json");
                std::fs::write(&path, &text).unwrap();
                let prompt = prompt(&mut rng);
                reset_peak();
                let result = Tokenizer::from_file(&path).and_then(|t| {
                    let ids = t.encode(&prompt, burn_gemma::Bos::Prepend)?;
                    let _ = t.decode(&ids);
                    Ok(Outcome::Loaded)
                });
                (outcome(result), text.len())
            }
            Target::Prompt => {
                let text = prompt(&mut rng);
                let config = GenerationConfig { max_new_tokens: 1 + rng.below(3), ..GenerationConfig::default() };
                reset_peak();
                let result = if rng.below(2) == 0 {
                    seeds.generator.generate(&text, &config, |_| {}).map(|_| Outcome::Loaded)
                } else {
                    seeds.generator.chat(&text, &config, |_| {}).map(|_| Outcome::Loaded)
                };
                seeds.generator.reset();
                // The model it runs was read from the seed GGUF.
                (outcome(result), text.len() + seeds.gguf.len())
            }
        }
    }));
    result.map_err(|panic| {
        panic
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_default()
    })
}

/// The most one allocation of a case may take: what the input's size justifies (the tiny
/// model's tensors dequantized to f32 and their working copies) plus 2 MiB of fixed buffers
/// (the largest seen: 1 MiB).
fn allocation_cap(input_len: usize) -> usize {
    16 * input_len + (2 << 20)
}

#[test]
fn mutated_inputs_end_in_errors_or_loads() {
    let _alone = crate::alone();
    let cases: usize = std::env::var("FUZZ_CASES").ok().and_then(|s| s.parse().ok()).unwrap_or(20_000);
    let base: u64 = std::env::var("FUZZ_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or_else(|| {
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(1, |d| d.as_nanos() as u64)
    });
    let replay = std::env::var("FUZZ_REPLAY").ok();
    let mut seeds = Seeds::new();
    let start = std::time::Instant::now();
    let mut counts: BTreeMap<(Target, Outcome), usize> = BTreeMap::new();
    let (mut peak_ratio, mut peak_bytes, mut worst) = (0.0f64, 0usize, String::new());
    let mut ran = 0;
    for (index, &(target, name, share)) in TARGETS.iter().enumerate() {
        let n = cases * share / 100;
        let run: Vec<u64> = match &replay {
            Some(r) => match r.split_once(':') {
                Some((t, s)) if t == name => {
                    vec![u64::from_str_radix(s.trim_start_matches("0x"), 16)
                        .or_else(|_| s.parse())
                        .expect("FUZZ_REPLAY seed")]
                }
                _ => continue,
            },
            None => (0..n as u64).map(|i| Rng(base ^ (index as u64) << 56 ^ i).next()).collect(),
        };
        for seed in run {
            CASE_TARGET.store(index, Ordering::Relaxed);
            CASE_SEED.store(seed, Ordering::Relaxed);
            match run_case(&mut seeds, target, seed) {
                Ok((outcome, len)) => {
                    let peak = PEAK.load(Ordering::Relaxed);
                    assert!(
                        peak <= allocation_cap(len),
                        "FUZZ_REPLAY={name}:{seed:#x}: one allocation of {peak} bytes for a {len}-byte input (cap {})",
                        allocation_cap(len)
                    );
                    if peak as f64 / len.max(1) as f64 > peak_ratio {
                        peak_ratio = peak as f64 / len.max(1) as f64;
                        worst = format!("FUZZ_REPLAY={name}:{seed:#x}, {peak} bytes for {len}");
                    }
                    peak_bytes = peak_bytes.max(peak);
                    *counts.entry((target, outcome)).or_default() += 1;
                }
                Err(message) => panic!("FUZZ_REPLAY={name}:{seed:#x} panicked: {message}"),
            }
            ran += 1;
        }
    }
    let _ = std::fs::remove_dir_all(&seeds.dir);
    println!("fuzz: {ran} cases in {:.1} s, base seed {base} (FUZZ_SEED)", start.elapsed().as_secs_f64());
    for ((target, outcome), n) in &counts {
        println!("fuzz: {target:?} {outcome:?}: {n}");
    }
    println!(
        "fuzz: largest single allocation {peak_bytes} bytes; largest against its case's inputs {peak_ratio:.2}x ({worst})"
    );
    if replay.is_none() {
        assert!(ran >= cases * 99 / 100, "ran {ran} of {cases} cases");
        for (target, _, _) in TARGETS {
            assert!(
                counts.keys().any(|(t, o)| *t == target && *o != Outcome::Loaded),
                "{target:?}: no case failed to load"
            );
        }
    }
}
