//! Gemma 1, 2, 3 and 4, from the small parts to the whole model (HF's `modeling_gemma3.py` and
//! `modeling_gemma4.py`).
//!
//! The residual stream is kept in f32 whatever the weight dtype ([`ResidualStream`]): Gemma
//! activations overflow f16. Matrix products run in the weight dtype.

use crate::{
    attention::{Attention, LayerCache},
    moe::MoeBlock,
    norm::{ResidualStream, RmsNorm},
    per_layer::{PerLayerEmbeddings, PerLayerInput},
    projection::{load_matrix, upload, BlockRequest, Projection, WeightSettings},
    rope::RotaryEmbeddings,
    weights::{host_values, row_chunks, WeightFormat, WeightKind, WeightSource},
    Architecture, GemmaConfig, KvCache, ModelError,
};
use burn::{
    module::Module,
    tensor::{DType, Int, Tensor},
};
use burn_gemma_kernels::{
    gelu::{self, PAIR_BLOCK},
    Draws, Epilogue, GateUpLayout, GemmaBackend, GgmlBlocks, HostMatrix, HostQuantized, KvFormat, Matrix, QuantFormat,
    RopeTables, SamplingParams, StepPosition,
};

/// The gate and up projections of an MLP (they read the same input).
#[derive(Module, Debug)]
#[allow(clippy::large_enum_variant)] // One per layer, held for the model's life: no boxing.
pub enum GateUp<B: GemmaBackend> {
    /// One matrix holding the gate and up rows interleaved in blocks of [`PAIR_BLOCK`]: the
    /// product and the GELU run as one operation ([`Epilogue::GeluPairs`]), which on GPUs is
    /// one GEMV launch per decode step instead of two.
    Interleaved(Matrix<B>),
    /// Side by side (`[batch, seq, 2 * intermediate]`, joined into one matrix where stored
    /// alike), then the GELU: where the two are stored differently or the width does not split
    /// into pair blocks.
    SideBySide(Projection<B>),
}

impl<B: GemmaBackend> GateUp<B> {
    /// Interleaves `gate` and `up` (`[intermediate, hidden]` each) where both are stored alike
    /// and `intermediate` splits into pair blocks, else keeps them side by side.
    /// `name` names the pair in errors.
    fn new(
        gate: HostMatrix<B>,
        up: HostMatrix<B>,
        intermediate: usize,
        name: &str,
        device: &B::Device,
    ) -> Result<Self, ModelError> {
        let fits = gelu::pairs_fit(intermediate);
        let interleaved = |joined| upload(joined, name, device).map(Self::Interleaved);
        match (gate, up) {
            (HostMatrix::Quantized(gate), HostMatrix::Quantized(up)) if fits => {
                match HostQuantized::interleave_pairs(gate, up, PAIR_BLOCK) {
                    Ok(joined) => interleaved(HostMatrix::Quantized(joined)),
                    Err((gate, up)) => {
                        Self::side_by_side(HostMatrix::Quantized(gate), HostMatrix::Quantized(up), name, device)
                    }
                }
            }
            (HostMatrix::Ggml(gate), HostMatrix::Ggml(up)) if fits => {
                match GgmlBlocks::interleave_pairs(gate, up, PAIR_BLOCK) {
                    Ok(joined) => interleaved(HostMatrix::Ggml(joined)),
                    Err((gate, up)) => Self::side_by_side(HostMatrix::Ggml(gate), HostMatrix::Ggml(up), name, device),
                }
            }
            (HostMatrix::Dense(gate), HostMatrix::Dense(up)) if fits && gate.dtype() == up.dtype() => {
                interleaved(HostMatrix::Dense(gelu::interleave_pairs(gate, up)))
            }
            (gate, up) => Self::side_by_side(gate, up, name, device),
        }
    }

    fn side_by_side(
        gate: HostMatrix<B>,
        up: HostMatrix<B>,
        name: &str,
        device: &B::Device,
    ) -> Result<Self, ModelError> {
        Projection::joined(vec![gate, up], name, device).map(Self::SideBySide)
    }

