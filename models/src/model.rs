//! The whole Gemma model (HF's `Gemma3ForCausalLM` / `Gemma4ForCausalLM`): embedding, decoder
//! layers, final norm and tied lm_head, one config-driven definition for Gemma 1, 2, 3 and 4.
//!
//! The residual stream is kept in f32 whatever the weight dtype ([`ResidualStream`]): Gemma
//! activations overflow f16. Matrix products run in the weight dtype.

use crate::{
    attention::{cache::QueryRows, LayerKv},
    decoder_layer::DecoderLayer,
    embedding::{embed_scale, Embedding},
    moe::MoeBlock,
    norm::{ResidualStream, RmsNorm},
    per_layer::{PerLayerEmbeddings, PerLayerInput},
    projection::WeightSettings,
    rope::RotaryEmbeddings,
    tensor_parallel::{ShardLink, ShardedSource, TensorParallel},
    weights::{WeightFormat, WeightSource},
    Architecture, GemmaConfig, ImageAttention, KvCache, LayerType, ModelError,
};
use burn::{
    module::Module,
    tensor::{DType, Int, Tensor},
};
use burn_gemma_kernels::{Draws, GemmaBackend, KernelTuning, KvFormat, SamplingParams, StepPosition, StepRows};

/// The per-token values of a decode step, in device buffers (see [`Gemma::decode_step`]): a
/// replayed step reads them there after the host rewrote them.
#[derive(Debug, Clone)]
pub struct StepInputs<B: GemmaBackend> {
    /// `[1]` (int): the position of every sequence (of the first row, for consecutive rows);
    /// or `[batch]`: each sequence's own.
    pub position: Tensor<B, 1, Int>,
    /// `[batch, 1]` (int): each row's token at its position.
    pub ids: Tensor<B, 2, Int>,
    /// `[batch]` (f32): the uniform draw each row samples with (greedy reads none).
    pub draws: Tensor<B, 1>,
    /// The largest position of any row the step serves: attention grids are sized for it.
    pub bound: usize,
    /// Whether the rows are sequences of the cache, or consecutive positions of its first
    /// sequence (a verify step of speculative decoding, see [`StepRows`]).
    pub rows: StepRows,
}

impl<B: GemmaBackend> StepInputs<B> {
    /// Zeroed buffers for `batch` sequences at one position, serving positions up to `bound`.
    pub fn zeros(batch: usize, bound: usize, device: &B::Device) -> Self {
        Self {
            position: Tensor::zeros([1], device),
            ids: Tensor::zeros([batch, 1], device),
            draws: Tensor::zeros([batch], (device, DType::F32)),
            bound,
            rows: StepRows::Sequences,
        }
    }

    /// Zeroed buffers for `rows` consecutive positions of one sequence, every row's position
    /// at most `bound` (a recorded verify step writes them before each replay).
    pub fn zeros_consecutive(rows: usize, bound: usize, device: &B::Device) -> Self {
        Self { rows: StepRows::Consecutive, ..Self::zeros(rows, bound, device) }
    }

    /// `ids` at consecutive positions of the cache's first sequence from `position` (a verify
    /// step run eagerly); nothing is sampled on the device.
    pub fn consecutive(ids: &[u32], position: usize, device: &B::Device) -> Result<Self, ModelError> {
        if ids.is_empty() {
            return Err(ModelError::InvalidInput("a verify step over no tokens".into()));
        }
        let ints = |v: Vec<i64>, shape: Vec<usize>| burn::tensor::TensorData::new(v, shape);
        let rows = ids.len();
        Ok(Self {
            position: Tensor::from_data(ints(vec![position as i64], vec![1]), device),
            ids: Tensor::from_data(ints(ids.iter().map(|&t| i64::from(t)).collect(), vec![rows, 1]), device),
            draws: Tensor::zeros([rows], (device, DType::F32)),
            bound: position + rows - 1,
            rows: StepRows::Consecutive,
        })
    }

    /// Zeroed buffers for `batch` sequences at a position each, serving positions up to
    /// `bound` (a recorded batched step writes them before each replay).
    pub fn zeros_per_sequence(batch: usize, bound: usize, device: &B::Device) -> Self {
        Self { position: Tensor::zeros([batch], device), ..Self::zeros(batch, bound, device) }
    }

