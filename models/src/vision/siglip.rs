//! HF's `SiglipVisionModel` as Gemma 3 uses it: patch embedding (a strided convolution, as one
//! product over the image's patches), learned positions, encoder layers with bidirectional
//! attention, and the final LayerNorm (no pooling head).

use super::config::SiglipConfig;
use crate::{
    projection::{Projection, WeightSettings},
    weights::{WeightKind, WeightSource},
    ModelError,
};
use burn::{
    module::Module,
    tensor::{activation::gelu_approximate, DType, Tensor},
};
use burn_gemma_kernels::{AttentionMask, AttentionOptions, GemmaBackend, HostMatrix, KvView};

/// LayerNorm with weight and bias.
#[derive(Module, Debug)]
pub struct LayerNorm<B: GemmaBackend> {
    pub weight: Tensor<B, 1>,
    pub bias: Tensor<B, 1>,
    #[module(skip)]
    pub eps: f64,
}

impl<B: GemmaBackend> LayerNorm<B> {
    fn load(
        source: &mut impl WeightSource<B>,
        prefix: &str,
        size: usize,
        eps: f64,
        device: &B::Device,
    ) -> Result<Self, ModelError> {
        let mut load =
            |name: &str| source.load(&format!("{prefix}.{name}"), [size], WeightKind::Matrix, DType::F32, device);
        Ok(Self { weight: load("weight")?, bias: load("bias")?, eps })
    }

    /// `[.., size]`, in f32.
    pub fn forward(&self, x: Tensor<B, 3>) -> Tensor<B, 3> {
        let dtype = x.dtype();
        let x = x.cast(DType::F32);
        let mean = x.clone().mean_dim(2);
        let centered = x - mean;
        let var = centered.clone().powi_scalar(2).mean_dim(2);
        let normed = centered / (var + self.eps).sqrt();
        (normed * self.weight.clone().unsqueeze::<3>() + self.bias.clone().unsqueeze::<3>()).cast(dtype)
    }
}

/// A linear layer with a bias (the checkpoint's `{name}.weight` `[out, in]` and `{name}.bias`).
#[derive(Module, Debug)]
pub struct Linear<B: GemmaBackend> {
    pub weight: Projection<B>,
    pub bias: Tensor<B, 1>,
}

impl<B: GemmaBackend> Linear<B> {
    /// Several projections of the same input side by side (`names` with their output sizes).
    fn load(
        source: &mut impl WeightSource<B>,
        names: &[(&str, usize)],
        inp: usize,
        settings: WeightSettings,
        device: &B::Device,
    ) -> Result<Self, ModelError> {
        let weight = Projection::load(source, names, inp, settings, device)?;
        let biases = names
            .iter()
            .map(|&(name, out)| source.load(&format!("{name}.bias"), [out], WeightKind::Matrix, settings.dtype, device))
            .collect::<Result<Vec<Tensor<B, 1>>, _>>()?;
        Ok(Self { weight, bias: Tensor::cat(biases, 0) })
    }

    /// `[batch, seq, in]` -> `[batch, seq, out]`.
    pub fn forward(&self, x: Tensor<B, 3>) -> Tensor<B, 3> {
        let y = self.weight.forward(x);
        let bias = self.bias.clone().cast(y.dtype()).unsqueeze::<3>();
        y + bias
    }
}

/// One encoder layer: pre-norm bidirectional attention and MLP, each added to the residual.
#[derive(Module, Debug)]
pub struct SiglipEncoderLayer<B: GemmaBackend> {
    pub layer_norm1: LayerNorm<B>,
    /// `q_proj | k_proj | v_proj`.
    pub qkv_proj: Linear<B>,
    pub out_proj: Linear<B>,
    pub layer_norm2: LayerNorm<B>,
    pub fc1: Linear<B>,
    pub fc2: Linear<B>,
    #[module(skip)]
    pub heads: usize,
}

impl<B: GemmaBackend> SiglipEncoderLayer<B> {
    fn load(
        source: &mut impl WeightSource<B>,
        prefix: &str,
        c: &SiglipConfig,
        settings: WeightSettings,
        device: &B::Device,
    ) -> Result<Self, ModelError> {
        let (h, eps) = (c.hidden_size, c.layer_norm_eps);
        let name = |n: &str| format!("{prefix}.{n}");
        let (q, k, v) = (name("self_attn.q_proj"), name("self_attn.k_proj"), name("self_attn.v_proj"));
        Ok(Self {
            layer_norm1: LayerNorm::load(source, &name("layer_norm1"), h, eps, device)?,
            qkv_proj: Linear::load(source, &[(&q, h), (&k, h), (&v, h)], h, settings, device)?,
            out_proj: Linear::load(source, &[(&name("self_attn.out_proj"), h)], h, settings, device)?,
            layer_norm2: LayerNorm::load(source, &name("layer_norm2"), h, eps, device)?,
            fc1: Linear::load(source, &[(&name("mlp.fc1"), c.intermediate_size)], h, settings, device)?,
            fc2: Linear::load(source, &[(&name("mlp.fc2"), h)], c.intermediate_size, settings, device)?,
            heads: c.num_attention_heads,
        })
    }