    /// `[batch, seq, hidden]` -> `gelu_tanh(gate(x)) * up(x)`, `[batch, seq, intermediate]`.
    pub fn forward(&self, x: Tensor<B, 3>) -> Tensor<B, 3> {
        match self {
            Self::Interleaved(w) => {
                let [batch, seq, hidden] = x.dims();
                let out = B::project(x.reshape([batch * seq, hidden]), w, Epilogue::GeluPairs);
                let width = out.dims()[1];
                out.reshape([batch, seq, width])
            }
            Self::SideBySide(projection) => B::gelu_mul(projection.forward(x), GateUpLayout::Halves),
        }
    }

    /// Bytes on the device.
    pub fn device_bytes(&self) -> usize {
        match self {
            Self::Interleaved(w) => w.device_bytes(),
            Self::SideBySide(projection) => projection.device_bytes(),
        }
    }
}

/// Gated MLP: `down(gelu_tanh(gate(x)) * up(x))`.
#[derive(Module, Debug)]
pub struct Mlp<B: GemmaBackend> {
    /// `gate_proj` and `up_proj`.
    pub gate_up: GateUp<B>,
    pub down_proj: Projection<B>,
}

impl<B: GemmaBackend> Mlp<B> {
    /// The MLP of layer `index` (Gemma 4's KV-sharing layers may be twice as wide).
    fn load(
        source: &mut impl WeightSource<B>,
        prefix: &str,
        index: usize,
        c: &GemmaConfig,
        settings: WeightSettings,
        device: &B::Device,
    ) -> Result<Self, ModelError> {
        let (hidden, inter) = (c.hidden_size, c.intermediate_size_of(index));
        let gate = load_matrix(source, &format!("{prefix}.gate_proj.weight"), [inter, hidden], settings, device)?;
        let up = load_matrix(source, &format!("{prefix}.up_proj.weight"), [inter, hidden], settings, device)?;
        let down = load_matrix(source, &format!("{prefix}.down_proj.weight"), [hidden, inter], settings, device)?;
        Self::from_matrices(gate, up, down, inter, prefix, device)
    }

    /// The MLP of matrices already read: `gate` and `up` `[intermediate, hidden]`, `down`
    /// `[hidden, intermediate]`; `prefix` names them in errors.
    pub(crate) fn from_matrices(
        gate: HostMatrix<B>,
        up: HostMatrix<B>,
        down: HostMatrix<B>,
        intermediate: usize,
        prefix: &str,
        device: &B::Device,
    ) -> Result<Self, ModelError> {
        Ok(Self {
            gate_up: GateUp::new(gate, up, intermediate, &format!("{prefix}.gate_proj | up_proj"), device)?,
            down_proj: Projection::joined(vec![down], &format!("{prefix}.down_proj"), device)?,
        })
    }

    /// `[batch, seq, hidden]` -> `[batch, seq, hidden]`.
    pub fn forward(&self, x: Tensor<B, 3>) -> Tensor<B, 3> {
        self.down_proj.forward(self.gate_up.forward(x))
    }

    /// Bytes on the device.
    pub fn device_bytes(&self) -> usize {
        self.gate_up.device_bytes() + self.down_proj.device_bytes()
    }
}

/// One decoder layer. Gemma 1 has a norm before attention and one before the MLP; Gemma 2, 3
/// and 4 also normalize the outputs of both. Gemma 4 may add a routed expert block beside the
/// MLP, a per-layer input after it, and scales the layer's output.
#[derive(Module, Debug)]
pub struct DecoderLayer<B: GemmaBackend> {
    pub self_attn: Attention<B>,
    pub mlp: Mlp<B>,
    pub input_layernorm: RmsNorm<B>,
    pub post_attention_layernorm: Option<RmsNorm<B>>,
    pub pre_feedforward_layernorm: RmsNorm<B>,
    pub post_feedforward_layernorm: Option<RmsNorm<B>>,
    /// Gemma 4 26B-A4B.
    pub moe: Option<MoeBlock<B>>,
    /// Gemma 4 E models.
    pub per_layer_input: Option<PerLayerInput<B>>,
    /// Gemma 4's `layer_scalar` (1 before), read once at load: it multiplies the residual in
    /// the kernel of the next add.
    #[module(skip)]
    pub layer_scalar: f64,
}

