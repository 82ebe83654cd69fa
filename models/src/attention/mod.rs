//! One attention layer end to end, for prefill and decode alike: the `q | k | v` projection,
//! QK-norm and RoPE, the cache append, attention, and the output projection (HF's
//! `Gemma3Attention.forward`).

pub mod cache;
pub mod paged;
pub mod rewind;
pub mod ring;

pub use cache::{KvCache, LayerCache, QueryRows, Scores, StoredRows};
pub use paged::{BlockSet, BlockShortfall, PagedLayout, Reservation};
pub use rewind::RewindPoint;
pub use ring::WindowStore;

use crate::{norm::RmsNorm, projection::Projection, projection::WeightSettings, GemmaConfig, ModelError};
use crate::{weights::WeightSource, Architecture, LayerType};
use burn::{module::Module, tensor::Tensor};
use burn_gemma_kernels::{GemmaBackend, HeadNorms, KvRows, QkvLayout, RopeTables, StepPosition, ValueNorm};

/// Where a layer's attention finds its keys and values.
#[derive(Debug)]
pub enum LayerKv<'a, B: GemmaBackend> {
    /// Its cache (a KV-sharing layer: the one of the layer it shares): a layer with keys of
    /// its own writes the step's positions there; the step attends over them and the earlier
    /// positions.
    Cache(&'a mut LayerCache<B>),
    /// Another model's layer cache, read only: the step's one position attends over the
    /// positions before it (a Gemma 4 assistant over its target's cache, HF's
    /// `shared_kv_states`).
    Before(&'a LayerCache<B>),
}

/// Shape and behaviour of one attention layer, from the config.
#[derive(Debug, Clone)]
pub struct AttentionSettings {
    pub layer_type: LayerType,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub scores: Scores,
    /// What the projection holds after the queries: keys and values, keys only (Gemma 4's
    /// `attention_k_eq_v`), or nothing (a KV-sharing layer).
    pub kv: KvRows,
}

/// Multi-head attention with grouped KV heads, RoPE and (Gemma 3 and 4) QK-norm.
#[derive(Module, Debug)]
pub struct Attention<B: GemmaBackend> {
    /// `q_proj`, `k_proj` and `v_proj` side by side: `[batch, seq, (heads + 2 kv_heads) * head_dim]`
    /// (no `v_proj` where the values are the keys, only `q_proj` on KV-sharing layers).
    pub qkv_proj: Projection<B>,
    pub o_proj: Projection<B>,
    pub q_norm: Option<RmsNorm<B>>,
    pub k_norm: Option<RmsNorm<B>>,
    /// Gemma 4's weightless value norm.
    pub v_norm: Option<RmsNorm<B>>,
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
        let layer_type = c.layer_types[index];
        let (hidden, d) = (c.hidden_size, c.head_dim_of(layer_type));
        let (heads, kv_heads) = (c.num_attention_heads, c.kv_heads_of(layer_type));
        let kv = if !c.owns_kv(index) {
            KvRows::Shared
        } else if c.values_from_keys(layer_type) {
            KvRows::FromKeys
        } else {
            KvRows::Projected
        };
        let scale = c.model_type.norm_scale();
        let head_norm = |source: &mut _, name: &str, present: bool| -> Result<Option<RmsNorm<B>>, ModelError> {
            if present {
                Ok(Some(RmsNorm::load(source, &format!("{prefix}.{name}"), d, c.rms_norm_eps, scale, device)?))
            } else {
                Ok(None)
            }
        };
        let name = |p: &str| format!("{prefix}.{p}");
        let (q, k, v, o) = (name("q_proj"), name("k_proj"), name("v_proj"), name("o_proj"));
        let (q_rows, k_rows, v_rows) =
            ((q.as_str(), heads * d), (k.as_str(), kv_heads * d), (v.as_str(), kv_heads * d));
        let qkv: &[(&str, usize)] = match kv {
            KvRows::Projected => &[q_rows, k_rows, v_rows],
            KvRows::FromKeys => &[q_rows, k_rows],
            KvRows::Shared => &[q_rows],
        };
        let has_qk_norm = c.model_type.has_qk_norm();
        let owns_kv = kv != KvRows::Shared;
        Ok(Self {
            qkv_proj: Projection::load(source, qkv, hidden, settings, device)?,
            o_proj: Projection::load(source, &[(&o, hidden)], heads * d, settings, device)?,
            q_norm: head_norm(source, "q_norm", has_qk_norm)?,
            k_norm: head_norm(source, "k_norm", has_qk_norm && owns_kv)?,
            v_norm: (c.model_type == Architecture::Gemma4 && owns_kv).then(|| RmsNorm::unit(d, c.rms_norm_eps, device)),
            settings: AttentionSettings {
                layer_type,
                num_heads: heads,
                num_kv_heads: kv_heads,
                head_dim: d,
                scores: Scores { scale: c.query_pre_attn_scalar.powf(-0.5), softcap: c.attn_logit_softcapping },
                kv,
            },
        })
    }

    /// `[batch, seq, hidden]` at positions `position..position + seq` -> `[batch, seq, hidden]`,
    /// appending this layer's keys and values to the cache of `kv` (a KV-sharing layer gets the
    /// cache of the layer it shares, which ran before it, and appends nothing; see [`LayerKv`]);
    /// `rope`: the tables of the layer type. A position on the device (a replayed decode step)
    /// is read by the kernels there.
    pub fn forward(
        &self,
        x: Tensor<B, 3>,
        rope: &RopeTables<B>,
        kv: LayerKv<'_, B>,
        position: &StepPosition<B>,
    ) -> Result<Tensor<B, 3>, ModelError> {
        let s = &self.settings;
        let [batch, seq, _] = x.dims();
        let qkv = self.qkv_proj.forward(x);
        let cache = match kv {
            LayerKv::Cache(cache) => cache,
            LayerKv::Before(cache) => {
                if seq != 1 || s.kv != KvRows::Shared {
                    return Err(ModelError::InvalidInput(format!(
                        "attention over another model's cache takes one position of a layer without keys of its \
                         own; got {seq} positions"
                    )));
                }
                let position = position.resolve()?;
                let q = qkv.reshape([batch, 1, s.num_heads, s.head_dim]).swap_dims(1, 2);
                let norm = self.q_norm.as_ref().map(|n| (n.weight.val(), n.eps));
                let q = B::qk_norm_rope(q, rope, position, norm);
                let out = cache.attend_before(q, position, s.scores)?;
                return Ok(self.o_proj.forward(out.reshape([batch, 1, s.num_heads * s.head_dim])));
            }
        };
        let out = if seq == 1 {
            // Decode: one kernel splits, normalizes, rotates and appends. With one position the
            // `[batch, heads, 1, d]` result is already in `[batch, 1, heads, d]` order.
            let layout = QkvLayout {
                heads: s.num_heads,
                kv_heads: s.num_kv_heads,
                head_dim: s.head_dim,
                kv: s.kv,
                rope: rope.clone(),
                position: position.clone(),
                norm: self.head_norms(),
                blocks: cache.blocks(),
            };
            let width = layout.width();
            cache.decode(qkv.reshape([batch, width]), &layout, s.scores)?
        } else {
            let d = s.head_dim;
            let position = position.resolve()?;
            // `[batch, seq, n * d]` -> `[batch, n, seq, d]`.
            let heads = |first: usize, n: usize| {
                qkv.clone()
                    .slice([0..batch, 0..seq, first * d..(first + n) * d])
                    .reshape([batch, seq, n, d])
                    .swap_dims(1, 2)
            };
            let norm = |n: &Option<RmsNorm<B>>| n.as_ref().map(|n| (n.weight.val(), n.eps));
            let q = B::qk_norm_rope(heads(0, s.num_heads), rope, position, norm(&self.q_norm));
            let values = match s.kv {
                KvRows::Shared => None,
                KvRows::Projected => Some(heads(s.num_heads + s.num_kv_heads, s.num_kv_heads)),
                KvRows::FromKeys => Some(heads(s.num_heads, s.num_kv_heads)),
            };
            match values {
                None => cache.prefill_shared(q, position, seq, s.scores),
                Some(v) => {
                    let k = B::qk_norm_rope(heads(s.num_heads, s.num_kv_heads), rope, position, norm(&self.k_norm));
                    let v = match &self.v_norm {
                        Some(n) => n.forward(v),
                        None => v,
                    };
                    cache.prefill(q, k, v, position, s.scores)
                }
            }?
            .swap_dims(1, 2)
        };
        Ok(self.o_proj.forward(out.reshape([batch, seq, s.num_heads * s.head_dim])))
    }

    /// The per-head norms the decode kernel applies, where the layer has them.
    fn head_norms(&self) -> Option<HeadNorms<B>> {
        let value = if self.v_norm.is_some() { ValueNorm::Unweighted } else { ValueNorm::None };
        match (&self.q_norm, &self.k_norm) {
            (Some(q), Some(k)) => Some(HeadNorms { query: q.weight.val(), key: k.weight.val(), eps: q.eps, value }),
            // A KV-sharing layer normalizes its queries only; the key weight is never read.
            (Some(q), None) => Some(HeadNorms { query: q.weight.val(), key: q.weight.val(), eps: q.eps, value }),
            _ => None,
        }
    }
}
