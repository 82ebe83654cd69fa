//! Gemma 1, 2 and 3, from the small parts to the whole model.
//!
//! The residual stream is kept in f32 whatever the weight dtype: Gemma activations overflow f16,
//! and the fused add + RMSNorm reads and writes it in f32 anyway. Matrix products run in the
//! weight dtype.

use crate::{
    cache::KvFormat,
    weights::{row_chunks, MatrixWeight, WeightFormat, WeightKind, WeightSource},
    Architecture, GemmaConfig, KvCache, LayerType, ModelError,
};
use burn::{
    module::{Module, Param},
    tensor::{DType, Int, Tensor},
};
use burn_gemma_kernels::GemmaBackend;
use burn_gemma_kernels::{
    gelu::{self, PAIR_BLOCK},
    HostQuantized, QkvLayout, QuantFormat, QuantizedMatrix,
};

/// How the model's weights are loaded: the activation/dense dtype and the matrix format.
#[derive(Debug, Clone, Copy)]
pub struct WeightSettings {
    pub dtype: DType,
    pub format: WeightFormat,
}

impl WeightSettings {
    /// The block format a matrix is requested in: `None` for the checkpoint's own.
    fn request(&self) -> Option<Option<QuantFormat>> {
        match self.format {
            WeightFormat::Native => Some(None),
            WeightFormat::Quantized(q) => Some(Some(q)),
            WeightFormat::Dense => None,
        }
    }
}

/// One matrix as read from the source, before upload: block-quantized on the host or dense on
/// the device.
enum Loaded<B: GemmaBackend> {
    Host(HostQuantized),
    Dense(Tensor<B, 2>),
}

/// Reads one `[out, in]` matrix in the requested format.
fn load_matrix<B: GemmaBackend>(
    source: &mut impl WeightSource<B>,
    name: &str,
    shape: [usize; 2],
    settings: WeightSettings,
    device: &B::Device,
) -> Result<Loaded<B>, ModelError> {
    if let Some(request) = settings.request() {
        if let Some(host) = source.load_host_quantized(name, shape, request, device)? {
            return Ok(Loaded::Host(host));
        }
    }
    Ok(Loaded::Dense(source.load(name, shape, WeightKind::Matrix, settings.dtype, device)?))
}

/// Uploads row blocks read in order, joining neighbours stored alike (same block format and
/// width, or both dense) into one matrix.
fn upload_joined<B: GemmaBackend>(blocks: Vec<Loaded<B>>, device: &B::Device) -> Vec<MatrixWeight<B>> {
    enum Group<B: GemmaBackend> {
        Host(HostQuantized),
        Dense(Vec<Tensor<B, 2>>),
    }
    let mut groups: Vec<Group<B>> = Vec::new();
    for block in blocks {
        match (groups.last_mut(), block) {
            (Some(Group::Host(last)), Loaded::Host(next)) => {
                if let Err(next) = last.append_rows(next) {
                    groups.push(Group::Host(next));
                }
            }
            (Some(Group::Dense(rows)), Loaded::Dense(next)) => rows.push(next),
            (_, Loaded::Host(next)) => groups.push(Group::Host(next)),
            (_, Loaded::Dense(next)) => groups.push(Group::Dense(vec![next])),
        }
    }
    groups
        .into_iter()
        .map(|group| match group {
            Group::Host(host) => MatrixWeight::Quantized(B::upload_quantized(&host, device)),
            Group::Dense(rows) => MatrixWeight::Dense(Param::from_tensor(B::pack(Tensor::cat(rows, 0)))),
        })
        .collect()
}

/// A bias-free linear layer, `weight` `[out, in]` as in the checkpoint. Layers that read the
/// same input (q|k|v, gate|up) are loaded as one, their matrices joined row-wise where they are
/// stored alike, so decode runs one product instead of several.
#[derive(Module, Debug)]
pub struct Linear<B: GemmaBackend> {
    /// Consecutive row blocks of the output.
    pub parts: Vec<MatrixWeight<B>>,
}