impl<B: GemmaBackend> DecoderLayer<B> {
    fn load(
        source: &mut impl WeightSource<B>,
        index: usize,
        c: &GemmaConfig,
        settings: WeightSettings,
        device: &B::Device,
    ) -> Result<Self, ModelError> {
        let prefix = format!("model.layers.{index}");
        let scale = c.model_type.norm_scale();
        let norm = |source: &mut _, name: &str| {
            RmsNorm::load(source, &format!("{prefix}.{name}"), c.hidden_size, c.rms_norm_eps, scale, device)
        };
        let self_attn = Attention::load(source, &format!("{prefix}.self_attn"), index, c, settings, device)?;
        let mlp = Mlp::load(source, &format!("{prefix}.mlp"), index, c, settings, device)?;
        let input_layernorm = norm(source, "input_layernorm")?;
        if !c.model_type.has_sandwich_norms() {
            // Gemma 1 calls its pre-MLP norm `post_attention_layernorm`.
            return Ok(Self {
                self_attn,
                mlp,
                input_layernorm,
                post_attention_layernorm: None,
                pre_feedforward_layernorm: norm(source, "post_attention_layernorm")?,
                post_feedforward_layernorm: None,
                moe: None,
                per_layer_input: None,
                layer_scalar: 1.0,
            });
        }
        let post_attention_layernorm = Some(norm(source, "post_attention_layernorm")?);
        let pre_feedforward_layernorm = norm(source, "pre_feedforward_layernorm")?;
        let post_feedforward_layernorm = Some(norm(source, "post_feedforward_layernorm")?);
        let moe = match c.moe {
            Some(moe) => Some(MoeBlock::load(source, &prefix, c, moe, settings, device)?),
            None => None,
        };
        let per_layer_input = PerLayerInput::load(source, &prefix, c, settings, device)?;
        let layer_scalar = if c.model_type == Architecture::Gemma4 {
            let name = format!("{prefix}.layer_scalar");
            let t: Tensor<B, 1> = source.load(&name, [1], WeightKind::Scale, DType::F32, device)?;
            match host_values(t, &name)?.first().copied() {
                Some(v) if v.is_finite() => v as f64,
                other => return Err(ModelError::Source(format!("{name} is not a finite number: {other:?}").into())),
            }
        } else {
            1.0
        };
        Ok(Self {
            self_attn,
            mlp,
            input_layernorm,
            post_attention_layernorm,
            pre_feedforward_layernorm,
            post_feedforward_layernorm,
            moe,
            per_layer_input,
            layer_scalar,
        })
    }

    /// The block at `position` (HF's `Gemma3DecoderLayer.forward`); each `residual + h` is
    /// added by the next norm, in one kernel ([`ResidualStream`]).
    /// `per_layer_input`: the per-layer inputs (`[batch, seq, layers, width]`) and this layer's
    /// index among them (Gemma 4 E models).
    fn forward<'a>(
        &'a self,
        stream: ResidualStream<'a, B>,
        rope: &RopeTables<B>,
        cache: &mut LayerCache<B>,
        position: &StepPosition<B>,
        per_layer_input: Option<(Tensor<B, 4>, usize)>,
    ) -> Result<ResidualStream<'a, B>, ModelError> {
        let (stream, h) = stream.norm(&self.input_layernorm);
        let h = self.self_attn.forward(h, rope, cache, position);
        let stream = stream.add(h, self.post_attention_layernorm.as_ref());
        let (stream, h) = stream.norm(&self.pre_feedforward_layernorm);
        let h = self.mlp.forward(h);
        let (stream, h) = match &self.moe {
            Some(moe) => {
                let (stream, residual) = stream.residual();
                (stream, moe.forward(residual, h)?)
            }
            None => (stream, h),
        };
        let mut stream = stream.add(h, self.post_feedforward_layernorm.as_ref());
        if let (Some(block), Some((inputs, layer))) = (&self.per_layer_input, per_layer_input) {
            // The gate reads the residual itself (f32), which the pending add writes.
            let (settled, residual) = stream.settled(&block.post_per_layer_input_norm);
            let h = block.forward(residual, inputs, layer);
            stream = settled.add(h, Some(&block.post_per_layer_input_norm));
        }
        Ok(stream.scaled(self.layer_scalar))
    }
}

