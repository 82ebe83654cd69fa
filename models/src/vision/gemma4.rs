//! Gemma 4's images: HF 5.23's `Gemma4VisionModel` (patch embedder with a 2-D position table,
//! encoder layers with axial 2-D RoPE, q/k/v norms and bidirectional attention, the pooler that
//! averages `k x k` patches into one soft token, optional standardization) and
//! `Gemma4MultimodalEmbedder` (a scale-free RMSNorm and the projection into the text model's
//! width), as `Gemma4Model.get_image_features` chains them.
//!
//! An image goes in as its patches (each `patch_size x patch_size x 3` values in `[0, 1]`, row
//! by row; see [`Gemma4Patches`]) on a grid whose sides are multiples of `pooling_kernel_size`,
//! one image at a time: HF's padding patches (a batch of images of different sizes) change
//! nothing in an image's features, so none are made here.

use super::gemma4_config::{Gemma4ImageConfig, Gemma4VisionConfig};
use crate::{
    config::NormScale,
    norm::RmsNorm,
    projection::{Projection, WeightSettings},
    weights::{host_values, WeightKind, WeightSource},
    ModelError, ModelOptions,
};
use burn::{
    module::Module,
    tensor::{activation::gelu_approximate, DType, Int, Tensor, TensorData},
};
use burn_gemma_kernels::{AttentionMask, AttentionOptions, GemmaBackend, KvView};

/// One image's patches: `values` is `[rows * cols, patch_size * patch_size * 3]` (each patch's
/// pixels row by row, the three channels of a pixel together, in `[0, 1]`), patches row by row.
#[derive(Debug, Clone)]
pub struct Gemma4Patches<B: GemmaBackend> {
    pub values: Tensor<B, 2>,
    pub rows: usize,
    pub cols: usize,
}

/// Bounds a clipped linear layer clamps its input and output to (HF's `Gemma4ClippableLinear`
/// buffers `input_min`, `input_max`, `output_min`, `output_max`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Clip {
    pub input: (f32, f32),
    pub output: (f32, f32),
}

/// A linear layer without bias (`{name}.linear.weight`), clamped where the config says so.
#[derive(Module, Debug)]
pub struct ClippableLinear<B: GemmaBackend> {
    pub linear: Projection<B>,
    #[module(skip)]
    pub clip: Option<Clip>,
}

impl<B: GemmaBackend> ClippableLinear<B> {
    fn load(
        source: &mut impl WeightSource<B>,
        name: &str,
        [out, inp]: [usize; 2],
        clipped: bool,
        settings: WeightSettings,
        device: &B::Device,
    ) -> Result<Self, ModelError> {
        let linear = Projection::load(source, &[(&format!("{name}.linear"), out)], inp, settings, device)?;
        let clip = if clipped {
            let mut bound = |what: &str| -> Result<f32, ModelError> {
                let full = format!("{name}.{what}");
                let t: Tensor<B, 1> = source.load(&full, [1], WeightKind::Scale, DType::F32, device)?;
                match host_values(t, &full)?.first().copied() {
                    Some(v) if !v.is_nan() => Ok(v),
                    other => Err(ModelError::Source(format!("{full} is not a bound: {other:?}").into())),
                }
            };
            Some(Clip {
                input: (bound("input_min")?, bound("input_max")?),
                output: (bound("output_min")?, bound("output_max")?),
            })
        } else {
            None
        };
        Ok(Self { linear, clip })
    }

    /// `[batch, seq, in]` -> `[batch, seq, out]`.
    pub fn forward(&self, x: Tensor<B, 3>) -> Tensor<B, 3> {
        match self.clip {
            None => self.linear.forward(x),
            Some(Clip { input, output }) => self.linear.forward(x.clamp(input.0, input.1)).clamp(output.0, output.1),
        }
    }
}

/// HF's `Gemma4VisionAttention`: q and k normalized per head and turned by the axial RoPE, v
/// normalized without a scale, every patch attending to every patch (scale 1).
#[derive(Module, Debug)]
pub struct Gemma4VisionAttention<B: GemmaBackend> {
    pub q_proj: ClippableLinear<B>,
    pub k_proj: ClippableLinear<B>,
    pub v_proj: ClippableLinear<B>,
    pub o_proj: ClippableLinear<B>,
    pub q_norm: RmsNorm<B>,
    pub k_norm: RmsNorm<B>,
    pub v_norm: RmsNorm<B>,
    #[module(skip)]
    pub heads: usize,
    #[module(skip)]
    pub kv_heads: usize,
    #[module(skip)]
    pub head_dim: usize,
}

