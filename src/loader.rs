//! Opening checkpoints: a Hugging Face directory (`config.json` + safetensors, single or
//! sharded) or a GGUF file, as a [`WeightSource`] for the model and a [`Tokenizer`].

use crate::{
    error::TokenizerError,
    gguf::{GgufFile, Value},
    safetensors::{Dtype, SafetensorsFile},
    Error, LoadOptions, LoadProgress, Tokenizer,
};
use burn::tensor::{backend::Backend, DType, Tensor, TensorData};
use burn_gemma_kernels::{GemmaBackend, GgmlBlocks, HostQuantized, QuantFormat};
use burn_gemma_model::{
    config::{default_layer_types, NormScale},
    weights::{quantize, row_chunks, WeightKind},
    Architecture, Gemma, GemmaConfig, LayerType, ModelError, MoeConfig, RopeConfig, WeightSource,
};
use std::{
    collections::{HashMap, HashSet},
    path::{Path, PathBuf},
};

/// An opened checkpoint, validated but not yet loaded onto a device.
pub struct Checkpoint {
    path: PathBuf,
    format: Format,
    config: GemmaConfig,
}

enum Format {
    Hf { shards: Vec<SafetensorsFile>, index: HashMap<String, usize> },
    Gguf(Box<GgufFile>),
}

/// A loaded model and what loading left aside.
#[derive(Debug)]
pub struct Loaded<B: GemmaBackend> {
    pub model: Gemma<B>,
    pub report: LoadReport,
}

impl<B: GemmaBackend> Loaded<B> {
    /// The model and the report, apart.
    pub fn into_parts(self) -> (Gemma<B>, LoadReport) {
        (self.model, self.report)
    }
}

/// What loading left aside.
#[derive(Debug, Clone, Default)]
pub struct LoadReport {
    /// Tensors in the checkpoint the text model does not use (e.g. a vision tower).
    pub unused_tensors: Vec<String>,
}

impl Checkpoint {
    /// Opens a GGUF file or an HF directory and validates its config.
    pub fn open(path: impl AsRef<Path>) -> Result<Self, Error> {
        let path = path.as_ref().to_path_buf();
        let meta = std::fs::metadata(&path).map_err(|source| Error::Io { path: path.clone(), source })?;
        if meta.is_dir() {
            Self::open_hf_dir(path)
        } else {
            Self::open_gguf(path)
        }
    }

    fn open_hf_dir(dir: PathBuf) -> Result<Self, Error> {
        let config_path = dir.join("config.json");
        let text =
            std::fs::read_to_string(&config_path).map_err(|source| Error::Io { path: config_path.clone(), source })?;
        let config =
            GemmaConfig::from_hf_json(&text).map_err(|e| Error::Config { path: config_path, source: Box::new(e) })?;

        let index_path = dir.join("model.safetensors.index.json");
        let shard_names: Vec<String> = if index_path.exists() {
            let text = std::fs::read_to_string(&index_path)
                .map_err(|source| Error::Io { path: index_path.clone(), source })?;
            let index: serde_json::Value = serde_json::from_str(&text).map_err(|e| Error::NotAModel {
                path: index_path.clone(),
                reason: format!("index is not JSON: {e}"),
            })?;
            let map = index.get("weight_map").and_then(|m| m.as_object()).ok_or_else(|| Error::NotAModel {
                path: index_path.clone(),
                reason: "index has no `weight_map` object".into(),
            })?;
            let mut names: Vec<String> = map.values().filter_map(|v| v.as_str().map(str::to_string)).collect();
            names.sort();
            names.dedup();
            names
        } else {
            vec!["model.safetensors".to_string()]
        };
        let mut shards = Vec::with_capacity(shard_names.len());
        let mut index = HashMap::new();
        for name in &shard_names {
            if name.contains('/') || name.contains('\\') || name.contains("..") {
                return Err(Error::NotAModel {
                    path: index_path.clone(),
                    reason: format!("shard name {name:?} leaves the directory"),
                });
            }
            let shard_path = dir.join(name);
            if !shard_path.exists() {
                return Err(Error::NotAModel { path: dir.clone(), reason: format!("missing weights file {name}") });
            }
            let file = SafetensorsFile::open(&shard_path)
                .map_err(|source| Error::Safetensors { path: shard_path.clone(), source: Box::new(source) })?;
            for tensor in file.tensors().keys() {
                if index.insert(tensor.clone(), shards.len()).is_some() {
                    return Err(Error::NotAModel {
                        path: shard_path.clone(),
                        reason: format!("tensor `{tensor}` is in two shards"),
                    });
                }
            }
            shards.push(file);
        }
        Ok(Self { path: dir, format: Format::Hf { shards, index }, config })
    }