/// The embedding scale `sqrt(width)`, rounded to the activation dtype as the reference
/// implementation does.
pub(crate) fn embed_scale(width: usize, dtype: DType) -> f64 {
    let scale = (width as f64).sqrt();
    match dtype {
        DType::BF16 => half::bf16::from_f64(scale).to_f64(),
        DType::F16 => half::f16::from_f64(scale).to_f64(),
        _ => scale as f32 as f64,
    }
}

/// The `[vocab, hidden]` embedding table, also the tied lm_head, in row blocks of at most
/// [`ReservedMemory::max_buffer_bytes`] (GPU APIs cap the size of one buffer); quantized at least to Q8 (the
/// table feeds both ends of the model), or dense.
#[derive(Module, Debug)]
pub struct Embedding<B: GemmaBackend> {
    pub blocks: Vec<Matrix<B>>,
}

impl<B: GemmaBackend> Embedding<B> {
    const NAME: &'static str = "model.embed_tokens.weight";

    fn load(
        source: &mut impl WeightSource<B>,
        c: &GemmaConfig,
        settings: WeightSettings,
        device: &B::Device,
    ) -> Result<Self, ModelError> {
        Self::load_table(source, Self::NAME, [c.vocab_size, c.hidden_size], settings, device)
    }

    /// The `[rows, cols]` table `name` in row blocks, quantized at least to Q8 where `settings`
    /// asks for blocks.
    pub(crate) fn load_table(
        source: &mut impl WeightSource<B>,
        name: &str,
        shape: [usize; 2],
        settings: WeightSettings,
        device: &B::Device,
    ) -> Result<Self, ModelError> {
        let requantize = |blocks: GgmlBlocks| {
            blocks.to_format(QuantFormat::Q8).map_err(|source| ModelError::Quantize { name: name.to_string(), source })
        };
        let host: Option<HostMatrix<B>> = match settings.table_blocks(shape[1]) {
            None => None,
            Some(BlockRequest::Format(format)) => {
                Some(HostMatrix::Quantized(source.load_host_quantized(name, shape, format, device)?))
            }
            Some(BlockRequest::Native) => match source.load_blocks(name, shape)? {
                None => None,
                // 4 bits are not enough for a table that feeds both ends of the model: Q8.
                Some(blocks) if blocks.closest_format() == QuantFormat::Q4 => {
                    Some(HostMatrix::Quantized(requantize(blocks)?))
                }
                Some(blocks) => Some(HostMatrix::Ggml(blocks)),
            },
        };
        let max_bytes = B::max_buffer_bytes(device);
        let rows_per_chunk = |row_bytes: usize| (max_bytes / row_bytes.max(1)).max(1);
        let blocks = match host {
            Some(HostMatrix::Quantized(host)) => row_chunks(host.rows, rows_per_chunk(host.cols))
                .map(|r| upload(HostMatrix::Quantized(host.rows_slice(r)), name, device))
                .collect::<Result<_, _>>()?,
            Some(HostMatrix::Ggml(host)) => {
                let [rows, _] = host.shape();
                row_chunks(rows, rows_per_chunk(host.bytes().len() / rows.max(1)))
                    .map(|r| upload(HostMatrix::Ggml(host.rows_slice(r)), name, device))
                    .collect::<Result<_, _>>()?
            }
            Some(HostMatrix::Dense(_)) | None => {
                let rows_per_chunk = rows_per_chunk(shape[1] * settings.dtype.size());
                let blocks = source.load_row_chunks(name, shape, rows_per_chunk, settings.dtype, device)?;
                blocks.into_iter().map(|b| upload(HostMatrix::Dense(b), name, device)).collect::<Result<_, _>>()?
            }
        };
        Ok(Self { blocks })
    }