impl<B: GemmaBackend> Linear<B> {
    /// Loads the checkpoint matrices `{name}.weight` (`[out, inp]` each, in the order given) as
    /// one layer whose output is theirs side by side.
    fn load(
        source: &mut impl WeightSource<B>,
        names: &[(&str, usize)],
        inp: usize,
        settings: WeightSettings,
        device: &B::Device,
    ) -> Result<Self, ModelError> {
        let blocks = names
            .iter()
            .map(|&(name, out)| load_matrix(source, &format!("{name}.weight"), [out, inp], settings, device))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Self { parts: upload_joined(blocks, device) })
    }

    /// `[batch, seq, in]` -> `[batch, seq, out]`.
    pub fn forward(&self, x: Tensor<B, 3>) -> Tensor<B, 3> {
        let [batch, seq, inp] = x.dims();
        let x = x.reshape([batch * seq, inp]);
        let mut outs: Vec<Tensor<B, 2>> = self.parts.iter().map(|w| w.project(x.clone())).collect();
        let out = if outs.len() == 1 { outs.pop().unwrap_or(x) } else { Tensor::cat(outs, 1) };
        let width = out.dims()[1];
        out.reshape([batch, seq, width])
    }

    /// Bytes on the device.
    pub fn device_bytes(&self) -> usize {
        self.parts.iter().map(|w| w.device_bytes()).sum()
    }
}

/// RMSNorm with Gemma's `1 + w` scale; `weight` is kept in f32.
#[derive(Module, Debug)]
pub struct RmsNorm<B: GemmaBackend> {
    pub weight: Param<Tensor<B, 1>>,
    #[module(skip)]
    pub eps: f64,
}

impl<B: GemmaBackend> RmsNorm<B> {
    fn load(
        source: &mut impl WeightSource<B>,
        name: &str,
        size: usize,
        eps: f64,
        device: &B::Device,
    ) -> Result<Self, ModelError> {
        let weight = source.load(&format!("{name}.weight"), [size], WeightKind::Norm, DType::F32, device)?;
        Ok(Self { weight: Param::from_tensor(weight), eps })
    }

    /// Normalizes the last dimension.
    pub fn forward<const D: usize>(&self, x: Tensor<B, D>) -> Tensor<B, D> {
        B::rms_norm(x, self.weight.val(), self.eps)
    }

    /// `(residual + x', norm(residual + x'))` where `x'` is `x` normalized by `post` (when
    /// given), residual in f32, the normalized value in `dtype`; one kernel for the chain.
    pub fn forward_residual(
        &self,
        residual: Tensor<B, 3>,
        x: Tensor<B, 3>,
        post: Option<&RmsNorm<B>>,
        dtype: DType,
    ) -> (Tensor<B, 3>, Tensor<B, 3>) {
        B::add_rms_norm(residual, x, post.map(|n| n.weight.val()), self.weight.val(), self.eps, dtype)
    }
}

/// The gate and up projections of an MLP (they read the same input).
#[derive(Module, Debug)]
pub enum GateUp<B: GemmaBackend> {
    /// One matrix holding the gate and up rows interleaved in blocks of [`PAIR_BLOCK`]: the
    /// product and the GELU run as one operation ([`GemmaBackend::project_gelu_pairs`]), which
    /// on GPUs is one GEMV launch per decode step instead of two.
    Interleaved(MatrixWeight<B>),
    /// Side by side (`[batch, seq, 2 * intermediate]`, joined into one matrix where stored
    /// alike), then the GELU: where the two are stored differently or the width does not split
    /// into pair blocks.
    SideBySide(Linear<B>),
}

impl<B: GemmaBackend> GateUp<B> {
    /// Interleaves `gate` and `up` (`[intermediate, hidden]` each) where both are stored alike
    /// and `intermediate` splits into pair blocks, else keeps them side by side.
    fn new(gate: Loaded<B>, up: Loaded<B>, intermediate: usize, device: &B::Device) -> Self {
        let fits = gelu::pairs_fit(intermediate);
        match (gate, up) {
            (Loaded::Host(gate), Loaded::Host(up)) if fits => {
                match HostQuantized::interleave_pairs(gate, up, PAIR_BLOCK) {
                    Ok(joined) => Self::Interleaved(MatrixWeight::Quantized(B::upload_quantized(&joined, device))),
                    Err((gate, up)) => Self::side_by_side(Loaded::Host(gate), Loaded::Host(up), device),
                }
            }
            (Loaded::Dense(gate), Loaded::Dense(up)) if fits && gate.dtype() == up.dtype() => {
                Self::Interleaved(MatrixWeight::Dense(Param::from_tensor(B::pack(gelu::interleave_pairs(gate, up)))))
            }
            (gate, up) => Self::side_by_side(gate, up, device),
        }
    }

    fn side_by_side(gate: Loaded<B>, up: Loaded<B>, device: &B::Device) -> Self {
        Self::SideBySide(Linear { parts: upload_joined(vec![gate, up], device) })
    }

