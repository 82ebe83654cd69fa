//! Opening checkpoints: a Hugging Face directory (`config.json` + safetensors, single or
//! sharded) or a GGUF file, as a [`WeightSource`] for the model and a [`Tokenizer`].

use crate::{
    error::TokenizerError,
    floats::{self, Float},
    gguf::{GgufFile, Value},
    load_options::{LoadParts, ProgressFn},
    safetensors::{Dtype, SafetensorsFile},
    Error, LoadOptions, LoadProgress, Tokenizer, Vision,
};
use burn::tensor::{backend::Backend, DType, Tensor, TensorData};
use burn_gemma_kernels::{GemmaBackend, GgmlBlocks, HostQuantized, KernelTuning, QuantFormat};
use burn_gemma_model::{
    assistant::config::ASSISTANT_MODEL_TYPES,
    config::NormScale,
    weights::{matrix_dims, quantize, row_chunks, WeightKind},
    Architecture, AssistantConfig, Gemma, Gemma3Vision, Gemma3VisionConfig, Gemma4Assistant, Gemma4ImageConfig,
    Gemma4Vision, GemmaConfig, ModelError, ModelOptions, TensorParallel, WeightSource,
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
    /// A multimodal Gemma 3 checkpoint's vision tower and projector.
    vision: Option<Gemma3VisionConfig>,
    /// A multimodal Gemma 4 checkpoint's vision tower and embedder.
    gemma4_vision: Option<Gemma4ImageConfig>,
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

/// What `Checkpoint::open` says of a Gemma 4 assistant.
const ASSISTANT_AS_MODEL: &str = "this is a Gemma 4 assistant, a drafter for a Gemma 4 model: open it with \
     AssistantCheckpoint (the CLI's --draft assistant:PATH)";

/// llama.cpp's architecture name of Gemma 4 assistants.
const ASSISTANT_GGUF_ARCH: &str = "gemma4-assistant";

fn gguf_architecture(file: &GgufFile) -> &str {
    meta(file, "general.architecture").and_then(Value::as_str).unwrap_or("")
}

/// `config.json` of an HF directory: its path and text.
fn read_config(dir: &Path) -> Result<(PathBuf, String), Error> {
    let config_path = dir.join("config.json");
    let text =
        std::fs::read_to_string(&config_path).map_err(|source| Error::Io { path: config_path.clone(), source })?;
    Ok((config_path, text))
}

/// Whether a `config.json` describes a Gemma 4 assistant.
fn is_assistant_config(text: &str) -> bool {
    let value = serde_json::from_str::<serde_json::Value>(text).ok();
    let model_type = value.as_ref().and_then(|v| v.get("model_type")).and_then(|t| t.as_str());
    model_type.is_some_and(|t| ASSISTANT_MODEL_TYPES.contains(&t))
}

/// The safetensors of an HF directory (`model.safetensors`, or the shards its index names).
fn open_hf_weights(dir: &Path) -> Result<Format, Error> {
    let index_path = dir.join("model.safetensors.index.json");
    let shard_names: Vec<String> = if index_path.exists() {
        let text =
            std::fs::read_to_string(&index_path).map_err(|source| Error::Io { path: index_path.clone(), source })?;
        let index: serde_json::Value = serde_json::from_str(&text)
            .map_err(|e| Error::NotAModel { path: index_path.clone(), reason: format!("index is not JSON: {e}") })?;
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
            return Err(Error::NotAModel { path: dir.to_path_buf(), reason: format!("missing weights file {name}") });
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
    Ok(Format::Hf { shards, index })
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
        let (config_path, text) = read_config(&dir)?;
        if is_assistant_config(&text) {
            return Err(Error::NotAModel { path: dir, reason: ASSISTANT_AS_MODEL.into() });
        }
        let config = GemmaConfig::from_hf_json(&text)
            .map_err(|e| Error::Config { path: config_path.clone(), source: Box::new(e) })?;
        let config_error = |e: ModelError| Error::Config { path: config_path.clone(), source: Box::new(e) };
        let (vision, gemma4_vision) = match config.model_type {
            Architecture::Gemma4 => {
                (None, Gemma4ImageConfig::from_hf_json(&text, config.hidden_size).map_err(config_error)?)
            }
            _ => (Gemma3VisionConfig::from_hf_json(&text, config.hidden_size).map_err(config_error)?, None),
        };
        Ok(Self { format: open_hf_weights(&dir)?, path: dir, config, vision, gemma4_vision })
    }

    fn open_gguf(path: PathBuf) -> Result<Self, Error> {
        let file =
            GgufFile::open(&path).map_err(|source| Error::Gguf { path: path.clone(), source: Box::new(source) })?;
        if gguf_architecture(&file) == ASSISTANT_GGUF_ARCH {
            return Err(Error::NotAModel { path, reason: ASSISTANT_AS_MODEL.into() });
        }
        let config = crate::gguf_config::config_from_gguf(&file)
            .map_err(|e| Error::Config { path: path.clone(), source: Box::new(e) })?;
        Ok(Self { path, format: Format::Gguf(Box::new(file)), config, vision: None, gemma4_vision: None })
    }

    /// The vision config of a multimodal checkpoint (Gemma 3's SigLIP tower and projector), or
    /// `None` for a text model.
    pub fn vision_config(&self) -> Option<&Gemma3VisionConfig> {
        self.vision.as_ref()
    }

    /// Loads the vision tower and projector of a multimodal checkpoint (device, dtype and weight
    /// format from `options`: use the text model's). Fails for a checkpoint without them.
    pub fn load_vision<B: GemmaBackend>(&self, options: LoadOptions<B>) -> Result<Gemma3Vision<B>, Error> {
        let Some(config) = self.vision.clone() else {
            let reason = if self.gemma4_vision.is_some() {
                "this Gemma 4 checkpoint's vision tower loads with `load_gemma4_vision` (or `load_vision_tower`, \
                 either generation's)"
            } else {
                "this checkpoint has no vision tower (a multimodal Gemma 3 config.json has a vision_config)"
            };
            return Err(Error::NotAModel { path: self.path.clone(), reason: reason.into() });
        };
        let total = vision_tensors(&config);
        let (mut source, options, device, _tuning) =
            Source::open(&self.format, self.config.model_type, total, options)?;
        Ok(Gemma3Vision::load(config, &mut source, &options, &device)?)
    }

    /// The vision config of a multimodal Gemma 4 checkpoint (its vision tower and embedder), or
    /// `None` for a text model.
    pub fn gemma4_vision_config(&self) -> Option<&Gemma4ImageConfig> {
        self.gemma4_vision.as_ref()
    }

    /// Loads the vision tower and embedder of a multimodal Gemma 4 checkpoint (device, dtype and
    /// weight format from `options`, as [`Checkpoint::load`]): [`Gemma4Vision::image_features`]
    /// gives an image's soft tokens in the text model's width.
    pub fn load_gemma4_vision<B: GemmaBackend>(&self, options: LoadOptions<B>) -> Result<Gemma4Vision<B>, Error> {
        let Some(config) = self.gemma4_vision.clone() else {
            return Err(Error::NotAModel {
                path: self.path.clone(),
                reason: "this checkpoint has no Gemma 4 vision tower (a multimodal Gemma 4 config.json has a \
                         vision_config)"
                    .into(),
            });
        };
        let total = gemma4_vision_tensors(&config);
        let (mut source, options, device, _tuning) =
            Source::open(&self.format, self.config.model_type, total, options)?;
        Ok(Gemma4Vision::load(config, &mut source, &options, &device)?)
    }

    /// Whether the checkpoint has a vision tower (Gemma 3's or Gemma 4's).
    pub fn has_vision(&self) -> bool {
        self.vision.is_some() || self.gemma4_vision.is_some()
    }

    /// Loads the checkpoint's image reader, whichever generation it is ([`Checkpoint::load_vision`]
    /// or [`Checkpoint::load_gemma4_vision`]), for [`crate::Generator::set_vision`]. Fails for a
    /// checkpoint without one.
    pub fn load_vision_tower<B: GemmaBackend>(&self, options: LoadOptions<B>) -> Result<Vision<B>, Error> {
        match self.gemma4_vision.is_some() {
            true => Ok(self.load_gemma4_vision(options)?.into()),
            false => Ok(self.load_vision(options)?.into()),
        }
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
        self.load_part(options, None)
    }

    /// Loads one shard of the model split over several devices (see
    /// [`burn_gemma_model::tensor_parallel`] and [`crate::tensor_parallel::ShardedModel`], which
    /// loads every shard on its own thread): `options` name the shard's device.
    pub fn load_shard<B: GemmaBackend>(
        &self,
        options: LoadOptions<B>,
        parallel: TensorParallel<B>,
    ) -> Result<Loaded<B>, Error> {
        self.load_part(options, Some(parallel))
    }

    fn load_part<B: GemmaBackend>(
        &self,
        options: LoadOptions<B>,
        parallel: Option<TensorParallel<B>>,
    ) -> Result<Loaded<B>, Error> {
        // A shard reads the table a second time for its slice of the lm_head.
        let tensors = self.tensors_to_load() + usize::from(parallel.is_some());
        let (mut source, options, device, tuning) =
            Source::open(&self.format, self.config.model_type, tensors, options)?;
        let mut model = match parallel {
            None => Gemma::load(self.config.clone(), &mut source, &options, &device)?,
            Some(parallel) => Gemma::load_shard(self.config.clone(), &mut source, &options, &device, parallel)?,
        };
        model.set_tuning(tuning);
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

/// An opened Gemma 4 assistant (an HF `gemma4_assistant` directory or llama.cpp's
/// `gemma4-assistant` GGUF), validated but not yet loaded: the drafter of
/// [`crate::speculative::Drafter::Assistant`].
pub struct AssistantCheckpoint {
    path: PathBuf,
    format: Format,
    config: AssistantConfig,
}

impl AssistantCheckpoint {
    /// Opens an assistant's GGUF file or HF directory and validates its config.
    pub fn open(path: impl AsRef<Path>) -> Result<Self, Error> {
        let path = path.as_ref().to_path_buf();
        let meta = std::fs::metadata(&path).map_err(|source| Error::Io { path: path.clone(), source })?;
        let not_assistant = |path: PathBuf| Error::NotAModel {
            path,
            reason: "not a Gemma 4 assistant (an HF gemma4_assistant checkpoint or a gemma4-assistant GGUF)".into(),
        };
        if meta.is_dir() {
            let (config_path, text) = read_config(&path)?;
            if !is_assistant_config(&text) {
                return Err(not_assistant(path));
            }
            let config = AssistantConfig::from_hf_json(&text)
                .map_err(|e| Error::Config { path: config_path, source: Box::new(e) })?;
            Ok(Self { format: open_hf_weights(&path)?, path, config })
        } else {
            let file =
                GgufFile::open(&path).map_err(|source| Error::Gguf { path: path.clone(), source: Box::new(source) })?;
            if gguf_architecture(&file) != ASSISTANT_GGUF_ARCH {
                return Err(not_assistant(path));
            }
            let config = crate::gguf_config::assistant_config_from_gguf(&file)
                .map_err(|e| Error::Config { path: path.clone(), source: Box::new(e) })?;
            Ok(Self { path, format: Format::Gguf(Box::new(file)), config })
        }
    }

    /// The checkpoint's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The validated config.
    pub fn config(&self) -> &AssistantConfig {
        &self.config
    }

    /// Loads the assistant as `options` say (device, dtype, weight format, progress; it has no
    /// KV cache of its own: it reads its target's). Use the target's dtype.
    pub fn load<B: GemmaBackend>(&self, options: LoadOptions<B>) -> Result<Gemma4Assistant<B>, Error> {
        let c = &self.config;
        // Per layer: q, o, q_norm, gate, up, down, four norms, the scalar; the table, the final
        // norm, the two projections, the masked lm_head's centroids and ordering.
        let masked = if c.ordered_embeddings.is_some() { 2 } else { 0 };
        let total = 11 * c.text.num_hidden_layers + 4 + masked;
        let (mut source, options, device, _tuning) = Source::open(&self.format, Architecture::Gemma4, total, options)?;
        Ok(Gemma4Assistant::load(c.clone(), &mut source, &options, &device)?)
    }
}

/// An opened llama.cpp vision projector GGUF (`mmproj`): Gemma 3's SigLIP tower and projector
/// (projector `gemma3`) or Gemma 4's tower and embedder (`gemma4v`), which go beside a text GGUF
/// of the same model.
pub struct MmprojCheckpoint {
    path: PathBuf,
    format: Format,
    config: MmprojConfig,
}

/// What a projector GGUF holds.
#[derive(Debug, Clone, PartialEq)]
pub enum MmprojConfig {
    /// Gemma 3's SigLIP tower and projector (`gemma3`).
    Gemma3(Gemma3VisionConfig),
    /// Gemma 4's vision tower and embedder (`gemma4v`).
    Gemma4(Gemma4ImageConfig),
}

impl MmprojCheckpoint {
    /// Opens and validates a projector GGUF; `tokenizer` is the text model's, whose image
    /// tokens mark images in prompts (Gemma 3: `<start_of_image>`, `<end_of_image>`,
    /// `<image_soft_token>`; Gemma 4: `<|image>`, `<image|>`, `<|image|>`).
    pub fn open(path: impl AsRef<Path>, tokenizer: &Tokenizer) -> Result<Self, Error> {
        let path = path.as_ref().to_path_buf();
        let file =
            GgufFile::open(&path).map_err(|source| Error::Gguf { path: path.clone(), source: Box::new(source) })?;
        if gguf_architecture(&file) != "clip" {
            return Err(Error::NotAModel {
                path,
                reason: "not a vision projector GGUF (general.architecture \"clip\", llama.cpp's mmproj files)".into(),
            });
        }
        let id = |piece: &str| {
            tokenizer.token_id(piece).ok_or_else(|| Error::NotAModel {
                path: path.clone(),
                reason: format!("the text model's tokenizer has no {piece} token to mark images with"),
            })
        };
        let config = match crate::gguf_config::projector_type(&file) {
            "gemma4v" => {
                let ids = (id("<|image>")?, id("<image|>")?, id("<|image|>")?);
                crate::gguf_config::gemma4_vision_config_from_gguf(&file, ids).map(MmprojConfig::Gemma4)
            }
            _ => {
                let ids = (id("<start_of_image>")?, id("<end_of_image>")?, id("<image_soft_token>")?);
                crate::gguf_config::gemma3_vision_config_from_gguf(&file, ids).map(MmprojConfig::Gemma3)
            }
        };
        let config = config.map_err(|e| Error::Config { path: path.clone(), source: Box::new(e) })?;
        Ok(Self { path, format: Format::Gguf(Box::new(file)), config })
    }

    /// The checkpoint's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The validated config.
    pub fn config(&self) -> &MmprojConfig {
        &self.config
    }

    /// Loads the tower (device, dtype and weight format from `options`: use the text model's);
    /// a Gemma 4 tower with HF's default budget of soft tokens a picture.
    pub fn load<B: GemmaBackend>(&self, options: LoadOptions<B>) -> Result<Vision<B>, Error> {
        match &self.config {
            MmprojConfig::Gemma3(config) => {
                let total = vision_tensors(config);
                let (mut source, options, device, _tuning) =
                    Source::open(&self.format, Architecture::Gemma3, total, options)?;
                Ok(Gemma3Vision::load(config.clone(), &mut source, &options, &device)?.into())
            }
            MmprojConfig::Gemma4(config) => {
                let total = gemma4_vision_tensors(config);
                let (mut source, options, device, _tuning) =
                    Source::open(&self.format, Architecture::Gemma4, total, options)?;
                Ok(Gemma4Vision::load(config.clone(), &mut source, &options, &device)?.into())
            }
        }
    }
}

/// Tensors a Gemma 4 vision tower and embedder load: per layer seven projections (with four
/// bounds each where clipped) and six norms; the patch projection and position table, the
/// standardization's two vectors, the embedder's projection.
fn gemma4_vision_tensors(config: &Gemma4ImageConfig) -> usize {
    let v = &config.vision;
    let linears = if v.use_clipped_linears { 7 * 5 } else { 7 };
    (linears + 6) * v.num_hidden_layers + 3 + if v.standardize { 2 } else { 0 }
}

/// Tensors a Gemma 3 vision tower and projector load: per layer two norms and four projections
/// of two tensors each; the patch and position embeddings, the final norm; the projector's two.
fn vision_tensors(config: &Gemma3VisionConfig) -> usize {
    16 * config.vision.num_hidden_layers + 7
}

/// The tensors of one checkpoint as a [`WeightSource`]: the stored names read so far, progress
/// reported to the load's callback after each.
struct Source<'a> {
    format: &'a Format,
    arch: Architecture,
    used: HashSet<String>,
    progress: Option<ProgressFn>,
    /// Tensors the load will read, for the progress reports.
    total: usize,
}

impl<'a> Source<'a> {
    /// A source over `format` for a load of `total` tensors with `options`, and the options'
    /// model settings and device, the dtype checked on the device: what every loader starts with.
    fn open<B: GemmaBackend>(
        format: &'a Format,
        arch: Architecture,
        total: usize,
        options: LoadOptions<B>,
    ) -> Result<(Self, ModelOptions, B::Device, KernelTuning), Error> {
        let LoadParts { options, device, tuning, progress } = options.into_parts();
        crate::backends::check_dtype::<B>(&device, options.dtype)?;
        Ok((Self { format, arch, used: HashSet::new(), progress, total }, options, device, tuning))
    }

    /// Reports the tensors read so far.
    fn report(&mut self) {
        let (loaded, total) = (self.used.len(), self.total);
        if let Some(progress) = self.progress.as_mut() {
            progress(LoadProgress { loaded, total });
        }
    }
}

/// HF names of multimodal checkpoints put the text model under another prefix.
/// A vision tower's weights go by transformers 5.x's names (`model.vision_tower.*`,
/// `model.multi_modal_projector.*`); checkpoints saved by 4.x (most of those published) keep
/// them at the top level, the tower under `vision_tower.vision_model`.
fn hf_candidates(name: &str) -> Vec<String> {
    let rest = name.strip_prefix("model.").unwrap_or(name);
    if let Some(tower) = rest.strip_prefix("vision_tower.") {
        return vec![name.to_string(), format!("vision_tower.vision_model.{tower}")];
    }
    if rest.starts_with("multi_modal_projector.") {
        return vec![name.to_string(), rest.to_string()];
    }
    vec![name.to_string(), format!("model.language_model.{rest}"), format!("language_model.{name}")]
}

/// llama.cpp's projector-GGUF name (`mmproj`) of a Gemma 3 vision weight (`model.vision_tower.*`
/// without its prefix).
fn mmproj_name(tower: &str) -> Option<String> {
    let fixed = match tower {
        "embeddings.patch_embedding.weight" => "v.patch_embd.weight",
        "embeddings.patch_embedding.bias" => "v.patch_embd.bias",
        "embeddings.position_embedding.weight" => "v.position_embd.weight",
        "post_layernorm.weight" => "v.post_ln.weight",
        "post_layernorm.bias" => "v.post_ln.bias",
        _ => {
            return mmproj_layer_name(tower, |part| match part {
                "layer_norm1" => Some("ln1"),
                "layer_norm2" => Some("ln2"),
                "self_attn.q_proj" => Some("attn_q"),
                "self_attn.k_proj" => Some("attn_k"),
                "self_attn.v_proj" => Some("attn_v"),
                "self_attn.out_proj" => Some("attn_out"),
                "mlp.fc1" => Some("ffn_up"),
                "mlp.fc2" => Some("ffn_down"),
                _ => None,
            })
        }
    };
    Some(fixed.into())
}

/// llama.cpp's projector-GGUF name (`mmproj`, projector `gemma4v`) of a Gemma 4 vision weight
/// (`model.vision_tower.*` without its prefix), as its converter (`Gemma4VisionAudioModel`)
/// names them: the encoder under `v.blk.{i}`, the clipped linears' weights without `.linear`
/// and their bounds beside them.
fn gemma4_mmproj_name(tower: &str) -> Option<String> {
    let fixed = match tower {
        "patch_embedder.input_proj.weight" => "v.patch_embd.weight",
        "patch_embedder.position_embedding_table" => "v.position_embd.weight",
        "std_bias" => "v.std_bias",
        "std_scale" => "v.std_scale",
        _ => {
            return mmproj_layer_name(tower, |part| match part.strip_suffix(".linear").unwrap_or(part) {
                "input_layernorm" => Some("ln1"),
                "post_attention_layernorm" => Some("attn_post_norm"),
                "pre_feedforward_layernorm" => Some("ln2"),
                "post_feedforward_layernorm" => Some("ffn_post_norm"),
                "self_attn.q_proj" => Some("attn_q"),
                "self_attn.k_proj" => Some("attn_k"),
                "self_attn.v_proj" => Some("attn_v"),
                "self_attn.o_proj" => Some("attn_out"),
                "self_attn.q_norm" => Some("attn_q_norm"),
                "self_attn.k_norm" => Some("attn_k_norm"),
                "mlp.gate_proj" => Some("ffn_gate"),
                "mlp.up_proj" => Some("ffn_up"),
                "mlp.down_proj" => Some("ffn_down"),
                _ => None,
            })
        }
    };
    Some(fixed.into())
}

/// `v.blk.{layer}.{part}.{suffix}` of an encoder weight `encoder.layers.{layer}.{hf}.{suffix}`
/// (`part` names HF's part as llama.cpp does; `None`: not a tower weight).
fn mmproj_layer_name(tower: &str, part: impl Fn(&str) -> Option<&'static str>) -> Option<String> {
    let (layer, rest) = tower.strip_prefix("encoder.layers.")?.split_once('.')?;
    let (hf, suffix) = rest.rsplit_once('.')?;
    Some(format!("v.blk.{layer}.{}.{suffix}", part(hf)?))
}

/// Whether the HF tensor `name` of architecture `arch` is stored in a GGUF in another layout:
/// llama.cpp's converter stores Gemma 4's patch projection `[hidden, p * p * 3]` (each patch's
/// values row by row, RGB interleaved) as a convolution kernel `[hidden, 3, p, p]`.
fn gguf_conv_patches(name: &str, arch: Architecture) -> bool {
    arch == Architecture::Gemma4 && name == "model.vision_tower.patch_embedder.input_proj.weight"
}

/// `[n, 3, p, p]` values (a convolution kernel, channel first) as `[n, p, p, 3]` (channel last).
fn channels_last(values: &[f32], n: usize, p: usize) -> Vec<f32> {
    let mut out = vec![0.0; values.len()];
    for (i, row) in values.chunks_exact(3 * p * p).take(n).enumerate() {
        for c in 0..3 {
            for y in 0..p {
                for x in 0..p {
                    out[i * 3 * p * p + (y * p + x) * 3 + c] = row[(c * p + y) * p + x];
                }
            }
        }
    }
    out
}

/// GGUF tensor name of an HF weight name.
fn gguf_name(name: &str, arch: Architecture) -> Option<String> {
    if let Some(tower) = name.strip_prefix("model.vision_tower.") {
        return match arch {
            Architecture::Gemma4 => gemma4_mmproj_name(tower),
            _ => mmproj_name(tower),
        };
    }
    match name {
        "model.embed_vision.embedding_projection.weight" => return Some("mm.input_projection.weight".into()),
        "model.multi_modal_projector.mm_input_projection_weight" => return Some("mm.input_projection.weight".into()),
        "model.multi_modal_projector.mm_soft_emb_norm.weight" => return Some("mm.soft_emb_norm.weight".into()),
        "model.embed_tokens.weight" => return Some("token_embd.weight".into()),
        "model.norm.weight" => return Some("output_norm.weight".into()),
        "model.embed_tokens_per_layer.weight" => return Some("per_layer_token_embd.weight".into()),
        "model.per_layer_model_projection.weight" => return Some("per_layer_model_proj.weight".into()),
        "model.per_layer_projection_norm.weight" => return Some("per_layer_proj_norm.weight".into()),
        // Gemma 4 assistants.
        "pre_projection.weight" => return Some("nextn.pre_projection.weight".into()),
        "post_projection.weight" => return Some("nextn.post_projection.weight".into()),
        "masked_embedding.centroids.weight" => return Some("masked_embd_centroids.weight".into()),
        "masked_embedding.token_ordering" => return Some("masked_embd_ordering".into()),
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

impl Source<'_> {
    /// The tensor `name` on the host in `dtype`, with HF conventions: float values converted on
    /// every core ([`crate::floats`]; other dtypes by Burn's conversion).
    fn host_data(
        &mut self,
        name: &str,
        shape: &[usize],
        kind: WeightKind,
        dtype: DType,
    ) -> Result<TensorData, ModelError> {
        let mismatch = |actual: &[usize]| ModelError::ShapeMismatch {
            name: name.to_string(),
            expected: shape.to_vec(),
            actual: actual.to_vec(),
        };
        let data = match self.format {
            Format::Hf { shards, index } => {
                let (stored, shard) = hf_candidates(name)
                    .into_iter()
                    .find_map(|n| index.get(&n).map(|&s| (n, s)))
                    .ok_or_else(|| ModelError::MissingTensor(name.to_string()))?;
                let file = &shards[shard];
                let info = file.tensors().get(&stored).ok_or_else(|| ModelError::MissingTensor(stored.clone()))?;
                // A scalar stored with no dimensions (HF buffers such as `torch.tensor(x)`) is
                // read as the one value it is.
                let scalar = info.shape().is_empty() && shape == [1];
                if info.shape() != shape && !scalar {
                    return Err(mismatch(info.shape()));
                }
                let stored_dtype = match (info.dtype(), kind) {
                    (Dtype::F32, _) => DType::F32,
                    (Dtype::F16, _) => DType::F16,
                    (Dtype::BF16, _) => DType::BF16,
                    (Dtype::I64, WeightKind::Indices) => DType::I64,
                    (Dtype::I32, WeightKind::Indices) => DType::I32,
                    (other, _) => {
                        return Err(ModelError::UnsupportedTensorDtype { name: stored, dtype: format!("{other:?}") })
                    }
                };
                let bytes = file.bytes(&stored).ok_or_else(|| ModelError::MissingTensor(stored.clone()))?.to_vec();
                self.used.insert(stored);
                let data = TensorData::from_bytes_vec(bytes, shape.to_vec(), stored_dtype);
                if kind == WeightKind::Indices {
                    // Ids as exact floats: refused past 2^24.
                    let ids = data
                        .convert::<i64>()
                        .into_vec::<i64>()
                        .map_err(|e| ModelError::Source(format!("{e:?}").into()))?;
                    if let Some(id) = ids.iter().find(|&&id| !(0..1 << 24).contains(&id)) {
                        return Err(ModelError::Source(format!("{name} holds {id}, not a token id").into()));
                    }
                    TensorData::new(ids.into_iter().map(|id| id as f32).collect::<Vec<_>>(), shape.to_vec())
                } else {
                    data
                }
            }
            Format::Gguf(file) if gguf_conv_patches(name, self.arch) => {
                // Read as the kernel it is stored as, its values put back in HF's order.
                let &[n, width] = shape else { return Err(mismatch(&[])) };
                let p = (1..=width).find(|p| 3 * p * p >= width).filter(|p| 3 * p * p == width);
                let p = p.ok_or_else(|| mismatch(shape))?;
                let stored = Self::gguf_tensor(file, self.arch, name, &[n, 3, p, p])?;
                let values = file.dequantize(&stored).map_err(|e| ModelError::Source(Box::new(e)))?;
                self.used.insert(stored);
                TensorData::new(channels_last(&values, n, p), shape.to_vec())
            }
            Format::Gguf(file) if kind == WeightKind::Norm(NormScale::OnePlusWeight) => {
                let stored = Self::gguf_tensor(file, self.arch, name, shape)?;
                let mut values = file.dequantize(&stored).map_err(|e| ModelError::Source(Box::new(e)))?;
                // llama.cpp's converter stores Gemma 1-3 norm weights as `1 + w` (Gemma 4's
                // scale by `w` and are stored as they are).
                values.iter_mut().for_each(|v| *v -= 1.0);
                self.used.insert(stored);
                TensorData::new(values, shape.to_vec())
            }
            Format::Gguf(file) => {
                let stored = Self::gguf_tensor(file, self.arch, name, shape)?;
                let data = match Float::of(dtype) {
                    Some(_) => file.tensor_data(&stored, dtype),
                    None => file.dequantize(&stored).map(|values| TensorData::new(values, shape.to_vec())),
                };
                let data = data.map_err(|e| ModelError::Source(Box::new(e)))?;
                self.used.insert(stored);
                data
            }
        };
        self.report();
        Ok(to_dtype(data, dtype))
    }
}

impl Source<'_> {
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
        self.report();
    }
}

impl<B: Backend> WeightSource<B> for Source<'_> {
    fn load_host_quantized(
        &mut self,
        name: &str,
        shape: &[usize],
        format: QuantFormat,
        _device: &B::Device,
    ) -> Result<HostQuantized, ModelError> {
        let dims = matrix_dims(shape)
            .ok_or_else(|| ModelError::InvalidInput(format!("`{name}`: shape {shape:?} is not a matrix")))?;
        match self.format {
            // The file's blocks requantized, where they run along HF's rows.
            Format::Gguf(file) if !gguf_conv_patches(name, self.arch) => {
                let stored = Self::gguf_tensor(file, self.arch, name, shape)?;
                let q = file.quantized(&stored, format).map_err(|e| ModelError::Source(Box::new(e)))?;
                self.mark_used(stored);
                Ok(q)
            }
            // HF's values (and the patch kernel put back in HF's order) quantized here.
            _ => {
                let data = self.host_data(name, shape, WeightKind::Matrix, DType::F32)?;
                let values = data.into_vec::<f32>().map_err(|e| ModelError::Source(format!("{name}: {e:?}").into()))?;
                quantize(name, &values, dims, format)
            }
        }
    }

    fn load_blocks(&mut self, name: &str, shape: &[usize]) -> Result<Option<GgmlBlocks>, ModelError> {
        let Format::Gguf(file) = self.format else { return Ok(None) };
        if gguf_conv_patches(name, self.arch) {
            // Its blocks run along the kernel's layout, not HF's rows: read as values.
            return Ok(None);
        }
        let stored = Self::gguf_tensor(file, self.arch, name, shape)?;
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
        let data = self.host_data(name, &shape, kind, dtype)?;
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
        let data = self.host_data(name, &shape, WeightKind::Matrix, dtype)?;
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

/// `data` in `dtype`: float to float on every core ([`crate::floats`]), else Burn's conversion.
fn to_dtype(data: TensorData, dtype: DType) -> TensorData {
    if data.dtype == dtype {
        return data;
    }
    match (Float::of(data.dtype), Float::of(dtype)) {
        (Some(from), Some(to)) => {
            let shape = data.shape.clone();
            TensorData::from_bytes_vec(floats::convert(data.as_bytes(), from, to), shape, dtype)
        }
        _ => data.convert_dtype(dtype),
    }
}

fn meta<'a>(file: &'a GgufFile, key: &str) -> Option<&'a Value> {
    file.get(key)
}