    /// `table[ids] * scale` in `dtype`: `[batch, seq]` -> `[batch, seq, hidden]`.
    pub(crate) fn embed(&self, ids: Tensor<B, 2, Int>, scale: f64, dtype: DType) -> Tensor<B, 3> {
        B::embed(&self.blocks, ids, scale, dtype)
    }

    /// `hidden [n, hidden] @ table^T -> [n, vocab]`, one product per row block.
    fn project(&self, hidden: Tensor<B, 2>) -> Tensor<B, 2> {
        let mut blocks: Vec<Tensor<B, 2>> =
            self.blocks.iter().map(|t| B::project(hidden.clone(), t, Epilogue::Identity)).collect();
        if blocks.len() == 1 {
            blocks.pop().unwrap_or(hidden)
        } else {
            burn_gemma_kernels::graph::unsupported(|| "an lm_head of several table blocks joined by Burn".into());
            Tensor::cat(blocks, 1)
        }
    }

    /// Bytes on the device.
    pub fn device_bytes(&self) -> usize {
        self.blocks.iter().map(Matrix::device_bytes).sum()
    }
}

/// The per-token values of a decode step, in device buffers (see [`Gemma::decode_step`]): a
/// replayed step reads them there after the host rewrote them.
#[derive(Debug, Clone)]
pub struct StepInputs<B: GemmaBackend> {
    /// `[1]` (int): the position of the step.
    pub position: Tensor<B, 1, Int>,
    /// `[batch, 1]` (int): each sequence's token at that position.
    pub ids: Tensor<B, 2, Int>,
    /// `[batch]` (f32): the uniform draw each sequence samples with (greedy reads none).
    pub draws: Tensor<B, 1>,
    /// The largest position the step serves: attention grids are sized for it.
    pub bound: usize,
}

impl<B: GemmaBackend> StepInputs<B> {
    /// Zeroed buffers for `batch` sequences, serving positions up to `bound`.
    pub fn zeros(batch: usize, bound: usize, device: &B::Device) -> Self {
        Self {
            position: Tensor::zeros([1], device),
            ids: Tensor::zeros([batch, 1], device),
            draws: Tensor::zeros([batch], (device, DType::F32)),
            bound,
        }
    }
}

/// A Gemma causal language model with tied embeddings.
#[derive(Module, Debug)]
pub struct Gemma<B: GemmaBackend> {
    pub embed_tokens: Embedding<B>,
    /// Gemma 4 E models' per-layer embeddings.
    pub per_layer: Option<PerLayerEmbeddings<B>>,
    pub layers: Vec<DecoderLayer<B>>,
    pub norm: RmsNorm<B>,
    /// The rotary embedding of each layer type (HF's `rotary_emb` and `rotary_emb_local`).
    #[module(skip)]
    pub rotary_emb: RotaryEmbeddings,
    #[module(skip)]
    pub config: GemmaConfig,
    #[module(skip)]
    pub dtype: DType,
    /// How [`Gemma::new_cache`] stores keys and values (dense in `dtype` after loading).
    #[module(skip)]
    pub kv_cache: KvFormat,
}

impl<B: GemmaBackend> Gemma<B> {
    /// Builds the model from a weight source with dense weights in `dtype` (weights and matrix
    /// products).
    pub fn load(
        config: GemmaConfig,
        source: &mut (impl WeightSource<B> + Send),
        dtype: DType,
        device: &B::Device,
    ) -> Result<Self, ModelError> {
        Self::load_as(config, source, dtype, WeightFormat::Dense, device)
    }