/// HF's `Gemma4VisionMLP`: `down(gelu_tanh(gate(x)) * up(x))`.
#[derive(Module, Debug)]
pub struct Gemma4VisionMlp<B: GemmaBackend> {
    pub gate_proj: ClippableLinear<B>,
    pub up_proj: ClippableLinear<B>,
    pub down_proj: ClippableLinear<B>,
}

/// HF's `Gemma4VisionEncoderLayer`: norms before and after attention and MLP (scaled by `w`).
#[derive(Module, Debug)]
pub struct Gemma4VisionEncoderLayer<B: GemmaBackend> {
    pub self_attn: Gemma4VisionAttention<B>,
    pub mlp: Gemma4VisionMlp<B>,
    pub input_layernorm: RmsNorm<B>,
    pub post_attention_layernorm: RmsNorm<B>,
    pub pre_feedforward_layernorm: RmsNorm<B>,
    pub post_feedforward_layernorm: RmsNorm<B>,
}

/// The cosines and sines of the axial RoPE for one image's patches, `[1, patches, 1, head_dim]`
/// each: the first half of a head turns by the patch's column, the second by its row (HF's
/// `Gemma4VisionRotaryEmbedding` and `apply_multidimensional_rope`).
struct AxialRope<B: GemmaBackend> {
    cos: Tensor<B, 4>,
    sin: Tensor<B, 4>,
}

impl<B: GemmaBackend> AxialRope<B> {
    fn new(rows: usize, cols: usize, head_dim: usize, theta: f64, dtype: DType, device: &B::Device) -> Self {
        let quarter = head_dim / 4;
        // HF: `1 / theta^(arange(0, head_dim / 2, 2) / (head_dim / 2))`, in f32.
        let inv_freq: Vec<f32> =
            (0..quarter).map(|j| (1.0 / theta.powf((2 * j) as f64 / (head_dim / 2) as f64)) as f32).collect();
        let n = rows * cols;
        let (mut cos, mut sin) = (Vec::with_capacity(n * head_dim), Vec::with_capacity(n * head_dim));
        for patch in 0..n {
            let (x, y) = ((patch % cols) as f32, (patch / cols) as f32);
            // Halves `[x, x]` then `[y, y]`: each half rotated as `rotate_half` pairs them.
            for position in [x, x, y, y] {
                for &f in &inv_freq {
                    let angle = position * f;
                    cos.push(angle.cos());
                    sin.push(angle.sin());
                }
            }
        }
        let table = |v: Vec<f32>| {
            Tensor::<B, 1>::from_data(TensorData::new(v, [n * head_dim]), (device, DType::F32))
                .reshape([1, n, 1, head_dim])
                .cast(dtype)
        };
        Self { cos: table(cos), sin: table(sin) }
    }

    /// `x` `[batch, patches, heads, head_dim]` turned.
    fn apply(&self, x: Tensor<B, 4>) -> Tensor<B, 4> {
        let [b, n, h, d] = x.dims();
        let q = d / 4;
        let part = |i: usize| x.clone().slice([0..b, 0..n, 0..h, i * q..(i + 1) * q]);
        // Per half, `rotate_half`: `[-second, first]`.
        let rotated = Tensor::cat(vec![part(1).neg(), part(0), part(3).neg(), part(2)], 3);
        x * self.cos.clone() + rotated * self.sin.clone()
    }
}

impl<B: GemmaBackend> Gemma4VisionEncoderLayer<B> {
    fn load(
        source: &mut impl WeightSource<B>,
        prefix: &str,
        c: &Gemma4VisionConfig,
        settings: WeightSettings,
        device: &B::Device,
    ) -> Result<Self, ModelError> {
        let (h, d, eps, clipped) = (c.hidden_size, c.head_dim, c.rms_norm_eps, c.use_clipped_linears);
        let name = |n: &str| format!("{prefix}.{n}");
        let mut linear =
            |n: &str, shape: [usize; 2]| ClippableLinear::load(source, &name(n), shape, clipped, settings, device);
        let (q_out, kv_out) = (c.num_attention_heads * d, c.num_key_value_heads * d);
        let q_proj = linear("self_attn.q_proj", [q_out, h])?;
        let k_proj = linear("self_attn.k_proj", [kv_out, h])?;
        let v_proj = linear("self_attn.v_proj", [kv_out, h])?;
        let o_proj = linear("self_attn.o_proj", [h, q_out])?;
        let gate_proj = linear("mlp.gate_proj", [c.intermediate_size, h])?;
        let up_proj = linear("mlp.up_proj", [c.intermediate_size, h])?;
        let down_proj = linear("mlp.down_proj", [h, c.intermediate_size])?;
        let mut norm = |n: &str, size: usize| RmsNorm::load(source, &name(n), size, eps, NormScale::Weight, device);
        Ok(Self {
            self_attn: Gemma4VisionAttention {
                q_proj,
                k_proj,
                v_proj,
                o_proj,
                q_norm: norm("self_attn.q_norm", d)?,
                k_norm: norm("self_attn.k_norm", d)?,
                v_norm: RmsNorm::unit(d, eps, device),
                heads: c.num_attention_heads,
                kv_heads: c.num_key_value_heads,
                head_dim: d,
            },
            mlp: Gemma4VisionMlp { gate_proj, up_proj, down_proj },
            input_layernorm: norm("input_layernorm", h)?,
            post_attention_layernorm: norm("post_attention_layernorm", h)?,
            pre_feedforward_layernorm: norm("pre_feedforward_layernorm", h)?,
            post_feedforward_layernorm: norm("post_feedforward_layernorm", h)?,
        })
    }