    fn open_gguf(path: PathBuf) -> Result<Self, Error> {
        let file =
            GgufFile::open(&path).map_err(|source| Error::Gguf { path: path.clone(), source: Box::new(source) })?;
        let config = config_from_gguf(&file).map_err(|e| Error::Config { path: path.clone(), source: Box::new(e) })?;
        Ok(Self { path, format: Format::Gguf(Box::new(file)), config })
    }

    /// The checkpoint's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The validated model config.
    pub fn config(&self) -> &GemmaConfig {
        &self.config
    }

    /// Number of tensors the model will request (for progress reporting).
    pub fn tensors_to_load(&self) -> usize {
        let c = &self.config;
        let layers: usize = (0..c.num_hidden_layers)
            .map(|i| {
                let kind = c.layer_types[i];
                let (own_kv, values) = (c.kv_producer(i).is_none(), !c.values_from_keys(kind));
                // q, o, gate, up, down, and two norms; k and v; sandwich and QK norms.
                let base = 7 + usize::from(own_kv) * (1 + usize::from(values));
                let sandwich = if c.model_type.has_sandwich_norms() { 2 } else { 0 };
                let qk_norm = if c.model_type.has_qk_norm() { 1 + usize::from(own_kv) } else { 0 };
                let gemma4 = if c.model_type == Architecture::Gemma4 { 1 } else { 0 };
                let per_layer_input = if c.hidden_size_per_layer_input > 0 { 3 } else { 0 };
                let experts = if c.moe.is_some() { 8 } else { 0 };
                base + sandwich + qk_norm + gemma4 + per_layer_input + experts
            })
            .sum();
        let per_layer_tables = if c.hidden_size_per_layer_input > 0 { 3 } else { 0 };
        2 + per_layer_tables + layers
    }

    /// Loads the model as `options` say (device, dtype, weight and KV-cache formats, progress;
    /// see [`LoadOptions`] for the defaults).
    pub fn load<B: GemmaBackend>(&self, options: LoadOptions<B>) -> Result<Loaded<B>, Error> {
        let (options, device, mut progress) = options.into_parts();
        crate::backends::check_dtype::<B>(&device, options.dtype)?;
        let total = self.tensors_to_load();
        let mut report = |loaded: usize, total: usize| {
            if let Some(progress) = progress.as_mut() {
                progress(LoadProgress { loaded, total });
            }
        };
        let mut source = Source { checkpoint: self, used: HashSet::new(), progress: &mut report, total };
        let model = Gemma::load(self.config.clone(), &mut source, &options, &device)?;
        let used = source.used;
        let mut unused: Vec<String> = match &self.format {
            Format::Hf { index, .. } => index.keys().filter(|n| !used.contains(*n)).cloned().collect(),
            Format::Gguf(f) => f.tensors().keys().filter(|n| !used.contains(*n)).cloned().collect(),
        };
        // Gemma 4's `rope_freqs` is read into the config (the share of rotating pairs).
        unused.retain(|n| n != "rope_freqs.weight");
        unused.sort();
        Ok(Loaded { model, report: LoadReport { unused_tensors: unused } })
    }

    /// The tokenizer: `tokenizer.json` beside HF weights, or the GGUF's embedded vocabulary.
    pub fn tokenizer(&self) -> Result<Tokenizer, Error> {
        match &self.format {
            Format::Hf { .. } => {
                let path = self.path.join("tokenizer.json");
                if !path.exists() {
                    return Err(TokenizerError::NotFound(path).into());
                }
                Tokenizer::from_file(&path)
            }
            Format::Gguf(f) => tokenizer_from_gguf(f),
        }
    }
}