    /// `[batch, seq, hidden]` -> `gelu_tanh(gate(x)) * up(x)`, `[batch, seq, intermediate]`.
    pub fn forward(&self, x: Tensor<B, 3>) -> Tensor<B, 3> {
        match self {
            Self::Interleaved(w) => {
                let [batch, seq, hidden] = x.dims();
                let out = w.project_gelu_pairs(x.reshape([batch * seq, hidden]));
                let width = out.dims()[1];
                out.reshape([batch, seq, width])
            }
            Self::SideBySide(linear) => B::gelu_mul_halves(linear.forward(x)),
        }
    }

    /// Bytes on the device.
    pub fn device_bytes(&self) -> usize {
        match self {
            Self::Interleaved(w) => w.device_bytes(),
            Self::SideBySide(linear) => linear.device_bytes(),
        }
    }
}

/// Gated MLP: `down(gelu_tanh(gate(x)) * up(x))`.
#[derive(Module, Debug)]
pub struct Mlp<B: GemmaBackend> {
    /// `gate_proj` and `up_proj`.
    pub gate_up: GateUp<B>,
    pub down_proj: Linear<B>,
}

impl<B: GemmaBackend> Mlp<B> {
    fn load(
        source: &mut impl WeightSource<B>,
        prefix: &str,
        c: &GemmaConfig,
        dtype: WeightSettings,
        device: &B::Device,
    ) -> Result<Self, ModelError> {
        let (hidden, inter) = (c.hidden_size, c.intermediate_size);
        let gate = load_matrix(source, &format!("{prefix}.gate_proj.weight"), [inter, hidden], dtype, device)?;
        let up = load_matrix(source, &format!("{prefix}.up_proj.weight"), [inter, hidden], dtype, device)?;
        Ok(Self {
            gate_up: GateUp::new(gate, up, inter, device),
            down_proj: Linear::load(source, &[(&format!("{prefix}.down_proj"), hidden)], inter, dtype, device)?,
        })
    }

    /// `[batch, seq, hidden]` -> `[batch, seq, hidden]`.
    pub fn forward(&self, x: Tensor<B, 3>) -> Tensor<B, 3> {
        self.down_proj.forward(self.gate_up.forward(x))
    }
}

/// Shape and behaviour of one attention layer, from the config.
#[derive(Debug, Clone)]
pub struct AttentionSettings {
    pub index: usize,
    pub layer_type: LayerType,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub scale: f64,
    pub softcap: Option<f64>,
}

/// Multi-head attention with grouped KV heads, RoPE and (Gemma 3) QK-norm.
#[derive(Module, Debug)]
pub struct Attention<B: GemmaBackend> {
    /// `q_proj`, `k_proj` and `v_proj` side by side: `[batch, seq, (heads + 2 kv_heads) * head_dim]`.
    pub qkv_proj: Linear<B>,
    pub o_proj: Linear<B>,
    pub q_norm: Option<RmsNorm<B>>,
    pub k_norm: Option<RmsNorm<B>>,
    #[module(skip)]
    pub settings: AttentionSettings,
}

impl<B: GemmaBackend> Attention<B> {
    fn load(
        source: &mut impl WeightSource<B>,
        prefix: &str,
        index: usize,
        c: &GemmaConfig,
        dtype: WeightSettings,
        device: &B::Device,
    ) -> Result<Self, ModelError> {
        let (hidden, d) = (c.hidden_size, c.head_dim);
        let (heads, kv_heads) = (c.num_attention_heads, c.num_key_value_heads);
        let qk_norm = |source: &mut _, name: &str| -> Result<Option<RmsNorm<B>>, ModelError> {
            if c.model_type.has_qk_norm() {
                Ok(Some(RmsNorm::load(source, &format!("{prefix}.{name}"), d, c.rms_norm_eps, device)?))
            } else {
                Ok(None)
            }
        };
        let (q, k, v, o) = (
            format!("{prefix}.q_proj"),
            format!("{prefix}.k_proj"),
            format!("{prefix}.v_proj"),
            format!("{prefix}.o_proj"),
        );
        Ok(Self {
            qkv_proj: Linear::load(
                source,
                &[(&q, heads * d), (&k, kv_heads * d), (&v, kv_heads * d)],
                hidden,
                dtype,
                device,
            )?,
            o_proj: Linear::load(source, &[(&o, hidden)], heads * d, dtype, device)?,
            q_norm: qk_norm(source, "q_norm")?,
            k_norm: qk_norm(source, "k_norm")?,
            settings: AttentionSettings {
                index,
                layer_type: c.layer_types[index],
                num_heads: heads,
                num_kv_heads: kv_heads,
                head_dim: d,
                scale: c.query_pre_attn_scalar.powf(-0.5),
                softcap: c.attn_logit_softcapping,
            },
        })
    }