    /// `[1, patches, hidden]` -> the same.
    fn forward(&self, x: Tensor<B, 3>, rope: &AxialRope<B>) -> Result<Tensor<B, 3>, ModelError> {
        let a = &self.self_attn;
        let [b, n, _] = x.dims();
        let h = self.input_layernorm.forward(x.clone());
        let split = |t: Tensor<B, 3>, heads: usize| t.reshape([b, n, heads, a.head_dim]);
        let q = rope.apply(a.q_norm.forward(split(a.q_proj.forward(h.clone()), a.heads))).swap_dims(1, 2);
        let k = rope.apply(a.k_norm.forward(split(a.k_proj.forward(h.clone()), a.kv_heads))).swap_dims(1, 2);
        let v = a.v_norm.forward(split(a.v_proj.forward(h), a.kv_heads)).swap_dims(1, 2);
        // Every patch attends to every patch: a causal mask whose first query sits past the
        // last key. q and k are normalized: scale 1.
        let options = AttentionOptions {
            mask: AttentionMask { q_offset: n - 1, k_offset: 0, window: None },
            scale: 1.0,
            softcap: None,
        };
        let out = B::grouped_attention(q, KvView::Dense { keys: k, values: v }, &options)?;
        let out = a.o_proj.forward(out.swap_dims(1, 2).reshape([b, n, a.heads * a.head_dim]));
        let x = x + self.post_attention_layernorm.forward(out);
        let h = self.pre_feedforward_layernorm.forward(x.clone());
        let m = &self.mlp;
        let h = m.down_proj.forward(gelu_approximate(m.gate_proj.forward(h.clone())) * m.up_proj.forward(h));
        Ok(x + self.post_feedforward_layernorm.forward(h))
    }
}

/// HF's `Gemma4VisionModel` followed by `Gemma4MultimodalEmbedder` (`model.vision_tower.*`,
/// `model.embed_vision.*`).
#[derive(Module, Debug)]
pub struct Gemma4Vision<B: GemmaBackend> {
    /// `patch_embedder.input_proj`: `[hidden, patch_size^2 * 3]`.
    pub input_proj: Projection<B>,
    /// `patch_embedder.position_embedding_table`: `[2, position_embedding_size, hidden]` (columns,
    /// then rows).
    pub position_embedding_table: Tensor<B, 3>,
    pub layers: Vec<Gemma4VisionEncoderLayer<B>>,
    /// `std_bias` and `std_scale` (`[hidden]`, f32) where the config standardizes.
    pub standardize: Option<(Tensor<B, 1>, Tensor<B, 1>)>,
    /// The embedder's norm (no scale) and projection `[text_hidden, hidden]`.
    pub embedding_pre_projection_norm: RmsNorm<B>,
    pub embedding_projection: Projection<B>,
    #[module(skip)]
    pub config: Gemma4ImageConfig,
}