struct Source<'a, F: FnMut(usize, usize)> {
    checkpoint: &'a Checkpoint,
    used: HashSet<String>,
    progress: &'a mut F,
    total: usize,
}

/// HF names of multimodal checkpoints put the text model under another prefix.
fn hf_candidates(name: &str) -> [String; 3] {
    let rest = name.strip_prefix("model.").unwrap_or(name);
    [name.to_string(), format!("model.language_model.{rest}"), format!("language_model.{name}")]
}

/// GGUF tensor name of an HF weight name.
fn gguf_name(name: &str, arch: Architecture) -> Option<String> {
    match name {
        "model.embed_tokens.weight" => return Some("token_embd.weight".into()),
        "model.norm.weight" => return Some("output_norm.weight".into()),
        "model.embed_tokens_per_layer.weight" => return Some("per_layer_token_embd.weight".into()),
        "model.per_layer_model_projection.weight" => return Some("per_layer_model_proj.weight".into()),
        "model.per_layer_projection_norm.weight" => return Some("per_layer_proj_norm.weight".into()),
        _ => {}
    }
    let rest = name.strip_prefix("model.layers.")?;
    let (layer, rest) = rest.split_once('.')?;
    // Gemma 4's parameters without a `.weight` suffix.
    let unsuffixed = match rest {
        "layer_scalar" => Some("layer_output_scale.weight"),
        "router.scale" => Some("ffn_gate_inp.scale"),
        "router.per_expert_scale" => Some("ffn_down_exps.scale"),
        "experts.gate_up_proj" => Some("ffn_gate_up_exps.weight"),
        "experts.down_proj" => Some("ffn_down_exps.weight"),
        _ => None,
    };
    if let Some(gguf) = unsuffixed {
        return Some(format!("blk.{layer}.{gguf}"));
    }
    let part = rest.strip_suffix(".weight")?;
    let gguf = match part {
        "router.proj" => "ffn_gate_inp",
        "pre_feedforward_layernorm_2" => "pre_ffw_norm_2",
        "post_feedforward_layernorm_1" => "post_ffw_norm_1",
        "post_feedforward_layernorm_2" => "post_ffw_norm_2",
        "per_layer_input_gate" => "inp_gate",
        "per_layer_projection" => "proj",
        "post_per_layer_input_norm" => "post_norm",
        "input_layernorm" => "attn_norm",
        "self_attn.q_proj" => "attn_q",
        "self_attn.k_proj" => "attn_k",
        "self_attn.v_proj" => "attn_v",
        "self_attn.o_proj" => "attn_output",
        "self_attn.q_norm" => "attn_q_norm",
        "self_attn.k_norm" => "attn_k_norm",
        // Gemma 1's `post_attention_layernorm` is its pre-MLP norm.
        "post_attention_layernorm" if arch == Architecture::Gemma => "ffn_norm",
        "post_attention_layernorm" => "post_attention_norm",
        "pre_feedforward_layernorm" => "ffn_norm",
        "post_feedforward_layernorm" => "post_ffw_norm",
        "mlp.gate_proj" => "ffn_gate",
        "mlp.up_proj" => "ffn_up",
        "mlp.down_proj" => "ffn_down",
        _ => return None,
    };
    Some(format!("blk.{layer}.{gguf}.weight"))
}

