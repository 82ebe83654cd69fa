//! Malformed checkpoints give a typed error naming the problem, never a panic.

use crate::common;

use burn_gemma::{backends::NdArray, Checkpoint};
use common::{Scratch, ScratchFile};
use std::path::PathBuf;

/// A fresh directory under the system temp dir, removed when dropped.
fn scratch(name: &str) -> Scratch {
    Scratch::new(name)
}

fn tiny_config() -> String {
    std::fs::read_to_string(common::fixtures().join("tiny-gemma/gemma3/config.json")).unwrap()
}

/// Writes a safetensors file from a raw header JSON and data bytes.
fn safetensors_bytes(header: &str, data: &[u8]) -> Vec<u8> {
    let mut out = (header.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(header.as_bytes());
    out.extend_from_slice(data);
    out
}

/// An HF directory with the tiny Gemma 3 config and the given `model.safetensors` bytes.
fn hf_dir(name: &str, weights: &[u8]) -> Scratch {
    let dir = scratch(name);
    std::fs::write(dir.join("config.json"), tiny_config()).unwrap();
    std::fs::write(dir.join("model.safetensors"), weights).unwrap();
    dir
}

fn open_err(path: &std::path::Path) -> String {
    match Checkpoint::open(path) {
        Ok(_) => panic!("{} opened but should have failed", path.display()),
        Err(e) => e.to_string(),
    }
}

fn load_err(path: &std::path::Path) -> String {
    let checkpoint = Checkpoint::open(path).unwrap_or_else(|e| panic!("open: {e}"));
    match checkpoint.load(common::dense_f32::<NdArray>(&Default::default())).map(burn_gemma::Loaded::into_parts) {
        Ok(_) => panic!("{} loaded but should have failed", path.display()),
        Err(e) => e.to_string(),
    }
}

fn assert_contains(message: String, needle: &str) {
    assert!(message.contains(needle), "expected {needle:?} in: {message}");
}

#[test]
fn safetensors_header_errors() {
    assert_contains(open_err(&hf_dir("st-small", &[1, 2, 3])), "too small");
    let mut huge = (200u64 * 1024 * 1024).to_le_bytes().to_vec();
    huge.extend_from_slice(b"{}");
    assert_contains(open_err(&hf_dir("st-large", &huge)), "exceeds the limit");
    let mut past = 1000u64.to_le_bytes().to_vec();
    past.extend_from_slice(b"{}");
    assert_contains(open_err(&hf_dir("st-past", &past)), "runs past the end");
    assert_contains(open_err(&hf_dir("st-json", &safetensors_bytes("{not json", &[]))), "not valid JSON");
}

#[test]
fn safetensors_entry_errors() {
    let f32x4 = [0u8; 16];
    let cases = [
        (r#"{"a":{"dtype":"F32","shape":[4],"data_offsets":[0,32]}}"#, "past the 16-byte data section"),
        (
            r#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}}"#,
            "overlap",
        ),
        (r#"{"a":{"dtype":"F32","shape":[3],"data_offsets":[0,16]}}"#, "needs 12 bytes"),
        (
            r#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"a":{"dtype":"F32","shape":[2],"data_offsets":[8,16]}}"#,
            "appears twice",
        ),
        (r#"{"a":{"dtype":"Q7","shape":[4],"data_offsets":[0,16]}}"#, "unknown dtype"),
        (r#"{"a":{"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,16]}}"#, "more bytes than fit"),
        (r#"{"a":{"dtype":"F32","shape":[4],"data_offsets":[16,0]}}"#, "end before they start"),
        (r#"{"a":{"shape":[4],"data_offsets":[0,16]}}"#, "missing string `dtype`"),
    ];
    for (i, (header, needle)) in cases.iter().enumerate() {
        let path = hf_dir(&format!("st-entry-{i}"), &safetensors_bytes(header, &f32x4));
        assert_contains(open_err(&path), needle);
    }
}

/// Header + data of the real tiny Gemma 3 checkpoint, edited by `edit`.
fn edited_tiny(name: &str, edit: impl FnOnce(&mut serde_json::Map<String, serde_json::Value>)) -> Scratch {
    let bytes = std::fs::read(common::fixtures().join("tiny-gemma/gemma3/model.safetensors")).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let mut header: serde_json::Map<String, serde_json::Value> = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    edit(&mut header);
    hf_dir(name, &safetensors_bytes(&serde_json::Value::Object(header).to_string(), &bytes[8 + n..]))
}

#[test]
fn checkpoint_content_errors() {
    let missing = edited_tiny("missing", |h| {
        h.remove("model.layers.3.mlp.up_proj.weight");
    });
    assert_contains(load_err(&missing), "missing tensor `model.layers.3.mlp.up_proj.weight`");

    let wrong_shape = edited_tiny("shape", |h| {
        let entry = h["model.layers.0.mlp.gate_proj.weight"].clone();
        h["model.layers.0.mlp.gate_proj.weight"]["shape"] = serde_json::json!([64, 160]);
        assert_eq!(entry["shape"], serde_json::json!([160, 64]));
    });
    assert_contains(load_err(&wrong_shape), "has shape [64, 160], but the config implies [160, 64]");

    let int_dtype = edited_tiny("dtype", |h| {
        // Same byte size: 64 f32 become 32 i64.
        h["model.norm.weight"]["dtype"] = "I64".into();
        h["model.norm.weight"]["shape"] = serde_json::json!([32]);
    });
    let message = load_err(&int_dtype);
    assert!(message.contains("model.norm.weight"), "{message}");

    // Extra tensors (such as a vision tower) are reported, not fatal.
    let bytes = std::fs::read(common::fixtures().join("tiny-gemma/gemma3/model.safetensors")).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let mut header: serde_json::Map<String, serde_json::Value> = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let data_len = bytes.len() - 8 - n;
    header.insert(
        "vision_tower.extra.weight".into(),
        serde_json::json!({"dtype": "F32", "shape": [4], "data_offsets": [data_len, data_len + 16]}),
    );
    let mut data = bytes[8 + n..].to_vec();
    data.extend_from_slice(&[0u8; 16]);
    let dir = hf_dir("extra2", &safetensors_bytes(&serde_json::Value::Object(header).to_string(), &data));
    let (_, report) = Checkpoint::open(&dir)
        .unwrap()
        .load(common::dense_f32::<NdArray>(&Default::default()))
        .map(burn_gemma::Loaded::into_parts)
        .unwrap();
    assert_eq!(report.unused_tensors, vec!["vision_tower.extra.weight".to_string()]);
}

#[test]
fn bad_configs_and_paths() {
    let dir = scratch("config-llama");
    std::fs::write(dir.join("config.json"), tiny_config().replace("gemma3_text", "llama")).unwrap();
    assert_contains(open_err(&dir), "not a Gemma model");
    let dir = scratch("config-heads");
    std::fs::write(
        dir.join("config.json"),
        tiny_config().replace("\"num_key_value_heads\": 2", "\"num_key_value_heads\": 3"),
    )
    .unwrap();
    assert_contains(open_err(&dir), "num_key_value_heads");
    let dir = scratch("no-weights");
    std::fs::write(dir.join("config.json"), tiny_config()).unwrap();
    assert_contains(open_err(&dir), "missing weights file model.safetensors");
    assert_contains(open_err(&PathBuf::from("/nonexistent/model.gguf")), "No such file");
    let text = scratch("text-file").file("notes.txt");
    std::fs::write(&text, "hello, this is not a model").unwrap();
    assert_contains(open_err(&text), "bad magic");
}

/// Minimal GGUF writer for hand-made files.
struct Gguf {
    bytes: Vec<u8>,
}

impl Gguf {
    fn new(version: u32, tensors: u64, kvs: u64) -> Self {
        let mut bytes = b"GGUF".to_vec();
        bytes.extend(version.to_le_bytes());
        bytes.extend(tensors.to_le_bytes());
        bytes.extend(kvs.to_le_bytes());
        Self { bytes }
    }
    fn string(&mut self, s: &str) -> &mut Self {
        self.bytes.extend((s.len() as u64).to_le_bytes());
        self.bytes.extend(s.as_bytes());
        self
    }
    fn u32(&mut self, v: u32) -> &mut Self {
        self.bytes.extend(v.to_le_bytes());
        self
    }
    fn u64(&mut self, v: u64) -> &mut Self {
        self.bytes.extend(v.to_le_bytes());
        self
    }
    fn kv_str(&mut self, key: &str, value: &str) -> &mut Self {
        self.string(key).u32(8).string(value)
    }
    fn kv_u32(&mut self, key: &str, value: u32) -> &mut Self {
        self.string(key).u32(4).u32(value)
    }
    fn tensor(&mut self, name: &str, dims: &[u64], ty: u32, offset: u64) -> &mut Self {
        self.string(name).u32(dims.len() as u32);
        for d in dims {
            self.u64(*d);
        }
        self.u32(ty).u64(offset)
    }
    fn pad(&mut self, n: usize) -> &mut Self {
        self.bytes.extend(std::iter::repeat_n(0u8, n));
        self
    }
    fn write(&self, name: &str) -> ScratchFile {
        let path = scratch(name).file("model.gguf");
        std::fs::write(&path, &self.bytes).unwrap();
        path
    }
}

#[test]
fn gguf_errors() {
    let cases: Vec<(Gguf, &str)> = vec![
        (Gguf { bytes: b"GGUL\x03\0\0\0".to_vec() }, "bad magic"),
        (Gguf::new(7, 0, 0), "unsupported GGUF version 7"),
        (Gguf::new(3, 0, u64::MAX / 2), "absurd metadata count"),
        (Gguf::new(3, u64::MAX / 2, 0), "absurd tensor count"),
        (
            {
                let mut g = Gguf::new(3, 0, 1);
                g.u64(1 << 40).pad(8);
                g
            },
            "runs past the end",
        ),
        (
            {
                let mut g = Gguf::new(3, 0, 1);
                g.string("k").u32(9).u32(4).u64(1 << 40);
                g
            },
            "array of 1099511627776 elements",
        ),
        (
            {
                let mut g = Gguf::new(3, 0, 1);
                g.string("k").u32(99).pad(8);
                g
            },
            "unknown metadata value type 99",
        ),
        (
            {
                let mut g = Gguf::new(3, 1, 0);
                g.tensor("t", &[1, 1, 1, 1, 1], 0, 0);
                g
            },
            "5 dimensions",
        ),
        (
            {
                let mut g = Gguf::new(3, 1, 0);
                g.tensor("t", &[1 << 32, 1 << 32], 0, 0);
                g
            },
            "overflows",
        ),
        (
            {
                let mut g = Gguf::new(3, 1, 0);
                g.tensor("t", &[4], 77, 0);
                g
            },
            "unknown tensor type 77",
        ),
        (
            {
                let mut g = Gguf::new(3, 1, 0);
                g.tensor("t", &[1024], 0, 0);
                g
            },
            "past the end of the file",
        ),
        (
            {
                let mut g = Gguf::new(3, 0, 1);
                g.kv_u32("general.alignment", 0);
                g
            },
            "alignment is 0",
        ),
        (
            {
                let mut g = Gguf::new(3, 0, 1);
                g.kv_u32("general.alignment", 24);
                g
            },
            "alignment is 24",
        ),
        (
            {
                let mut g = Gguf::new(3, 1, 0);
                g.tensor("t", &[33], 8, 0).pad(64);
                g
            },
            "whole number of 32-element blocks",
        ),
        (
            {
                let mut g = Gguf::new(3, 0, 1);
                g.kv_str("general.architecture", "llama");
                g
            },
            "not a Gemma model",
        ),
        (
            {
                let mut g = Gguf::new(3, 0, 1);
                g.kv_str("general.architecture", "gemma3");
                g
            },
            "embedding_length` is missing",
        ),
    ];
    for (i, (gguf, needle)) in cases.iter().enumerate() {
        let path = gguf.write(&format!("gguf-{i}"));
        assert_contains(open_err(&path), needle);
    }
}

#[test]
fn gguf_missing_tensor_is_named() {
    // A valid header for a tiny Gemma 3 with no tensors at all.
    let mut g = Gguf::new(3, 0, 8);
    g.kv_str("general.architecture", "gemma3")
        .kv_u32("gemma3.embedding_length", 64)
        .kv_u32("gemma3.block_count", 1)
        .kv_u32("gemma3.feed_forward_length", 128)
        .kv_u32("gemma3.attention.head_count", 2)
        .kv_u32("gemma3.attention.key_length", 32)
        .kv_u32("gemma3.attention.sliding_window", 16);
    g.string("tokenizer.ggml.tokens").u32(9).u32(8).u64(4);
    for t in ["<pad>", "<eos>", "<bos>", "a"] {
        g.string(t);
    }
    let path = g.write("gguf-missing");
    let message = load_err(&path);
    assert!(message.contains("missing tensor `token_embd.weight"), "{message}");
}

#[test]
fn sharded_checkpoint_loads_like_the_single_file() {
    let src = common::fixtures().join("tiny-gemma/gemma3");
    let bytes = std::fs::read(src.join("model.safetensors")).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: serde_json::Map<String, serde_json::Value> = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let data = &bytes[8 + n..];
    let dir = scratch("sharded");
    std::fs::write(dir.join("config.json"), tiny_config()).unwrap();
    let mut weight_map = serde_json::Map::new();
    let names: Vec<&String> = header.keys().filter(|k| *k != "__metadata__").collect();
    for (shard, chunk) in names.chunks(names.len().div_ceil(2)).enumerate() {
        let file = format!("model-{:05}-of-00002.safetensors", shard + 1);
        let mut shard_header = serde_json::Map::new();
        let mut shard_data = Vec::new();
        for name in chunk {
            let entry = &header[name.as_str()];
            let offsets = entry["data_offsets"].as_array().unwrap();
            let (s, e) = (offsets[0].as_u64().unwrap() as usize, offsets[1].as_u64().unwrap() as usize);
            let mut entry = entry.clone();
            entry["data_offsets"] = serde_json::json!([shard_data.len(), shard_data.len() + e - s]);
            shard_data.extend_from_slice(&data[s..e]);
            shard_header.insert((*name).clone(), entry);
            weight_map.insert((*name).clone(), file.clone().into());
        }
        std::fs::write(
            dir.join(&file),
            safetensors_bytes(&serde_json::Value::Object(shard_header).to_string(), &shard_data),
        )
        .unwrap();
    }
    std::fs::write(dir.join("model.safetensors.index.json"), serde_json::json!({"weight_map": weight_map}).to_string())
        .unwrap();

    let logits = |path: &std::path::Path| {
        let (model, report) = Checkpoint::open(path)
            .unwrap()
            .load(common::dense_f32::<NdArray>(&Default::default()))
            .map(burn_gemma::Loaded::into_parts)
            .unwrap();
        assert!(report.unused_tensors.is_empty());
        let mut cache = model.new_cache(1, 4).unwrap();
        let ids = burn::tensor::Tensor::<NdArray, 2, burn::tensor::Int>::from_data(
            [[2i64, 17, 99, 300]],
            &Default::default(),
        );
        model.forward(ids, &mut cache).unwrap().into_data()
    };
    assert_eq!(logits(&dir), logits(&src));
}

/// A decode step whose position buffer holds no valid position fails with a read-back error
/// naming the position (the reference kernels read it back to the host), and the cache whose
/// store that step was writing refuses later steps instead of computing on a lost store.
#[test]
fn decode_step_with_a_bad_device_position_is_an_error() {
    use burn::tensor::{Int, Tensor, TensorData};
    use burn_gemma::ModelError;
    use burn_gemma_kernels::SamplingParams;
    use burn_gemma_model::StepInputs;
    let device = Default::default();
    let dir = common::fixtures().join("tiny-gemma/gemma3");
    let model = Checkpoint::open(&dir).unwrap().load(common::dense_f32::<NdArray>(&device)).unwrap().model;
    let mut cache = model.new_cache(1, 16).unwrap();
    let mut inputs = StepInputs::<NdArray>::zeros(1, 8, &device);
    inputs.position = Tensor::<NdArray, 1, Int>::from_data(TensorData::new(vec![-3i64], [1]), &device);
    let greedy = SamplingParams::GREEDY;
    let message = match model.decode_step(&inputs, &mut cache, &greedy) {
        Err(e @ ModelError::ReadBack { .. }) => e.to_string(),
        other => panic!("expected a read-back error, got {:?}", other.map(|_| ())),
    };
    assert_contains(message, "the step's position");
    inputs.position = Tensor::<NdArray, 1, Int>::from_data(TensorData::new(vec![0i64], [1]), &device);
    assert!(matches!(model.decode_step(&inputs, &mut cache, &greedy), Err(ModelError::CacheLost)));
}