    /// `[batch, seq, hidden]` -> `[batch, seq, hidden]`, appending this layer's keys and values
    /// to the cache.
    pub fn forward(&self, x: Tensor<B, 3>, cache: &mut KvCache<B>) -> Tensor<B, 3> {
        let s = &self.settings;
        let [batch, seq, _] = x.dims();
        let d = s.head_dim;
        let qkv = self.qkv_proj.forward(x);
        let offset = cache.len();
        let rope = cache.rope(s.layer_type);
        let out = if seq == 1 {
            // Decode: one kernel splits, normalizes, rotates and appends.
            let norm = match (&self.q_norm, &self.k_norm) {
                (Some(q), Some(k)) => Some((q.weight.val(), k.weight.val(), q.eps)),
                _ => None,
            };
            let layout = QkvLayout {
                heads: s.num_heads,
                kv_heads: s.num_kv_heads,
                head_dim: d,
                cos: rope.cos.clone(),
                sin: rope.sin.clone(),
                position: offset,
                norm,
            };
            let width = layout.width();
            cache.attend_decode(s.index, qkv.reshape([batch, width]), &layout, s.scale, s.softcap)
        } else {
            let heads = |first: usize, n: usize| {
                qkv.clone()
                    .slice([0..batch, 0..seq, first * d..(first + n) * d])
                    .reshape([batch, seq, n, d])
                    .swap_dims(1, 2)
            };
            let q = heads(0, s.num_heads);
            let k = heads(s.num_heads, s.num_kv_heads);
            let v = heads(s.num_heads + s.num_kv_heads, s.num_kv_heads);
            let norm = |n: &Option<RmsNorm<B>>| n.as_ref().map(|n| (n.weight.val(), n.eps));
            let q = B::rope(q, rope.cos.clone(), rope.sin.clone(), offset, norm(&self.q_norm));
            let k = B::rope(k, rope.cos.clone(), rope.sin.clone(), offset, norm(&self.k_norm));
            // `[batch, heads, seq, d]` -> `[batch, seq, heads, d]`.
            cache.attend(s.index, q, k, v, s.scale, s.softcap).swap_dims(1, 2)
        };
        // With one position both orders are the same memory, so decode needs no transposing copy.
        self.o_proj.forward(out.reshape([batch, seq, s.num_heads * d]))
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
        dtype: WeightSettings,
        device: &B::Device,
    ) -> Result<Self, ModelError> {
        let prefix = format!("model.layers.{index}");
        let norm = |source: &mut _, name: &str| {
            RmsNorm::load(source, &format!("{prefix}.{name}"), c.hidden_size, c.rms_norm_eps, device)
        };
        let self_attn = Attention::load(source, &format!("{prefix}.self_attn"), index, c, dtype, device)?;
        let mlp = Mlp::load(source, &format!("{prefix}.mlp"), c, dtype, device)?;
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

    /// Runs the layer on `normed` (this layer's input norm already applied) and returns the new
    /// residual and its normalization by `next_norm` (the next layer's input norm, or the final
    /// norm).
    fn forward(
        &self,
        residual: Tensor<B, 3>,
        normed: Tensor<B, 3>,
        next_norm: &RmsNorm<B>,
        cache: &mut KvCache<B>,
        dtype: DType,
    ) -> (Tensor<B, 3>, Tensor<B, 3>) {
        let attn = self.self_attn.forward(normed, cache);
        let (residual, normed) = self.pre_feedforward_layernorm.forward_residual(
            residual,
            attn,
            self.post_attention_layernorm.as_ref(),
            dtype,
        );
        let mlp = self.mlp.forward(normed);
        next_norm.forward_residual(residual, mlp, self.post_feedforward_layernorm.as_ref(), dtype)
    }
}

/// Largest block of the embedding table kept in one device buffer: wgpu's default limit on a
/// storage binding (128 MiB), which every adapter supports.
pub const MAX_CHUNK_BYTES: usize = 1 << 27;

/// The `[vocab, hidden]` embedding table, also the tied lm_head, in row blocks of at most
/// [`MAX_CHUNK_BYTES`] (GPU APIs cap the size of one buffer).
#[derive(Module, Debug)]
pub enum Embedding<B: GemmaBackend> {
    Dense(Vec<Param<Tensor<B, 2>>>),
    /// At least Q8: the table feeds both ends of the model.
    Quantized(Vec<QuantizedMatrix<B>>),
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
        let host = match settings.request() {
            None => None,
            Some(request) => {
                // Q4 is not enough for the table: ask for Q8, or requantize a Q4 checkpoint's.
                let request = request.map(|_| QuantFormat::Q8);
                match source.load_host_quantized(Self::NAME, shape, request, device)? {
                    Some(q) if q.format == QuantFormat::Q4 => {
                        Some(crate::weights::quantize(Self::NAME, &q.dequantize(), shape, QuantFormat::Q8)?)
                    }
                    other => other,
                }
            }
        };
        Ok(match host {
            Some(host) => {
                let rows_per_chunk = (MAX_CHUNK_BYTES / host.cols).max(1);
                Self::Quantized(
                    row_chunks(host.rows, rows_per_chunk)
                        .map(|r| B::upload_quantized(&host.rows_slice(r), device))
                        .collect(),
                )
            }
            None => {
                let rows_per_chunk = (MAX_CHUNK_BYTES / (c.hidden_size * settings.dtype.size())).max(1);
                let blocks = source.load_row_chunks(Self::NAME, shape, rows_per_chunk, settings.dtype, device)?;
                Self::Dense(blocks.into_iter().map(|b| Param::from_tensor(B::pack(b))).collect())
            }
        })
    }