impl<B: GemmaBackend> Gemma4Vision<B> {
    /// Loads `model.vision_tower.*` and `model.embed_vision.*` (transformers 5.23 names).
    pub fn load(
        config: Gemma4ImageConfig,
        source: &mut impl WeightSource<B>,
        options: &ModelOptions,
        device: &B::Device,
    ) -> Result<Self, ModelError> {
        config.validate()?;
        let settings = WeightSettings { dtype: options.dtype, format: options.weights };
        let c = &config.vision;
        let (h, p) = (c.hidden_size, c.patch_size);
        let tower = "model.vision_tower";
        let input_proj = Projection::load(
            source,
            &[(&format!("{tower}.patch_embedder.input_proj"), h)],
            3 * p * p,
            settings,
            device,
        )?;
        let position_embedding_table = source.load(
            &format!("{tower}.patch_embedder.position_embedding_table"),
            [2, c.position_embedding_size, h],
            WeightKind::Matrix,
            options.dtype,
            device,
        )?;
        let layers = (0..c.num_hidden_layers)
            .map(|i| {
                Gemma4VisionEncoderLayer::load(source, &format!("{tower}.encoder.layers.{i}"), c, settings, device)
            })
            .collect::<Result<_, _>>()?;
        let standardize = if c.standardize {
            let mut load = |n: &str| source.load(&format!("{tower}.{n}"), [h], WeightKind::Scale, DType::F32, device);
            Some((load("std_bias")?, load("std_scale")?))
        } else {
            None
        };
        let embedding_projection = Projection::load(
            source,
            &[("model.embed_vision.embedding_projection", config.text_hidden_size)],
            h,
            settings,
            device,
        )?;
        Ok(Self {
            input_proj,
            position_embedding_table,
            layers,
            standardize,
            embedding_pre_projection_norm: RmsNorm::unit(h, c.rms_norm_eps, device),
            embedding_projection,
            config,
        })
    }

    /// The config.
    pub fn config(&self) -> &Gemma4ImageConfig {
        &self.config
    }

    /// The soft tokens of one image, in the text model's width.
    ///
    /// # Shapes
    /// - `patches.values`: `[rows * cols, patch_size^2 * 3]`
    /// - returns `[(rows / k) * (cols / k), text_hidden]` (`k` the pooling kernel size), pooled
    ///   cells row by row
    pub fn image_features(&self, patches: &Gemma4Patches<B>) -> Result<Tensor<B, 2>, ModelError> {
        let c = &self.config.vision;
        let (rows, cols, k, p) = (patches.rows, patches.cols, c.pooling_kernel_size, c.patch_size);
        let [n, width] = patches.values.dims();
        if n != rows * cols || width != 3 * p * p {
            return Err(ModelError::InvalidInput(format!(
                "{n} patches of {width} values for a {rows} x {cols} grid of {p} x {p} RGB patches"
            )));
        }
        if rows == 0 || cols == 0 || !rows.is_multiple_of(k) || !cols.is_multiple_of(k) {
            return Err(ModelError::InvalidInput(format!(
                "a {rows} x {cols} patch grid does not pool by {k} x {k} (both sides must be positive multiples of {k})"
            )));
        }
        if rows.max(cols) > c.position_embedding_size {
            return Err(ModelError::InvalidInput(format!(
                "a {rows} x {cols} patch grid is past the {} positions of the tower's table",
                c.position_embedding_size
            )));
        }
        let device = patches.values.device();
        let dtype = self.position_embedding_table.dtype();
        let h = c.hidden_size;
        // Patch embedder: pixels to [-1, 1], the projection, and each axis' position row.
        let pixels = patches.values.clone().cast(dtype).mul_scalar(2.0).sub_scalar(1.0);
        let x = self.input_proj.forward(pixels.unsqueeze::<3>());
        let index = |v: Vec<i64>| Tensor::<B, 1, Int>::from_data(TensorData::new(v, [n]), &device);
        let columns = index((0..n).map(|i| (i % cols) as i64).collect());
        let rows_of = index((0..n).map(|i| (i / cols) as i64).collect());
        let table = |axis: usize| {
            self.position_embedding_table
                .clone()
                .slice([axis..axis + 1, 0..c.position_embedding_size, 0..h])
                .reshape([c.position_embedding_size, h])
        };
        let positions = table(0).select(0, columns) + table(1).select(0, rows_of);
        let mut x = x + positions.cast(dtype).unsqueeze::<3>();
        let rope = AxialRope::new(rows, cols, c.head_dim, c.rope_parameters.rope_theta, dtype, &device);
        for layer in &self.layers {
            x = layer.forward(x, &rope)?;
        }
        // Pooler: the mean of each k x k cell, scaled by sqrt(hidden), in f32.
        let pooled = x
            .cast(DType::F32)
            .reshape([rows / k, k, cols / k, k, h])
            .mean_dim(3)
            .mean_dim(1)
            .reshape([(rows / k) * (cols / k), h])
            .mul_scalar((h as f64).sqrt());
        let pooled = match &self.standardize {
            Some((bias, scale)) => (pooled - bias.clone().unsqueeze::<2>()) * scale.clone().unsqueeze::<2>(),
            None => pooled,
        };
        let normed = self.embedding_pre_projection_norm.forward(pooled.cast(dtype));
        let out = self.embedding_projection.forward(normed.unsqueeze::<3>());
        let [_, tokens, text] = out.dims();
        Ok(out.reshape([tokens, text]))
    }
}