impl<F: FnMut(usize, usize)> Source<'_, F> {
    /// The tensor `name` on the host, in its stored dtype (GGUF: dequantized to f32), with HF
    /// conventions.
    fn host_data(&mut self, name: &str, shape: &[usize], kind: WeightKind) -> Result<TensorData, ModelError> {
        let mismatch = |actual: &[usize]| ModelError::ShapeMismatch {
            name: name.to_string(),
            expected: shape.to_vec(),
            actual: actual.to_vec(),
        };
        let data = match &self.checkpoint.format {
            Format::Hf { shards, index } => {
                let (stored, shard) = hf_candidates(name)
                    .into_iter()
                    .find_map(|n| index.get(&n).map(|&s| (n, s)))
                    .ok_or_else(|| ModelError::MissingTensor(name.to_string()))?;
                let file = &shards[shard];
                let info = file.tensors().get(&stored).ok_or_else(|| ModelError::MissingTensor(stored.clone()))?;
                if info.shape() != shape {
                    return Err(mismatch(info.shape()));
                }
                let stored_dtype = match info.dtype() {
                    Dtype::F32 => DType::F32,
                    Dtype::F16 => DType::F16,
                    Dtype::BF16 => DType::BF16,
                    other => {
                        return Err(ModelError::UnsupportedTensorDtype { name: stored, dtype: format!("{other:?}") })
                    }
                };
                let bytes = file.bytes(&stored).ok_or_else(|| ModelError::MissingTensor(stored.clone()))?.to_vec();
                self.used.insert(stored);
                TensorData::from_bytes_vec(bytes, shape.to_vec(), stored_dtype)
            }
            Format::Gguf(file) => {
                let stored = Self::gguf_tensor(file, self.checkpoint.config.model_type, name, shape)?;
                let mut values = file.dequantize(&stored).map_err(|e| ModelError::Source(Box::new(e)))?;
                if kind == WeightKind::Norm(NormScale::OnePlusWeight) {
                    // llama.cpp's converter stores Gemma 1-3 norm weights as `1 + w` (Gemma 4's
                    // scale by `w` and are stored as they are).
                    values.iter_mut().for_each(|v| *v -= 1.0);
                }
                self.used.insert(stored);
                TensorData::new(values, shape.to_vec())
            }
        };
        (self.progress)(self.used.len(), self.total);
        Ok(data)
    }
}

impl<F: FnMut(usize, usize)> Source<'_, F> {
    /// The GGUF name of the HF tensor `name`, its shape checked against `shape`.
    fn gguf_tensor(file: &GgufFile, arch: Architecture, name: &str, shape: &[usize]) -> Result<String, ModelError> {
        let stored = gguf_name(name, arch).ok_or_else(|| ModelError::MissingTensor(name.to_string()))?;
        let info =
            file.tensors().get(&stored).ok_or_else(|| ModelError::MissingTensor(format!("{stored} ({name})")))?;
        if info.shape() != shape {
            return Err(ModelError::ShapeMismatch {
                name: name.to_string(),
                expected: shape.to_vec(),
                actual: info.shape().to_vec(),
            });
        }
        Ok(stored)
    }

    /// Marks the stored tensor `stored` read and reports progress.
    fn mark_used(&mut self, stored: String) {
        self.used.insert(stored);
        (self.progress)(self.used.len(), self.total);
    }
}

impl<B: Backend, F: FnMut(usize, usize)> WeightSource<B> for Source<'_, F> {
    fn load_host_quantized(
        &mut self,
        name: &str,
        shape: [usize; 2],
        format: QuantFormat,
        _device: &B::Device,
    ) -> Result<HostQuantized, ModelError> {
        match &self.checkpoint.format {
            Format::Hf { .. } => {
                let data = self.host_data(name, &shape, WeightKind::Matrix)?;
                let values = data
                    .convert::<f32>()
                    .into_vec::<f32>()
                    .map_err(|e| ModelError::Source(format!("{name}: {e:?}").into()))?;
                quantize(name, &values, shape, format)
            }
            Format::Gguf(file) => {
                let stored = Self::gguf_tensor(file, self.checkpoint.config.model_type, name, &shape)?;
                let q = file.quantized(&stored, format).map_err(|e| ModelError::Source(Box::new(e)))?;
                self.mark_used(stored);
                Ok(q)
            }
        }
    }

    fn load_blocks(&mut self, name: &str, shape: [usize; 2]) -> Result<Option<GgmlBlocks>, ModelError> {
        let Format::Gguf(file) = &self.checkpoint.format else { return Ok(None) };
        let stored = Self::gguf_tensor(file, self.checkpoint.config.model_type, name, &shape)?;
        let blocks = file.blocks(&stored).map_err(|e| ModelError::Source(Box::new(e)))?;
        if blocks.is_some() {
            self.mark_used(stored);
        }
        Ok(blocks)
    }

    fn load<const D: usize>(
        &mut self,
        name: &str,
        shape: [usize; D],
        kind: WeightKind,
        dtype: DType,
        device: &B::Device,
    ) -> Result<Tensor<B, D>, ModelError> {
        let data = self.host_data(name, &shape, kind)?;
        Ok(Tensor::from_data(data, (device, dtype)))
    }

    fn load_row_chunks(
        &mut self,
        name: &str,
        shape: [usize; 2],
        rows_per_chunk: usize,
        dtype: DType,
        device: &B::Device,
    ) -> Result<Vec<Tensor<B, 2>>, ModelError> {
        let data = self.host_data(name, &shape, WeightKind::Matrix)?;
        let row_bytes = shape[1] * data.dtype.size();
        let bytes = data.as_bytes();
        Ok(row_chunks(shape[0], rows_per_chunk)
            .map(|rows| {
                let block = bytes[rows.start * row_bytes..rows.end * row_bytes].to_vec();
                Tensor::from_data(
                    TensorData::from_bytes_vec(block, [rows.len(), shape[1]], data.dtype),
                    (device, dtype),
                )
            })
            .collect())
    }
}