fn tokenizer_from_gguf(file: &GgufFile) -> Result<Tokenizer, Error> {
    let missing = TokenizerError::MissingMetadata;
    let model = meta(file, "tokenizer.ggml.model").and_then(Value::as_str).unwrap_or("");
    if model != "llama" && model != "gemma4" {
        return Err(TokenizerError::UnsupportedModel {
            model: model.into(),
            hint: "GGUF vocabularies are built for `llama` (SentencePiece, Gemma 1-3) and `gemma4` (BPE)",
        }
        .into());
    }
    let strings = |key: &'static str| {
        meta(file, key)
            .and_then(Value::as_array)
            .and_then(|a| a.iter().map(|v| v.as_str().map(str::to_string)).collect::<Option<Vec<_>>>())
            .ok_or_else(|| missing(key))
    };
    let tokens = strings("tokenizer.ggml.tokens")?;
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
    if model == "gemma4" {
        return Tokenizer::from_bpe_vocab(tokens, types, &strings("tokenizer.ggml.merges")?, bos);
    }
    let scores = meta(file, "tokenizer.ggml.scores")
        .and_then(Value::as_array)
        .and_then(|a| a.iter().map(|v| v.as_f64().map(|f| f as f32)).collect::<Option<Vec<_>>>())
        .ok_or_else(|| missing("tokenizer.ggml.scores"))?;
    Tokenizer::from_vocab(tokens, scores, types, bos)
}
