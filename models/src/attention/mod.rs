//! One attention layer end to end, for prefill and decode alike: the `q | k | v` projection,
//! QK-norm and RoPE, the cache append, attention, and the output projection (HF's
//! `Gemma3Attention.forward`).

pub mod cache;
pub mod ring;

pub use cache::{KvCache, LayerCache, Scores};

use crate::{norm::RmsNorm, projection::Projection, projection::WeightSettings, GemmaConfig, ModelError};
use crate::{weights::WeightSource, LayerType};
use burn::{module::Module, tensor::Tensor};
use burn_gemma_kernels::{GemmaBackend, QkvLayout, RopeTables, StepPosition};

/// Shape and behaviour of one attention layer, from the config.
#[derive(Debug, Clone)]
pub struct AttentionSettings {
    pub layer_type: LayerType,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub scores: Scores,
}

/// Multi-head attention with grouped KV heads, RoPE and (Gemma 3) QK-norm.
#[derive(Module, Debug)]
pub struct Attention<B: GemmaBackend> {
    /// `q_proj`, `k_proj` and `v_proj` side by side: `[batch, seq, (heads + 2 kv_heads) * head_dim]`.
    pub qkv_proj: Projection<B>,
    pub o_proj: Projection<B>,
    pub q_norm: Option<RmsNorm<B>>,
    pub k_norm: Option<RmsNorm<B>>,
    #[module(skip)]
    pub settings: AttentionSettings,
}

impl<B: GemmaBackend> Attention<B> {
    pub(crate) fn load(
        source: &mut impl WeightSource<B>,
        prefix: &str,
        index: usize,
        c: &GemmaConfig,
        settings: WeightSettings,
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
        let name = |p: &str| format!("{prefix}.{p}");
        let (q, k, v, o) = (name("q_proj"), name("k_proj"), name("v_proj"), name("o_proj"));
        let qkv = [(q.as_str(), heads * d), (k.as_str(), kv_heads * d), (v.as_str(), kv_heads * d)];
        Ok(Self {
            qkv_proj: Projection::load(source, &qkv, hidden, settings, device)?,
            o_proj: Projection::load(source, &[(&o, hidden)], heads * d, settings, device)?,
            q_norm: qk_norm(source, "q_norm")?,
            k_norm: qk_norm(source, "k_norm")?,
            settings: AttentionSettings {
                layer_type: c.layer_types[index],
                num_heads: heads,
                num_kv_heads: kv_heads,
                head_dim: d,
                scores: Scores { scale: c.query_pre_attn_scalar.powf(-0.5), softcap: c.attn_logit_softcapping },
            },
        })
    }

    /// `[batch, seq, hidden]` at positions `position..position + seq` -> `[batch, seq, hidden]`,
    /// appending this layer's keys and values to `cache`; `rope`: the tables of the layer type.
    /// A position on the device (a replayed decode step) is read by the kernels there.
    pub fn forward(
        &self,
        x: Tensor<B, 3>,
        rope: &RopeTables<B>,
        cache: &mut LayerCache<B>,
        position: &StepPosition<B>,
    ) -> Tensor<B, 3> {
        let s = &self.settings;
        let [batch, seq, _] = x.dims();
        let qkv = self.qkv_proj.forward(x);
        let out = if seq == 1 {
            // Decode: one kernel splits, normalizes, rotates and appends. With one position the
            // `[batch, heads, 1, d]` result is already in `[batch, 1, heads, d]` order.
            let layout = QkvLayout {
                heads: s.num_heads,
                kv_heads: s.num_kv_heads,
                head_dim: s.head_dim,
                rope: rope.clone(),
                position: position.clone(),
                norm: self.qk_norm_weights(),
            };
            let width = layout.width();
            cache.decode(qkv.reshape([batch, width]), &layout, s.scores)
        } else {
            let d = s.head_dim;
            let position = position.resolve();
            // `[batch, seq, n * d]` -> `[batch, n, seq, d]`.
            let heads = |first: usize, n: usize| {
                qkv.clone()
                    .slice([0..batch, 0..seq, first * d..(first + n) * d])
                    .reshape([batch, seq, n, d])
                    .swap_dims(1, 2)
            };
            let norm = |n: &Option<RmsNorm<B>>| n.as_ref().map(|n| (n.weight.val(), n.eps));
            let q = B::qk_norm_rope(heads(0, s.num_heads), rope, position, norm(&self.q_norm));
            let k = B::qk_norm_rope(heads(s.num_heads, s.num_kv_heads), rope, position, norm(&self.k_norm));
            let v = heads(s.num_heads + s.num_kv_heads, s.num_kv_heads);
            cache.prefill(q, k, v, position, s.scores).swap_dims(1, 2)
        };
        self.o_proj.forward(out.reshape([batch, seq, s.num_heads * s.head_dim]))
    }

    /// QK-norm weights `(q, k, eps)` where the layer has them.
    fn qk_norm_weights(&self) -> Option<(Tensor<B, 1>, Tensor<B, 1>, f64)> {
        match (&self.q_norm, &self.k_norm) {
            (Some(q), Some(k)) => Some((q.weight.val(), k.weight.val(), q.eps)),
            _ => None,
        }
    }
}