fn meta<'a>(file: &'a GgufFile, key: &str) -> Option<&'a Value> {
    file.get(key)
}

fn config_from_gguf(file: &GgufFile) -> Result<GemmaConfig, ModelError> {
    let arch_name = meta(file, "general.architecture").and_then(Value::as_str).unwrap_or("");
    let arch = Architecture::from_name(arch_name)?;
    let key = |k: &str| format!("{arch_name}.{k}");
    let uint = |k: &'static str| -> Result<Option<usize>, ModelError> {
        match meta(file, &key(k)) {
            None => Ok(None),
            Some(v) => v.as_u64().and_then(|n| usize::try_from(n).ok()).map(Some).ok_or_else(|| {
                ModelError::InvalidConfig { field: k, reason: format!("must be an unsigned integer, found {v:?}") }
            }),
        }
    };
    let required = |k: &'static str| {
        uint(k)?.ok_or(ModelError::InvalidConfig { field: k, reason: "is missing from the GGUF metadata".into() })
    };
    let float = |k: &str| meta(file, &key(k)).and_then(Value::as_f64);

    // Per-layer values (Gemma 4 writes some keys as one entry per layer): the first entry, and
    // the entries themselves.
    let per_layer = |k: &'static str| -> Result<Option<Vec<usize>>, ModelError> {
        match meta(file, &key(k)) {
            None => Ok(None),
            Some(Value::Array(items)) => items
                .iter()
                .map(|v| v.as_u64().and_then(|n| usize::try_from(n).ok()))
                .collect::<Option<Vec<_>>>()
                .filter(|v| !v.is_empty())
                .map(Some)
                .ok_or(ModelError::InvalidConfig { field: k, reason: "must be unsigned integers".into() }),
            Some(v) => v.as_u64().and_then(|n| usize::try_from(n).ok()).map(|n| Some(vec![n])).ok_or_else(|| {
                ModelError::InvalidConfig { field: k, reason: format!("must be an unsigned integer, found {v:?}") }
            }),
        }
    };
    if arch == Architecture::Gemma4 {
        return gemma4_config_from_gguf(file, arch_name, &per_layer);
    }
    let hidden_size = required("embedding_length")?;
    let num_attention_heads = required("attention.head_count")?;
    let num_hidden_layers = required("block_count")?;
    let head_dim = match uint("attention.key_length")? {
        Some(d) => d,
        None => hidden_size / num_attention_heads.max(1),
    };
    let vocab_size = match meta(file, "tokenizer.ggml.tokens").and_then(Value::as_array) {
        Some(tokens) => tokens.len(),
        None => file.tensors().get("token_embd.weight").and_then(|t| t.shape().first().copied()).unwrap_or(0),
    };
    // GGUF does not store query_pre_attn_scalar; llama.cpp uses hidden_size / heads for the 27B
    // models (Gemma 2: 46 layers, Gemma 3: 62 layers) and head_dim otherwise.
    let is_27b = matches!((arch, num_hidden_layers), (Architecture::Gemma2, 46) | (Architecture::Gemma3, 62));
    let query_pre_attn_scalar =
        if is_27b { (hidden_size / num_attention_heads.max(1)) as f64 } else { head_dim as f64 };
    let pattern = match arch {
        Architecture::Gemma => None,
        Architecture::Gemma2 => Some(2),
        Architecture::Gemma3 | Architecture::Gemma4 => Some(uint("attention.sliding_window_pattern")?.unwrap_or(6)),
    };
    let theta = float("rope.freq_base").unwrap_or(10_000.0);
    let scaling = meta(file, &key("rope.scaling.type")).and_then(Value::as_str);
    let factor = match scaling {
        None | Some("none") => 1.0,
        Some("linear") => float("rope.scaling.factor").unwrap_or(1.0),
        Some(other) => {
            return Err(ModelError::UnsupportedConfig { field: "rope.scaling.type", value: other.to_string() })
        }
    };
    let rope_full_attention = RopeConfig { rope_theta: theta, factor, partial_rotary_factor: 1.0 };
    let rope_sliding_attention = match arch {
        // llama.cpp uses a fixed local base of 10000 for Gemma 3's sliding layers.
        Architecture::Gemma3 => RopeConfig { rope_theta: 10_000.0, factor: 1.0, partial_rotary_factor: 1.0 },
        _ => rope_full_attention,
    };
    let token = |k: &'static str, default: u32| token_id(file, k, default);
    let num_key_value_heads = uint("attention.head_count_kv")?.unwrap_or(num_attention_heads);
    let config = GemmaConfig {
        model_type: arch,
        vocab_size,
        hidden_size,
        intermediate_size: required("feed_forward_length")?,
        num_hidden_layers,
        num_attention_heads,
        num_key_value_heads,
        head_dim,
        rms_norm_eps: float("attention.layer_norm_rms_epsilon").unwrap_or(1e-6),
        max_position_embeddings: uint("context_length")?.unwrap_or(8192),
        query_pre_attn_scalar,
        attn_logit_softcapping: float("attn_logit_softcapping"),
        final_logit_softcapping: float("final_logit_softcapping"),
        sliding_window: if arch == Architecture::Gemma { None } else { uint("attention.sliding_window")? },
        layer_types: default_layer_types(num_hidden_layers, pattern)?,
        rope_full_attention,
        rope_sliding_attention,
        bos_token_id: token("tokenizer.ggml.bos_token_id", 2)?,
        eos_token_id: vec![token("tokenizer.ggml.eos_token_id", 1)?],
        global_head_dim: head_dim,
        num_global_key_value_heads: num_key_value_heads,
        attention_k_eq_v: false,
        num_kv_shared_layers: 0,
        use_double_wide_mlp: false,
        hidden_size_per_layer_input: 0,
        vocab_size_per_layer_input: 0,
        moe: None,
    };
    config.validate()?;
    Ok(config)
}