    /// `[images, patches, hidden]` -> the same.
    fn forward(&self, x: Tensor<B, 3>) -> Result<Tensor<B, 3>, ModelError> {
        let [n, len, hidden] = x.dims();
        let d = hidden / self.heads;
        let qkv = self.qkv_proj.forward(self.layer_norm1.forward(x.clone()));
        let heads = |i: usize| {
            qkv.clone()
                .slice([0..n, 0..len, i * hidden..(i + 1) * hidden])
                .reshape([n, len, self.heads, d])
                .swap_dims(1, 2)
        };
        // Every patch attends to every patch: a causal mask whose first query sits past the
        // last key.
        let options = AttentionOptions {
            mask: AttentionMask { q_offset: len - 1, k_offset: 0, window: None },
            scale: (d as f64).powf(-0.5),
            softcap: None,
        };
        let out = B::grouped_attention(heads(0), KvView::Dense { keys: heads(1), values: heads(2) }, &options)?;
        let out = self.out_proj.forward(out.swap_dims(1, 2).reshape([n, len, hidden]));
        let x = x + out;
        let h = self.fc2.forward(gelu_approximate(self.fc1.forward(self.layer_norm2.forward(x.clone()))));
        Ok(x + h)
    }
}

/// The tower: `[images, 3, size, size]` pixels -> `[images, patches, hidden]`.
#[derive(Module, Debug)]
pub struct SiglipVisionModel<B: GemmaBackend> {
    /// The convolution's kernel as a projection `[hidden, 3 * patch * patch]`, and its bias.
    /// Multiplied by the crate's products, not Burn's matmul: CUDA's f32 matmul rounds through
    /// TF32, which put the fixture's features 1.2e-3 from HF's on the H200.
    pub patch_embedding: Projection<B>,
    pub patch_bias: Tensor<B, 1>,
    /// `[patches, hidden]`.
    pub position_embedding: Tensor<B, 2>,
    pub layers: Vec<SiglipEncoderLayer<B>>,
    pub post_layernorm: LayerNorm<B>,
    #[module(skip)]
    pub patch_size: usize,
}

impl<B: GemmaBackend> SiglipVisionModel<B> {
    pub(crate) fn load(
        source: &mut impl WeightSource<B>,
        prefix: &str,
        c: &SiglipConfig,
        settings: WeightSettings,
        device: &B::Device,
    ) -> Result<Self, ModelError> {
        let (h, p, dtype) = (c.hidden_size, c.patch_size, settings.dtype);
        let patches = c.patches_per_side() * c.patches_per_side();
        let emb = format!("{prefix}.embeddings");
        let kernel: Tensor<B, 4> = source.load(
            &format!("{emb}.patch_embedding.weight"),
            [h, c.num_channels, p, p],
            WeightKind::Matrix,
            dtype,
            device,
        )?;
        let kernel = B::upload_matrix(HostMatrix::Dense(kernel.reshape([h, c.num_channels * p * p])), device)
            .map_err(|source| ModelError::Upload { name: format!("{emb}.patch_embedding.weight"), source })?;
        Ok(Self {
            patch_embedding: Projection { weight: kernel },
            patch_bias: source.load(&format!("{emb}.patch_embedding.bias"), [h], WeightKind::Matrix, dtype, device)?,
            position_embedding: source.load(
                &format!("{emb}.position_embedding.weight"),
                [patches, h],
                WeightKind::Matrix,
                dtype,
                device,
            )?,
            layers: (0..c.num_hidden_layers)
                .map(|i| SiglipEncoderLayer::load(source, &format!("{prefix}.encoder.layers.{i}"), c, settings, device))
                .collect::<Result<_, _>>()?,
            post_layernorm: LayerNorm::load(source, &format!("{prefix}.post_layernorm"), h, c.layer_norm_eps, device)?,
            patch_size: p,
        })
    }

    /// # Shapes
    /// - `pixels`: `[images, 3, size, size]`, normalized as the image processor does
    /// - returns `[images, patches, hidden]`, patches row by row
    pub fn forward(&self, pixels: Tensor<B, 4>) -> Result<Tensor<B, 3>, ModelError> {
        let [n, channels, height, width] = pixels.dims();
        let p = self.patch_size;
        let (rows, cols) = (height / p, width / p);
        // `[n, c, rows, p, cols, p]` -> `[n, rows, cols, c, p, p]`: each patch as the kernel
        // reads it (channel, then kernel row, then kernel column).
        let patches = pixels
            .cast(self.patch_bias.dtype())
            .reshape([n * channels * rows, p, cols, p])
            .swap_dims(1, 2)
            .reshape([n, channels, rows * cols, p * p])
            .swap_dims(1, 2)
            .reshape([n, rows * cols, channels * p * p]);
        let hidden = self.patch_bias.dims()[0];
        let embedded = self.patch_embedding.forward(patches)
            + self.patch_bias.clone().unsqueeze::<3>()
            + self.position_embedding.clone().unsqueeze::<3>();
        let mut x = embedded.reshape([n, rows * cols, hidden]);
        for layer in &self.layers {
            x = layer.forward(x)?;
        }
        Ok(self.post_layernorm.forward(x))
    }
}