    /// `table[ids] * scale` in `dtype`: `[batch, seq]` -> `[batch, seq, hidden]`.
    fn embed(&self, ids: Tensor<B, 2, Int>, scale: f64, dtype: DType) -> Tensor<B, 3> {
        match self {
            Self::Dense(blocks) => {
                let tables: Vec<Tensor<B, 2>> = blocks.iter().map(|t| t.val()).collect();
                B::embed(&tables, ids, scale)
            }
            Self::Quantized(blocks) => B::embed_quantized(blocks, ids, scale, dtype),
        }
    }

    /// `hidden [n, hidden] @ table^T -> [n, vocab]`, one product per row block.
    fn project(&self, hidden: Tensor<B, 2>) -> Tensor<B, 2> {
        let blocks: Vec<Tensor<B, 2>> = match self {
            Self::Dense(blocks) => blocks.iter().map(|t| B::project(hidden.clone(), t.val())).collect(),
            Self::Quantized(blocks) => blocks.iter().map(|t| B::project_quantized(hidden.clone(), t)).collect(),
        };
        if blocks.len() == 1 {
            blocks.into_iter().next().unwrap_or(hidden)
        } else {
            Tensor::cat(blocks, 1)
        }
    }

    /// Bytes on the device.
    pub fn device_bytes(&self) -> usize {
        match self {
            Self::Dense(blocks) => blocks.iter().map(|b| b.val().shape().num_elements() * b.val().dtype().size()).sum(),
            Self::Quantized(blocks) => blocks.iter().map(|b| b.device_bytes()).sum(),
        }
    }
}

/// A Gemma causal language model with tied embeddings.
#[derive(Module, Debug)]
pub struct Gemma<B: GemmaBackend> {
    pub embed_tokens: Embedding<B>,
    pub layers: Vec<DecoderLayer<B>>,
    pub norm: RmsNorm<B>,
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
            Ok(Self { embed_tokens, layers, norm, config: config.clone(), dtype, kv_cache: KvFormat::Dense(dtype) })
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
        let embedded = self.embed_tokens.embed(ids, self.embed_scale(), self.dtype);
        let mut residual = embedded.cast(DType::F32);
        let first_norm = self.layers.first().map_or(&self.norm, |l| &l.input_layernorm);
        let mut normed = first_norm.forward(residual.clone()).cast(self.dtype);
        for (i, layer) in self.layers.iter().enumerate() {
            let next_norm = self.layers.get(i + 1).map_or(&self.norm, |l| &l.input_layernorm);
            (residual, normed) = layer.forward(residual, normed, next_norm, cache, self.dtype);
        }
        cache.advance(seq);
        Ok(normed)
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
                    (host.dequantize(), Loaded::Host(host))
                } else {
                    (w.clone(), Loaded::Dense(Tensor::<B, 2>::from_data(TensorData::new(w, [inter, hidden]), &device)))
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