    /// Builds the model with its matrices in `format` (see [`WeightFormat`]); activations and
    /// dense weights in `dtype`.
    ///
    /// The weights are allocated in the backend's persistent memory (one buffer each, see
    /// `Backend::memory_persistent_allocations`), so the pools that serve the activations of
    /// every step hold only short-lived buffers: CubeCL searches a pool's slices on every
    /// allocation, and weights kept among them made that search the largest host cost of a
    /// decode step. What loading allocated and no longer uses is released afterwards.
    pub fn load_as(
        config: GemmaConfig,
        source: &mut (impl WeightSource<B> + Send),
        dtype: DType,
        format: WeightFormat,
        device: &B::Device,
    ) -> Result<Self, ModelError> {
        config.validate()?;
        if !matches!(dtype, DType::F32 | DType::F16 | DType::BF16) || !B::supports_dtype(device, dtype) {
            return Err(ModelError::BackendDtype { backend: B::name(device), dtype });
        }
        let settings = WeightSettings { dtype, format };
        let model = B::memory_persistent_allocations(device, source, |source| {
            let embed_tokens = Embedding::load(source, &config, settings, device)?;
            let per_layer = PerLayerEmbeddings::load(source, &config, settings, device)?;
            let layers = (0..config.num_hidden_layers)
                .map(|i| DecoderLayer::load(source, i, &config, settings, device))
                .collect::<Result<Vec<_>, _>>()?;
            let scale = config.model_type.norm_scale();
            let norm = RmsNorm::load(source, "model.norm", config.hidden_size, config.rms_norm_eps, scale, device)?;
            Ok(Self {
                embed_tokens,
                per_layer,
                layers,
                norm,
                rotary_emb: RotaryEmbeddings::new(&config),
                config: config.clone(),
                dtype,
                kv_cache: KvFormat::Dense(dtype),
            })
        });
        B::memory_cleanup(device);
        model
    }

    /// Random weights (see [`crate::RandomWeights`]) in the exact shapes of `config`.
    pub fn random(config: GemmaConfig, seed: u64, dtype: DType, device: &B::Device) -> Result<Self, ModelError> {
        Self::load(config, &mut crate::RandomWeights::new(seed), dtype, device)
    }

    /// Bytes the weights occupy on the device.
    pub fn weight_bytes(&self) -> usize {
        let layers: usize = self
            .layers
            .iter()
            .map(|l| {
                let a = &l.self_attn;
                a.qkv_proj.device_bytes()
                    + a.o_proj.device_bytes()
                    + l.mlp.device_bytes()
                    + l.moe.as_ref().map_or(0, MoeBlock::device_bytes)
                    + l.per_layer_input.as_ref().map_or(0, PerLayerInput::device_bytes)
            })
            .sum();
        self.embed_tokens.device_bytes() + self.per_layer.as_ref().map_or(0, PerLayerEmbeddings::device_bytes) + layers
    }

    /// A KV cache for `batch` sequences of up to `capacity` positions.
    pub fn new_cache(&self, batch: usize, capacity: usize) -> Result<KvCache<B>, ModelError> {
        KvCache::new(&self.config, batch, capacity, self.kv_cache, &self.device())
    }

    /// Final hidden states (after the last norm), `[batch, seq, hidden]` in the model dtype.
    fn hidden_states(&self, ids: Tensor<B, 2, Int>, cache: &mut KvCache<B>) -> Result<Tensor<B, 3>, ModelError> {
        let [batch, seq] = ids.dims();
        if seq == 0 {
            return Err(ModelError::InvalidInput("empty token sequence".into()));
        }
        if batch != cache.batch() {
            return Err(ModelError::InvalidInput(format!(
                "batch of {batch} sequences for a KV cache of {}",
                cache.batch()
            )));
        }
        self.check_cache(cache)?;
        cache.check_room(seq)?;
        let position = cache.len();
        let hidden = self.layers_forward(ids, cache, &StepPosition::Host(position))?;
        cache.advance(seq);
        Ok(hidden)
    }

