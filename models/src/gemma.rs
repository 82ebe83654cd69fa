//! Gemma 1, 2 and 3, from the small parts to the whole model (HF's `modeling_gemma3.py`).
//!
//! The residual stream is kept in f32 whatever the weight dtype ([`ResidualStream`]): Gemma
//! activations overflow f16. Matrix products run in the weight dtype.

use crate::{
    attention::{Attention, LayerCache},
    norm::{ResidualStream, RmsNorm},
    projection::{load_matrix, Projection, WeightSettings},
    rope::RotaryEmbeddings,
    weights::{row_chunks, WeightFormat, WeightSource},
    Architecture, GemmaConfig, KvCache, ModelError,
};
use burn::{
    module::Module,
    tensor::{DType, Int, Tensor},
};
use burn_gemma_kernels::{
    gelu::{self, PAIR_BLOCK},
    Draws, Epilogue, GateUpLayout, GemmaBackend, HostMatrix, HostQuantized, KvFormat, Matrix, QuantFormat, RopeTables,
    SamplingParams, StepPosition,
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
    fn new(gate: HostMatrix<B>, up: HostMatrix<B>, intermediate: usize, device: &B::Device) -> Self {
        let fits = gelu::pairs_fit(intermediate);
        match (gate, up) {
            (HostMatrix::Quantized(gate), HostMatrix::Quantized(up)) if fits => {
                match HostQuantized::interleave_pairs(gate, up, PAIR_BLOCK) {
                    Ok(joined) => Self::Interleaved(B::upload_matrix(HostMatrix::Quantized(joined), device)),
                    Err((gate, up)) => {
                        Self::side_by_side(HostMatrix::Quantized(gate), HostMatrix::Quantized(up), device)
                    }
                }
            }
            (HostMatrix::Dense(gate), HostMatrix::Dense(up)) if fits && gate.dtype() == up.dtype() => {
                let joined = gelu::interleave_pairs(gate, up);
                Self::Interleaved(B::upload_matrix(HostMatrix::Dense(joined), device))
            }
            (gate, up) => Self::side_by_side(gate, up, device),
        }
    }

    fn side_by_side(gate: HostMatrix<B>, up: HostMatrix<B>, device: &B::Device) -> Self {
        Self::SideBySide(Projection::joined(vec![gate, up], device))
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
    fn load(
        source: &mut impl WeightSource<B>,
        prefix: &str,
        c: &GemmaConfig,
        settings: WeightSettings,
        device: &B::Device,
    ) -> Result<Self, ModelError> {
        let (hidden, inter) = (c.hidden_size, c.intermediate_size);
        let gate = load_matrix(source, &format!("{prefix}.gate_proj.weight"), [inter, hidden], settings, device)?;
        let up = load_matrix(source, &format!("{prefix}.up_proj.weight"), [inter, hidden], settings, device)?;
        Ok(Self {
            gate_up: GateUp::new(gate, up, inter, device),
            down_proj: Projection::load(source, &[(&format!("{prefix}.down_proj"), hidden)], inter, settings, device)?,
        })
    }

    /// `[batch, seq, hidden]` -> `[batch, seq, hidden]`.
    pub fn forward(&self, x: Tensor<B, 3>) -> Tensor<B, 3> {
        self.down_proj.forward(self.gate_up.forward(x))
    }
}

/// One decoder layer. Gemma 1 has a norm before attention and one before the MLP; Gemma 2 and 3
/// also normalize the outputs of both.
#[derive(Module, Debug)]
pub struct DecoderLayer<B: GemmaBackend> {
    pub self_attn: Attention<B>,
    pub mlp: Mlp<B>,
    pub input_layernorm: RmsNorm<B>,
    pub post_attention_layernorm: Option<RmsNorm<B>>,
    pub pre_feedforward_layernorm: RmsNorm<B>,
    pub post_feedforward_layernorm: Option<RmsNorm<B>>,
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
        let norm = |source: &mut _, name: &str| {
            RmsNorm::load(source, &format!("{prefix}.{name}"), c.hidden_size, c.rms_norm_eps, device)
        };
        let self_attn = Attention::load(source, &format!("{prefix}.self_attn"), index, c, settings, device)?;
        let mlp = Mlp::load(source, &format!("{prefix}.mlp"), c, settings, device)?;
        let input_layernorm = norm(source, "input_layernorm")?;
        Ok(if c.model_type.has_sandwich_norms() {
            Self {
                self_attn,
                mlp,
                input_layernorm,
                post_attention_layernorm: Some(norm(source, "post_attention_layernorm")?),
                pre_feedforward_layernorm: norm(source, "pre_feedforward_layernorm")?,
                post_feedforward_layernorm: Some(norm(source, "post_feedforward_layernorm")?),
            }
        } else {
            // Gemma 1 calls its pre-MLP norm `post_attention_layernorm`.
            Self {
                self_attn,
                mlp,
                input_layernorm,
                post_attention_layernorm: None,
                pre_feedforward_layernorm: norm(source, "post_attention_layernorm")?,
                post_feedforward_layernorm: None,
            }
        })
    }

    /// The block at `position` (HF's `Gemma3DecoderLayer.forward`); each `residual + h` is
    /// added by the next norm, in one kernel ([`ResidualStream`]).
    fn forward<'a>(
        &'a self,
        stream: ResidualStream<'a, B>,
        rope: &RopeTables<B>,
        cache: &mut LayerCache<B>,
        position: &StepPosition<B>,
    ) -> ResidualStream<'a, B> {
        let (stream, h) = stream.norm(&self.input_layernorm);
        let h = self.self_attn.forward(h, rope, cache, position);
        let stream = stream.add(h, self.post_attention_layernorm.as_ref());
        let (stream, h) = stream.norm(&self.pre_feedforward_layernorm);
        let h = self.mlp.forward(h);
        stream.add(h, self.post_feedforward_layernorm.as_ref())
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
        let shape = [c.vocab_size, c.hidden_size];
        let host = match settings.table_blocks() {
            None => None,
            Some(request) => match source.load_host_quantized(Self::NAME, shape, request.format(), device)? {
                // Q4 is not enough for the table: requantize a Q4 checkpoint's to Q8.
                Some(q) if q.format == QuantFormat::Q4 => {
                    Some(crate::weights::quantize(Self::NAME, &q.dequantize(), shape, QuantFormat::Q8)?)
                }
                other => other,
            },
        };
        let upload = |m| B::upload_matrix(m, device);
        let max_bytes = B::max_buffer_bytes(device);
        let blocks = match host {
            Some(host) => {
                let rows_per_chunk = (max_bytes / host.cols).max(1);
                row_chunks(host.rows, rows_per_chunk)
                    .map(|r| upload(HostMatrix::Quantized(host.rows_slice(r))))
                    .collect()
            }
            None => {
                let rows_per_chunk = (max_bytes / (c.hidden_size * settings.dtype.size())).max(1);
                let blocks = source.load_row_chunks(Self::NAME, shape, rows_per_chunk, settings.dtype, device)?;
                blocks.into_iter().map(|b| upload(HostMatrix::Dense(b))).collect()
            }
        };
        Ok(Self { blocks })
    }

    /// `table[ids] * scale` in `dtype`: `[batch, seq]` -> `[batch, seq, hidden]`.
    fn embed(&self, ids: Tensor<B, 2, Int>, scale: f64, dtype: DType) -> Tensor<B, 3> {
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
            let layers = (0..config.num_hidden_layers)
                .map(|i| DecoderLayer::load(source, i, &config, settings, device))
                .collect::<Result<Vec<_>, _>>()?;
            let norm = RmsNorm::load(source, "model.norm", config.hidden_size, config.rms_norm_eps, device)?;
            Ok(Self {
                embed_tokens,
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
                let (a, m) = (&l.self_attn, &l.mlp);
                a.qkv_proj.device_bytes()
                    + a.o_proj.device_bytes()
                    + m.gate_up.device_bytes()
                    + m.down_proj.device_bytes()
            })
            .sum();
        self.embed_tokens.device_bytes() + layers
    }

    /// A KV cache for `batch` sequences of up to `capacity` positions.
    pub fn new_cache(&self, batch: usize, capacity: usize) -> Result<KvCache<B>, ModelError> {
        KvCache::new(&self.config, batch, capacity, self.kv_cache, &self.device())
    }

    /// The embedding scale `sqrt(hidden_size)`, rounded to the activation dtype as the reference
    /// implementation does.
    fn embed_scale(&self) -> f64 {
        let scale = (self.config.hidden_size as f64).sqrt();
        match self.dtype {
            DType::BF16 => half::bf16::from_f64(scale).to_f64(),
            DType::F16 => half::f16::from_f64(scale).to_f64(),
            _ => scale as f32 as f64,
        }
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
        cache.check_room(seq)?;
        let position = cache.len();
        let hidden = self.layers_forward(ids, cache, &StepPosition::Host(position));
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
    ) -> Tensor<B, 3> {
        let rope = self.rotary_emb.tables::<B>(cache.capacity(), &self.device());
        let embedded = self.embed_tokens.embed(ids, self.embed_scale(), self.dtype);
        let mut stream = ResidualStream::new(embedded, self.dtype);
        for (layer, layer_cache) in self.layers.iter().zip(cache.layers_mut()) {
            stream = layer.forward(stream, rope.get(layer.self_attn.settings.layer_type), layer_cache, position);
        }
        let (_, hidden) = stream.norm(&self.norm);
        hidden
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
        let position = StepPosition::Device { values: inputs.position.clone(), bound: inputs.bound };
        let hidden = self.layers_forward(inputs.ids.clone(), cache, &position);
        let logits = self.embed_tokens.project(hidden.reshape([batch, self.config.hidden_size]));
        let logits = match self.config.final_logit_softcapping {
            Some(cap) => B::softcap(logits, cap),
            None => logits,
        };
        let ids = B::sample(logits.clone(), sampling, Draws::Device(inputs.draws.clone()));
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
            let layer = GateUp::new(gate_loaded, up_loaded, inter, &device);
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