/// A Gemma 4 config from llama.cpp's `gemma4` metadata: head sizes `key_length` (full layers)
/// and `key_length_swa`, KV heads and MLP widths per layer, the sliding pattern as one flag per
/// layer, `shared_kv_layers`, `embedding_length_per_layer_input`, the expert counts; the share
/// of rotating pairs from the `rope_freqs` tensor (1 for a rotating pair, 1e30 for one left as
/// it is), and the full layers' values-from-keys from the missing `attn_v` tensors.
fn gemma4_config_from_gguf(
    file: &GgufFile,
    arch_name: &str,
    per_layer: &dyn Fn(&'static str) -> Result<Option<Vec<usize>>, ModelError>,
) -> Result<GemmaConfig, ModelError> {
    let key = |k: &str| format!("{arch_name}.{k}");
    let float = |k: &str| meta(file, &key(k)).and_then(Value::as_f64);
    let missing =
        |field: &'static str| ModelError::InvalidConfig { field, reason: "is missing from the GGUF metadata".into() };
    let first = |field: &'static str| -> Result<usize, ModelError> {
        per_layer(field)?.and_then(|v| v.first().copied()).ok_or_else(|| missing(field))
    };
    let hidden_size = first("embedding_length")?;
    let num_attention_heads = first("attention.head_count")?;
    let num_hidden_layers = first("block_count")?;
    let global_head_dim = first("attention.key_length")?;
    let head_dim = per_layer("attention.key_length_swa")?.and_then(|v| v.first().copied()).unwrap_or(global_head_dim);
    let field = "attention.sliding_window_pattern";
    let layer_types: Vec<LayerType> = match meta(file, &key(field)) {
        Some(Value::Array(flags)) => flags
            .iter()
            .map(|f| match f {
                Value::Bool(true) => Ok(LayerType::SlidingAttention),
                Value::Bool(false) => Ok(LayerType::FullAttention),
                other => Err(ModelError::InvalidConfig { field, reason: format!("has a non-boolean entry {other:?}") }),
            })
            .collect::<Result<_, _>>()?,
        _ => return Err(missing(field)),
    };
    let kv_heads = per_layer("attention.head_count_kv")?.unwrap_or_else(|| vec![num_attention_heads]);
    let kv_of = |kind: LayerType| {
        let at = layer_types.iter().position(|t| *t == kind);
        at.and_then(|i| kv_heads.get(i)).or(kv_heads.first()).copied().unwrap_or(num_attention_heads)
    };
    let widths = per_layer("feed_forward_length")?.ok_or_else(|| missing("feed_forward_length"))?;
    let intermediate_size = *widths.first().ok_or_else(|| missing("feed_forward_length"))?;
    let shared = meta(file, &key("attention.shared_kv_layers")).and_then(Value::as_u64).unwrap_or(0) as usize;
    let use_double_wide_mlp = widths.last().is_some_and(|&w| w == 2 * intermediate_size) && widths.len() > 1;
    let per_layer_width =
        meta(file, &key("embedding_length_per_layer_input")).and_then(Value::as_u64).unwrap_or(0) as usize;
    let vocab_size = match meta(file, "tokenizer.ggml.tokens").and_then(Value::as_array) {
        Some(tokens) => tokens.len(),
        None => file.tensors().get("token_embd.weight").and_then(|t| t.shape().first().copied()).unwrap_or(0),
    };
    let vocab_size_per_layer_input =
        file.tensors().get("per_layer_token_embd.weight").and_then(|t| t.shape().first().copied()).unwrap_or(0);
    // Full layers with keys of their own but no `attn_v`: their values are the keys.
    let first_shared = num_hidden_layers.saturating_sub(shared);
    let attention_k_eq_v = layer_types.iter().take(first_shared).enumerate().any(|(i, t)| {
        *t == LayerType::FullAttention
            && file.tensors().contains_key(&format!("blk.{i}.attn_k.weight"))
            && !file.tensors().contains_key(&format!("blk.{i}.attn_v.weight"))
    });
    let partial_rotary_factor = match file.tensors().get("rope_freqs.weight") {
        Some(_) => {
            let factors = file.dequantize("rope_freqs.weight").map_err(|e| ModelError::Source(Box::new(e)))?;
            let rotated = factors.iter().filter(|f| **f < 1e10).count();
            2.0 * rotated as f64 / global_head_dim.max(1) as f64
        }
        None => 1.0,
    };
    let moe = match meta(file, &key("expert_count")).and_then(Value::as_u64) {
        Some(experts) if experts > 0 => Some(MoeConfig {
            num_experts: experts as usize,
            top_k_experts: meta(file, &key("expert_used_count"))
                .and_then(Value::as_u64)
                .ok_or_else(|| missing("expert_used_count"))? as usize,
            moe_intermediate_size: first("expert_feed_forward_length")?,
        }),
        _ => None,
    };
    let token = |k: &'static str, default: u32| token_id(file, k, default);
    let config = GemmaConfig {
        model_type: Architecture::Gemma4,
        vocab_size,
        hidden_size,
        intermediate_size,
        num_hidden_layers,
        num_attention_heads,
        num_key_value_heads: kv_of(LayerType::SlidingAttention),
        head_dim,
        global_head_dim,
        num_global_key_value_heads: kv_of(LayerType::FullAttention),
        rms_norm_eps: float("attention.layer_norm_rms_epsilon").unwrap_or(1e-6),
        max_position_embeddings: first("context_length").unwrap_or(131_072),
        query_pre_attn_scalar: 1.0,
        attn_logit_softcapping: None,
        final_logit_softcapping: float("final_logit_softcapping"),
        sliding_window: Some(first("attention.sliding_window")?),
        layer_types,
        rope_full_attention: RopeConfig {
            rope_theta: float("rope.freq_base").unwrap_or(1_000_000.0),
            factor: 1.0,
            partial_rotary_factor,
        },
        rope_sliding_attention: RopeConfig {
            rope_theta: float("rope.freq_base_swa").unwrap_or(10_000.0),
            factor: 1.0,
            partial_rotary_factor: 1.0,
        },
        bos_token_id: token("tokenizer.ggml.bos_token_id", 2)?,
        eos_token_id: vec![token("tokenizer.ggml.eos_token_id", 1)?],
        attention_k_eq_v,
        num_kv_shared_layers: shared,
        use_double_wide_mlp,
        hidden_size_per_layer_input: per_layer_width,
        vocab_size_per_layer_input,
        moe,
    };
    config.validate()?;
    Ok(config)
}