    /// Embedding, every layer and the final norm over `ids` at `position` (the cache's length
    /// is left to the caller).
    fn layers_forward(
        &self,
        ids: Tensor<B, 2, Int>,
        cache: &mut KvCache<B>,
        position: &StepPosition<B>,
    ) -> Result<Tensor<B, 3>, ModelError> {
        let rope = self.rotary_emb.tables::<B>(cache.capacity(), &self.device());
        let embedded =
            self.embed_tokens.embed(ids.clone(), embed_scale(self.config.hidden_size, self.dtype), self.dtype);
        let per_layer = self.per_layer.as_ref().map(|p| p.inputs(ids, embedded.clone(), self.dtype));
        let mut stream = ResidualStream::new(embedded, self.dtype);
        for (i, layer) in self.layers.iter().enumerate() {
            let input = per_layer.as_ref().map(|inputs| (inputs.clone(), i));
            let rope = rope.get(layer.self_attn.settings.layer_type);
            stream = layer.forward(stream, rope, cache.layer_mut(i), position, input)?;
        }
        let (_, hidden) = stream.norm(&self.norm);
        Ok(hidden)
    }

    /// Fails unless `cache` was made for this model's layers.
    fn check_cache(&self, cache: &KvCache<B>) -> Result<(), ModelError> {
        if cache.num_layers() != self.layers.len() {
            return Err(ModelError::InvalidInput(format!(
                "a KV cache of {} layers for a model of {}",
                cache.num_layers(),
                self.layers.len()
            )));
        }
        Ok(())
    }

    /// One decode step whose per-token values are read on the device (see [`StepInputs`]):
    /// embedding of `inputs.ids`, every layer at `inputs.position` (appending to `cache`), the
    /// final norm, the lm_head, the final softcap, and sampling with `inputs.draws`. Every
    /// operation is one of the backend's [`GemmaBackend`] kernels, so on CUDA the step can be
    /// recorded once and replayed as one graph for every position up to `inputs.bound`.
    ///
    /// Returns the sampled ids `[batch]` and the logits `[batch, vocab]` in the activation
    /// dtype (capped where the config has a final softcap). The cache's length is not
    /// advanced: the caller knows the position.
    pub fn decode_step(
        &self,
        inputs: &StepInputs<B>,
        cache: &mut KvCache<B>,
        sampling: &SamplingParams,
    ) -> Result<(Tensor<B, 1, Int>, Tensor<B, 2>), ModelError> {
        let [batch, seq] = inputs.ids.dims();
        if seq != 1 || batch != cache.batch() {
            return Err(ModelError::InvalidInput(format!(
                "a decode step takes one token per sequence of the cache's batch ({}), got [{batch}, {seq}]",
                cache.batch()
            )));
        }
        if inputs.bound >= cache.capacity() {
            return Err(ModelError::ContextOverflow { needed: inputs.bound + 1, capacity: cache.capacity() });
        }
        self.check_cache(cache)?;
        let position = StepPosition::Device { values: inputs.position.clone(), bound: inputs.bound };
        let hidden = self.layers_forward(inputs.ids.clone(), cache, &position)?;
        let logits = self.embed_tokens.project(hidden.reshape([batch, self.config.hidden_size]));
        let logits = match self.config.final_logit_softcapping {
            Some(cap) => B::softcap(logits, cap),
            None => logits,
        };
        let ids = B::sample(logits.clone(), sampling, Draws::Device(inputs.draws.clone()))?;
        Ok((ids, logits))
    }

    /// Logits (f32) of hidden states `[batch, seq, hidden]` -> `[batch, seq, vocab]`.
    fn lm_head(&self, hidden: Tensor<B, 3>) -> Tensor<B, 3> {
        let [batch, seq, h] = hidden.dims();
        let hidden = hidden.reshape([batch * seq, h]);
        let logits = self.embed_tokens.project(hidden).cast(DType::F32).reshape([batch, seq, self.config.vocab_size]);
        match self.config.final_logit_softcapping {
            Some(cap) => B::softcap(logits, cap),
            None => logits,
        }
    }