    /// Sequences stepping at positions of their own: `ids[b]` at `positions[b]` (many requests
    /// served at once). The bound is the largest position; nothing is sampled on the device.
    pub fn sequences(ids: &[u32], positions: &[usize], device: &B::Device) -> Result<Self, ModelError> {
        if ids.len() != positions.len() || ids.is_empty() {
            return Err(ModelError::InvalidInput(format!(
                "a decode step over {} tokens at {} positions",
                ids.len(),
                positions.len()
            )));
        }
        let batch = ids.len();
        let ints = |v: Vec<i64>, shape: Vec<usize>| burn::tensor::TensorData::new(v, shape);
        let ids = ints(ids.iter().map(|&t| i64::from(t)).collect(), vec![batch, 1]);
        let own = ints(positions.iter().map(|&p| p as i64).collect(), vec![batch]);
        Ok(Self {
            position: Tensor::from_data(own, device),
            ids: Tensor::from_data(ids, device),
            draws: Tensor::zeros([batch], (device, DType::F32)),
            bound: positions.iter().copied().max().unwrap_or(0),
            rows: StepRows::Sequences,
        })
    }
}

/// An image's embeddings in a chunk of input ids (Gemma 3): they replace the embeddings of the
/// chunk's rows `start..start + n` (the image's soft tokens), which attend to each other both
/// ways ([`Gemma::forward_hidden_with_images`]).
#[derive(Debug, Clone)]
pub struct ImageEmbeds<B: GemmaBackend> {
    /// The first row, within the chunk.
    pub start: usize,
    /// `[n, hidden]`: one row per soft token ([`crate::vision::Gemma3Vision::image_features`]).
    pub features: Tensor<B, 2>,
}

/// How a model sits on the device: the activation dtype, how the weight matrices are kept and
/// how the KV cache stores keys and values.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ModelOptions {
    /// Activations and dense weights: f32, f16 or bf16.
    pub dtype: DType,
    /// How weight matrices are kept (see [`WeightFormat`]).
    pub weights: WeightFormat,
    /// How [`Gemma::new_cache`] stores keys and values; `None`: dense in `dtype`.
    pub kv_cache: Option<KvFormat>,
}

impl Default for ModelOptions {
    /// f32 activations, the checkpoint's own weight format, a dense cache.
    fn default() -> Self {
        Self { dtype: DType::F32, weights: WeightFormat::Native, kv_cache: None }
    }
}

impl ModelOptions {
    /// Dense weights and cache in `dtype`.
    pub fn dense(dtype: DType) -> Self {
        Self { dtype, weights: WeightFormat::Dense, kv_cache: None }
    }
}

/// A Gemma causal language model with tied embeddings.
#[derive(Module, Debug)]
pub struct Gemma<B: GemmaBackend> {
    pub(crate) embed_tokens: Embedding<B>,
    /// Gemma 4 E models' per-layer embeddings.
    pub(crate) per_layer: Option<PerLayerEmbeddings<B>>,
    pub(crate) layers: Vec<DecoderLayer<B>>,
    pub(crate) norm: RmsNorm<B>,
    /// A tensor-parallel shard's lm_head: its slice of the vocabulary's rows of the table
    /// ([`crate::Shard::part`]); `None` where the whole table serves as the lm_head.
    pub(crate) head: Option<Embedding<B>>,
    /// The rotary embedding of each layer type (HF's `rotary_emb` and `rotary_emb_local`).
    #[module(skip)]
    pub(crate) rotary_emb: RotaryEmbeddings,
    #[module(skip)]
    pub(crate) config: GemmaConfig,
    #[module(skip)]
    pub(crate) dtype: DType,
    /// How [`Gemma::new_cache`] stores keys and values.
    #[module(skip)]
    pub(crate) kv_cache: KvFormat,
    /// The shard this model is of a model split over several devices ([`Gemma::load_shard`]).
    #[module(skip)]
    pub(crate) parallel: Option<ShardLink>,
    /// How its passes choose and launch kernels ([`Gemma::set_tuning`]).
    #[module(skip)]
    pub(crate) tuning: KernelTuning,
}