/// A token id of the GGUF metadata (`default` where the key is absent); ids past `u32` are
/// refused rather than truncated (the config's validation checks them against the vocabulary).
fn token_id(file: &GgufFile, key: &'static str, default: u32) -> Result<u32, ModelError> {
    match meta(file, key).map(|v| (v, v.as_u64())) {
        None => Ok(default),
        Some((_, Some(id))) => u32::try_from(id)
            .map_err(|_| ModelError::InvalidConfig { field: key, reason: format!("is {id}, past any token id") }),
        Some((v, None)) => {
            Err(ModelError::InvalidConfig { field: key, reason: format!("must be an unsigned integer, found {v:?}") })
        }
    }
}

fn tokenizer_from_gguf(file: &GgufFile) -> Result<Tokenizer, Error> {
    let missing = TokenizerError::MissingMetadata;
    let model = meta(file, "tokenizer.ggml.model").and_then(Value::as_str).unwrap_or("");
    if model == "gemma4" {
        return Err(TokenizerError::UnsupportedModel {
            model: model.into(),
            hint: "Gemma 4's BPE tokenizer is not built from GGUF metadata yet: load the model's HF directory \
                   (its tokenizer.json) to generate text",
        }
        .into());
    }
    if model != "llama" {
        return Err(TokenizerError::UnsupportedModel {
            model: model.into(),
            hint: "only SentencePiece vocabularies (`llama`) are built from GGUF metadata",
        }
        .into());
    }
    let tokens = meta(file, "tokenizer.ggml.tokens")
        .and_then(Value::as_array)
        .and_then(|a| a.iter().map(|v| v.as_str().map(str::to_string)).collect::<Option<Vec<_>>>())
        .ok_or_else(|| missing("tokenizer.ggml.tokens"))?;
    let scores = meta(file, "tokenizer.ggml.scores")
        .and_then(Value::as_array)
        .and_then(|a| a.iter().map(|v| v.as_f64().map(|f| f as f32)).collect::<Option<Vec<_>>>())
        .ok_or_else(|| missing("tokenizer.ggml.scores"))?;
    let types = meta(file, "tokenizer.ggml.token_type")
        .and_then(Value::as_array)
        .and_then(|a| {
            a.iter()
                .map(|v| match v {
                    Value::I32(t) => Some(*t),
                    other => other.as_u64().map(|t| t as i32),
                })
                .collect::<Option<Vec<_>>>()
        })
        .ok_or_else(|| missing("tokenizer.ggml.token_type"))?;
    let vocab = tokens.len();
    let bos = match meta(file, "tokenizer.ggml.bos_token_id").and_then(Value::as_u64) {
        None => 2,
        Some(id) => u32::try_from(id).ok().filter(|&id| (id as usize) < vocab).ok_or(TokenizerError::TokenId {
            key: "tokenizer.ggml.bos_token_id",
            value: id,
            vocab,
        })?,
    };
    Tokenizer::from_vocab(tokens, scores, types, bos)
}