    /// Runs `ids` (`[batch, seq]`) after the positions already in `cache` and returns the logits
    /// of every position, `[batch, seq, vocab]` (f32).
    pub fn forward(&self, ids: Tensor<B, 2, Int>, cache: &mut KvCache<B>) -> Result<Tensor<B, 3>, ModelError> {
        let hidden = self.hidden_states(ids, cache)?;
        Ok(self.lm_head(hidden))
    }

    /// Like [`Gemma::forward`] but returns only the last position's logits, `[batch, vocab]`.
    pub fn forward_last(&self, ids: Tensor<B, 2, Int>, cache: &mut KvCache<B>) -> Result<Tensor<B, 2>, ModelError> {
        let hidden = self.hidden_states(ids, cache)?;
        let [batch, seq, h] = hidden.dims();
        let last = hidden.slice([0..batch, seq - 1..seq, 0..h]);
        Ok(self.lm_head(last).reshape([batch, self.config.vocab_size]))
    }

    /// The device the weights live on.
    pub fn device(&self) -> B::Device {
        self.norm.weight.val().device()
    }

    /// The architecture this model was built for.
    pub fn architecture(&self) -> Architecture {
        self.config.model_type
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::NdArray;
    use burn::tensor::TensorData;

    type B = NdArray<f32>;

    fn values(n: usize, seed: u64) -> Vec<f32> {
        let mut s = seed;
        (0..n)
            .map(|_| {
                s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                ((s >> 33) as f32 / (1u64 << 31) as f32 - 0.5) * 0.4
            })
            .collect()
    }

    /// Every layout of the gate/up pair gives `gelu(x gate^T) * (x up^T)` of the weights as
    /// stored; interleaved exactly where both are stored alike and the width splits into pair
    /// blocks.
    #[test]
    fn gate_up_layouts_match_the_separate_products() {
        let device = Default::default();
        let hidden = 64;
        // (intermediate, gate quantized, up quantized, interleaved)
        for (inter, gate_q, up_q, interleaved) in
            [(12, false, false, true), (12, true, true, true), (12, true, false, false), (10, false, false, false)]
        {
            let load = |seed: u64, quantized: bool| {
                let w = values(inter * hidden, seed);
                if quantized {
                    let host = HostQuantized::quantize(&w, inter, hidden, QuantFormat::Q8).expect("quantize");
                    (host.dequantize(), HostMatrix::Quantized(host))
                } else {
                    (
                        w.clone(),
                        HostMatrix::Dense(Tensor::<B, 2>::from_data(TensorData::new(w, [inter, hidden]), &device)),
                    )
                }
            };
            let ((gate, gate_loaded), (up, up_loaded)) = (load(1, gate_q), load(2, up_q));
            let layer = GateUp::new(gate_loaded, up_loaded, inter, "test", &device).expect("uploads");
            assert_eq!(
                matches!(layer, GateUp::Interleaved(_)),
                interleaved,
                "intermediate {inter}, quantized {gate_q}/{up_q}"
            );

            let x = Tensor::<B, 3>::from_data(TensorData::new(values(3 * hidden, 3), [1, 3, hidden]), &device);
            let matrix = |w: Vec<f32>| {
                Tensor::<B, 2>::from_data(TensorData::new(w, [inter, hidden]), &device).transpose().unsqueeze::<3>()
            };
            let expected = gelu::reference(x.clone().matmul(matrix(gate)), x.clone().matmul(matrix(up)));
            let got = layer.forward(x);
            assert_eq!(got.dims(), [1, 3, inter]);
            got.into_data().assert_approx_eq::<f32>(&expected.into_data(), burn::tensor::Tolerance::absolute(1e-5));
        }
    }
}