impl<B: GemmaBackend> Gemma<B> {
    /// Builds the model from a weight source as `options` say (see [`ModelOptions`]).
    ///
    /// The weights are allocated in the backend's persistent memory (one buffer each, see
    /// `Backend::memory_persistent_allocations`), so the pools that serve the activations of
    /// every step hold only short-lived buffers: CubeCL searches a pool's slices on every
    /// allocation, and weights kept among them made that search the largest host cost of a
    /// decode step. What loading allocated and no longer uses is released afterwards.
    pub fn load(
        config: GemmaConfig,
        source: &mut (impl WeightSource<B> + Send),
        options: &ModelOptions,
        device: &B::Device,
    ) -> Result<Self, ModelError> {
        Self::load_parts(config, source, options, device, None)
    }

    /// One shard of the model `config` describes split over several devices
    /// (see [`crate::tensor_parallel`]): its heads and MLP slice of every layer and its slice of
    /// the vocabulary for the lm_head, read from the whole checkpoint in `source`. Every shard
    /// runs the same calls (each on its own thread, with its own cache); the logits each
    /// returns are the whole model's, joined through `parallel.reduce`. [`Gemma::config`] is
    /// the shard's ([`crate::Shard::config`]). Steps of a shard run eagerly: a recorded decode
    /// step refuses its all-reduce.
    pub fn load_shard(
        config: GemmaConfig,
        source: &mut (impl WeightSource<B> + Send),
        options: &ModelOptions,
        device: &B::Device,
        parallel: TensorParallel<B>,
    ) -> Result<Self, ModelError> {
        config.validate()?;
        let local = parallel.shard.config(&config)?;
        let mut source = ShardedSource::new(source, &config, parallel.shard);
        let mut model = Self::load_parts(local, &mut source, options, device, Some(ShardLink::new(parallel.clone())))?;
        let settings = WeightSettings { dtype: model.dtype, format: options.weights };
        let rows = parallel.shard.part(config.vocab_size).len();
        let shape = [rows, config.hidden_size];
        model.head = Some(B::memory_persistent_allocations(device, &mut source, |source| {
            Embedding::load_table(source, "model.embed_tokens.weight", shape, settings, device)
        })?);
        B::memory_cleanup(device);
        Ok(model)
    }

    fn load_parts(
        config: GemmaConfig,
        source: &mut (impl WeightSource<B> + Send),
        options: &ModelOptions,
        device: &B::Device,
        parallel: Option<ShardLink>,
    ) -> Result<Self, ModelError> {
        config.validate()?;
        let ModelOptions { dtype, weights: format, kv_cache } = *options;
        if !matches!(dtype, DType::F32 | DType::F16 | DType::BF16) || !B::supports_dtype(device, dtype) {
            return Err(ModelError::BackendDtype { backend: B::name(device), dtype });
        }
        let kv_cache = kv_cache.unwrap_or(KvFormat::Dense(dtype));
        if let KvFormat::Dense(kv_dtype) = kv_cache {
            if !matches!(kv_dtype, DType::F32 | DType::F16 | DType::BF16) || !B::supports_dtype(device, kv_dtype) {
                return Err(ModelError::BackendDtype { backend: B::name(device), dtype: kv_dtype });
            }
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
                head: None,
                rotary_emb: RotaryEmbeddings::new(&config),
                config: config.clone(),
                dtype,
                kv_cache,
                parallel: parallel.clone(),
                tuning: KernelTuning::DEFAULT,
            })
        });
        B::memory_cleanup(device);
        model
    }

    /// Random weights (see [`crate::RandomWeights`]) in the exact shapes of `config`.
    pub fn random(
        config: GemmaConfig,
        seed: u64,
        options: &ModelOptions,
        device: &B::Device,
    ) -> Result<Self, ModelError> {
        Self::load(config, &mut crate::RandomWeights::new(seed), options, device)
    }

    /// The validated config the model was built from.
    pub fn config(&self) -> &GemmaConfig {
        &self.config
    }

    /// The activation dtype (and that of dense weights).
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// How the model's passes choose and launch kernels.
    pub fn tuning(&self) -> &KernelTuning {
        &self.tuning
    }

    /// Makes the model's passes, and the CUDA graphs recorded from them after this call, choose
    /// and launch kernels as `tuning` says.
    pub fn set_tuning(&mut self, tuning: KernelTuning) {
        self.tuning = tuning;
    }

    /// How [`Gemma::new_cache`] stores keys and values.
    pub fn kv_format(&self) -> KvFormat {
        self.kv_cache
    }

    /// Number of decoder layers.
    pub fn num_layers(&self) -> usize {
        self.layers.len()
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
        self.embed_tokens.device_bytes()
            + self.head.as_ref().map_or(0, Embedding::device_bytes)
            + self.per_layer.as_ref().map_or(0, PerLayerEmbeddings::device_bytes)
            + layers
    }

    /// A KV cache for `batch` sequences of up to `capacity` positions.
    pub fn new_cache(&self, batch: usize, capacity: usize) -> Result<KvCache<B>, ModelError> {
        KvCache::new(&self.config, batch, capacity, self.kv_cache, &self.device())
    }

    /// [`Gemma::new_cache`] with sliding windows stored as `windows` says (see
    /// [`crate::WindowStore`]).
    pub fn new_cache_with(
        &self,
        batch: usize,
        capacity: usize,
        windows: crate::WindowStore,
    ) -> Result<KvCache<B>, ModelError> {
        KvCache::with_window_store(&self.config, (batch, capacity), windows, self.kv_cache, &self.device())
    }

    /// A paged KV cache (see [`KvCache::paged`]) in this model's KV format.
    pub fn new_paged_cache(&self, layout: crate::PagedLayout) -> Result<KvCache<B>, ModelError> {
        KvCache::paged(&self.config, layout, self.kv_cache, &self.device())
    }

    /// Final hidden states (after the last norm), `[batch, seq, hidden]` in the model dtype.
    fn hidden_states(&self, ids: Tensor<B, 2, Int>, cache: &mut KvCache<B>) -> Result<Tensor<B, 3>, ModelError> {
        self.hidden_states_with(ids, &[], cache)
    }

    /// [`Gemma::hidden_states`] with images placed in the chunk.
    fn hidden_states_with(
        &self,
        ids: Tensor<B, 2, Int>,
        images: &[ImageEmbeds<B>],
        cache: &mut KvCache<B>,
    ) -> Result<Tensor<B, 3>, ModelError> {
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
        let hidden = self.pass(|| self.layers_forward(ids, images, cache, &StepPosition::Host(position)))?;
        cache.advance(seq);
        Ok(hidden)
    }

    /// Runs a pass's `work` where the backend runs passes fastest ([`GemmaBackend::run_pass`]:
    /// on the CPU backends' thread pool), except on a tensor-parallel shard: its passes wait for
    /// the other shards', and on a pool of fewer threads than shards a pass waiting inside the
    /// pool would hold a thread another shard's pass needs.
    fn pass<R: Send>(&self, work: impl FnOnce() -> R + Send) -> R {
        let tuning = &self.tuning;
        let work = move || tuning.run(work);
        match self.parallel() {
            Some(_) => work(),
            None => B::run_pass(work),
        }
    }

    /// Embedding, every layer and the final norm over `ids` at `position` (the cache's length
    /// is left to the caller).
    fn layers_forward(
        &self,
        ids: Tensor<B, 2, Int>,
        images: &[ImageEmbeds<B>],
        cache: &mut KvCache<B>,
        position: &StepPosition<B>,
    ) -> Result<Tensor<B, 3>, ModelError> {
        let rope = self.rotary_emb.tables::<B>(cache.capacity(), &self.device());
        // HF embeds the pad token at image positions (the soft tokens' own ids may be past the
        // vocabulary) before the image features replace those rows.
        let ids = if images.is_empty() { ids } else { self.padded_at_images(ids, images) };
        let scale = embed_scale(self.config.hidden_size, self.dtype);
        let mut embedded = self.embed_tokens.embed(ids.clone(), scale, self.dtype);
        for image in images {
            // HF's `masked_scatter` of the image features over the soft tokens' embeddings.
            let [n, width] = image.features.dims();
            let rows = [0..1, image.start..image.start + n, 0..width];
            embedded = embedded.slice_assign(rows, image.features.clone().cast(self.dtype).unsqueeze::<3>());
        }
        // A Gemma 4 E model's per-layer inputs: the pad token's own rows at image positions, and
        // the projection of the embeddings with the image features in place (HF's
        // `get_per_layer_inputs` of the padded ids, then `project_per_layer_inputs`).
        let per_layer = self.per_layer.as_ref().map(|p| p.inputs(ids, embedded.clone(), self.dtype));
        let mut stream = ResidualStream::new(embedded, self.dtype);
        for (i, layer) in self.layers.iter().enumerate() {
            let input = per_layer.as_ref().map(|inputs| (inputs.clone(), i));
            let rope = rope.get(layer.self_attn.settings.layer_type);
            let kv = LayerKv::Cache(cache.layer_mut(i));
            stream = layer.forward(stream, rope, kv, position, input, self.parallel())?;
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
        let hidden = self.decode_hidden(inputs, cache)?;
        // Greedy on one device: the lm_head, the softcap and the argmax as one backend
        // operation (fused by the CubeCL backends for Q4/Q8 tables).
        if sampling.temperature == 0.0 && !self.vocab_sharded() {
            let cap = self.config.final_logit_softcapping;
            let choice = self.pass(|| B::project_greedy(hidden, &self.embed_tokens.blocks, cap))?;
            return Ok((choice.ids, choice.logits));
        }
        let logits = self.capped(self.project_vocab(hidden)?);
        let ids = B::sample(logits.clone(), sampling, Draws::Device(inputs.draws.clone()))?;
        Ok((ids, logits))
    }

    /// [`Gemma::decode_step`] without the sampling: the logits `[batch, vocab]` in the
    /// activation dtype (capped where the config has a final softcap). The `batch` sequences
    /// are the first of `cache`'s, each at its own position where `inputs.position` holds one
    /// per sequence ([`StepInputs::sequences`]).
    ///
    /// Or the rows are consecutive positions of the cache's first sequence
    /// ([`StepRows::Consecutive`], a verify step): every row's keys and values are written
    /// first, then row `b` attends up to its own position, and its logits are those a
    /// one-position step there computes (up to the products' summation over several rows). The
    /// cache must then keep every position of its sliding windows
    /// ([`crate::WindowStore::EveryPosition`]) unless there is one row.
    pub fn decode_logits(&self, inputs: &StepInputs<B>, cache: &mut KvCache<B>) -> Result<Tensor<B, 2>, ModelError> {
        let hidden = self.decode_hidden(inputs, cache)?;
        Ok(self.capped(self.project_vocab(hidden)?))
    }

    /// The final softcap where the config has one.
    fn capped(&self, logits: Tensor<B, 2>) -> Tensor<B, 2> {
        match self.config.final_logit_softcapping {
            Some(cap) => B::softcap(logits, cap),
            None => logits,
        }
    }

    /// Whether this model is a tensor-parallel shard multiplying its slice of the vocabulary.
    fn vocab_sharded(&self) -> bool {
        self.head.is_some() && self.parallel().is_some()
    }

    /// [`Gemma::decode_logits`] up to the lm_head: the final hidden states `[batch, hidden]`.
    fn decode_hidden(&self, inputs: &StepInputs<B>, cache: &mut KvCache<B>) -> Result<Tensor<B, 2>, ModelError> {
        let [batch, seq] = inputs.ids.dims();
        let positions = inputs.position.dims()[0];
        match inputs.rows {
            StepRows::Sequences
                if seq != 1 || batch == 0 || batch > cache.batch() || (positions != 1 && positions != batch) =>
            {
                return Err(ModelError::InvalidInput(format!(
                    "a decode step takes one token per sequence, for at most the cache's {} sequences, at one \
                     position or one per sequence; got tokens [{batch}, {seq}] at {positions} positions",
                    cache.batch()
                )));
            }
            StepRows::Consecutive if seq != 1 || batch == 0 || positions != 1 => {
                return Err(ModelError::InvalidInput(format!(
                    "a verify step takes one token per row at the first row's position; got tokens [{batch}, {seq}] \
                     at {positions} positions"
                )));
            }
            StepRows::Consecutive if batch > 1 && !cache.takes_consecutive_rows() => {
                return Err(ModelError::InvalidInput(
                    "a verify step of several rows needs an unpaged KV cache that keeps every position of its \
                     sliding windows (KvCache::with_window_store, WindowStore::EveryPosition)"
                        .into(),
                ));
            }
            _ => {}
        }
        if inputs.bound >= cache.capacity() {
            return Err(ModelError::ContextOverflow { needed: inputs.bound + 1, capacity: cache.capacity() });
        }
        self.check_cache(cache)?;
        cache.sync_blocks();
        let position = StepPosition::Device { values: inputs.position.clone(), bound: inputs.bound, rows: inputs.rows };
        let hidden = self.pass(|| self.layers_forward(inputs.ids.clone(), &[], cache, &position))?;
        Ok(hidden.reshape([batch, self.config.hidden_size]))
    }

    /// `ids` at consecutive positions from the cache's length, as one decode step
    /// ([`StepRows::Consecutive`]: what [`crate::DecodeGraphs::verify`] records): every row's
    /// logits `[rows, vocab]` in the activation dtype (capped where the config has a final
    /// softcap), each those of a one-position step at its position (as [`Gemma::forward_each`]
    /// gives them); the cache advances by every row. Several rows need a cache that keeps every
    /// position of its sliding windows ([`crate::WindowStore::EveryPosition`]).
    pub fn decode_consecutive(&self, ids: &[u32], cache: &mut KvCache<B>) -> Result<Tensor<B, 2>, ModelError> {
        cache.check_room(ids.len())?;
        let inputs = StepInputs::consecutive(ids, cache.len(), &self.device())?;
        let logits = self.decode_logits(&inputs, cache)?;
        cache.advance(ids.len());
        Ok(logits)
    }

    /// Logits (f32) of final hidden states `[batch, seq, hidden]` ([`Gemma::forward_hidden`])
    /// -> `[batch, seq, vocab]`. Fails only for a tensor-parallel shard whose shards could not
    /// join their slices of the vocabulary.
    pub fn logits(&self, hidden: Tensor<B, 3>) -> Result<Tensor<B, 3>, ModelError> {
        let [batch, seq, h] = hidden.dims();
        let hidden = hidden.reshape([batch * seq, h]);
        let logits = self.project_vocab(hidden)?.cast(DType::F32).reshape([batch, seq, self.config.vocab_size]);
        Ok(match self.config.final_logit_softcapping {
            Some(cap) => B::softcap(logits, cap),
            None => logits,
        })
    }

    /// `hidden [n, hidden]` times the lm_head: `[n, vocab]` in the activation dtype. A shard
    /// multiplies by its slice of the vocabulary and joins the slices.
    fn project_vocab(&self, hidden: Tensor<B, 2>) -> Result<Tensor<B, 2>, ModelError> {
        match (&self.head, self.parallel()) {
            (Some(head), Some(parallel)) => parallel.join_vocab(head.project(hidden), self.config.vocab_size),
            _ => Ok(self.pass(|| self.embed_tokens.project(hidden))),
        }
    }

    /// Runs `ids` (`[batch, seq]`) after the positions already in `cache` and returns the logits
    /// of every position, `[batch, seq, vocab]` (f32).
    pub fn forward(&self, ids: Tensor<B, 2, Int>, cache: &mut KvCache<B>) -> Result<Tensor<B, 3>, ModelError> {
        let hidden = self.hidden_states(ids, cache)?;
        self.logits(hidden)
    }

    /// Runs `ids` (`[batch, seq]`) after the positions already in `cache` and returns the final
    /// hidden states (after the last norm) of every position, `[batch, seq, hidden]` in the
    /// activation dtype ([`Gemma::logits`] makes logits of them); `rows`: how the positions
    /// attend (see [`Gemma::forward_each`]).
    pub fn forward_hidden(
        &self,
        ids: Tensor<B, 2, Int>,
        cache: &mut KvCache<B>,
        rows: QueryRows,
    ) -> Result<Tensor<B, 3>, ModelError> {
        cache.set_query_rows(rows);
        let hidden = self.hidden_states(ids, cache);
        cache.set_query_rows(QueryRows::Together);
        hidden
    }

    /// [`Gemma::forward_hidden`] over a chunk holding images (one sequence): each image's
    /// features replace the embeddings of its soft tokens, which attend to each other as the
    /// config's [`crate::config::ImageAttention`] says (Gemma 3: both ways, HF's
    /// `token_type_ids`; Gemma 4: both ways on sliding layers); an image's tokens must all be in
    /// the chunk. A Gemma 4 E model's per-layer embeddings of the image positions are its pad
    /// token's, as HF's.
    pub fn forward_hidden_with_images(
        &self,
        ids: Tensor<B, 2, Int>,
        images: &[ImageEmbeds<B>],
        cache: &mut KvCache<B>,
    ) -> Result<Tensor<B, 3>, ModelError> {
        let [batch, seq] = ids.dims();
        if batch != 1 {
            return Err(ModelError::InvalidInput(format!("images go into one sequence at a time, got {batch}")));
        }
        if !matches!(self.config.model_type, Architecture::Gemma3 | Architecture::Gemma4) {
            return Err(ModelError::InvalidInput("images are read for Gemma 3 and Gemma 4 models".into()));
        }
        let mut end = 0;
        let mut blocks = Vec::with_capacity(images.len());
        for image in images {
            let [n, width] = image.features.dims();
            if image.start < end || image.start + n > seq || n == 0 || width != self.config.hidden_size {
                return Err(ModelError::InvalidInput(format!(
                    "image features [{n}, {width}] at row {} do not fit a chunk of {seq} positions of width {} \
                     after the previous image (ending at row {end})",
                    image.start, self.config.hidden_size
                )));
            }
            end = image.start + n;
            blocks.push(cache.len() + image.start..cache.len() + end);
        }
        let layer_types = &self.config.layer_types;
        match self.config.image_attention {
            ImageAttention::Causal => cache.set_bidirectional(&[]),
            ImageAttention::BothWays => cache.set_bidirectional(&blocks),
            ImageAttention::BothWaysOnSlidingLayers => {
                cache.set_bidirectional_on(&blocks, |i| layer_types[i] == LayerType::SlidingAttention)
            }
        }
        let hidden = self.hidden_states_with(ids, images, cache);
        cache.set_bidirectional(&[]);
        hidden
    }

    /// `ids` (`[1, seq]`) with the pad token at every image's soft tokens.
    fn padded_at_images(&self, ids: Tensor<B, 2, Int>, images: &[ImageEmbeds<B>]) -> Tensor<B, 2, Int> {
        let device = ids.device();
        images.iter().fold(ids, |ids, image| {
            let n = image.features.dims()[0];
            let pads = Tensor::<B, 2, Int>::full([1, n], self.config.pad_token_id as i64, &device);
            ids.slice_assign([0..1, image.start..image.start + n], pads)
        })
    }

    /// The input embedding of `ids` (`[batch, seq]` -> `[batch, seq, hidden]`, scaled by
    /// `sqrt(hidden)`, in the activation dtype): what a Gemma 4 assistant reads of its target.
    pub(crate) fn embed_scaled(&self, ids: Tensor<B, 2, Int>) -> Tensor<B, 3> {
        self.embed_tokens.embed(ids, embed_scale(self.config.hidden_size, self.dtype), self.dtype)
    }

    /// [`Gemma::forward`] with each position's attention on its own ([`QueryRows::Each`]):
    /// the logits of row `i` are those a one-position step at it computes, where the rest of
    /// the model is the same row by row (the block products of fewer than 16 rows on the
    /// CPU). Speculative decoding verifies drafts with it, so that greedy choices are those of
    /// decoding without drafts.
    pub fn forward_each(&self, ids: Tensor<B, 2, Int>, cache: &mut KvCache<B>) -> Result<Tensor<B, 3>, ModelError> {
        self.logits(self.forward_hidden(ids, cache, QueryRows::Each)?)
    }

    /// Like [`Gemma::forward`] but returns only the last position's logits, `[batch, vocab]`.
    pub fn forward_last(&self, ids: Tensor<B, 2, Int>, cache: &mut KvCache<B>) -> Result<Tensor<B, 2>, ModelError> {
        let hidden = self.hidden_states(ids, cache)?;
        let [batch, seq, h] = hidden.dims();
        let last = hidden.slice([0..batch, seq - 1..seq, 0..h]);
        Ok(self.logits(last)?.reshape([batch, self.config.vocab_size]))
    }

    /// The shard of a split model this is ([`Gemma::load_shard`]).
    pub fn parallel(&self) -> Option<&TensorParallel<B>> {
        self.parallel.as_ref().and_then(ShardLink::get)
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
