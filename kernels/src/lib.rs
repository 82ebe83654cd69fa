//! Backend extension for Gemma inference.
//!
//! [`GemmaBackend`] has one method per hot operation of a Gemma forward pass. Every method has a
//! default implementation written with plain Burn tensor operations (the *reference*, which lives
//! next to each operation in its own module). CPU backends (NdArray, Candle) use the references;
//! the CubeCL backends (`CubeBackend<R, F, I, BT>`: CUDA, ROCm/HIP, wgpu) get the same trait from
//! one implementation generic over the runtime, so kernels are written once for every GPU API.
//!
//! GPU backends are used *unfused* (`CubeBackend`, not `Fusion<CubeBackend>`): the hot paths are
//! covered by hand-written kernels here, and an unfused backend lets us hand primitive tensors
//! straight to those kernels without going through the fusion stream.
//!
//! Conventions shared by all operations:
//! - RMSNorm weights use the Hugging Face convention: the scale applied is `1 + w`.
//! - Attention tensors are `[batch, heads, seq, head_dim]`.
//! - Normalization and softmax accumulate in f32 whatever the activation dtype.

#[cfg(test)]
#[macro_use]
pub(crate) mod gpu_test;

pub mod attention;
pub mod embedding;
pub mod gelu;
pub mod kv_quant;
pub mod linear;
pub mod qkv;
pub mod quant;
pub mod rms_norm;
pub mod rope;
pub mod sampling;
pub mod softcap;

mod backends;
mod cube;

pub use attention::AttentionMask;
pub use kv_quant::Int8Kv;
pub use qkv::{KvStore, QkvLayout};
pub use quant::{HostQuantized, QuantFormat, QuantizedMatrix};
pub use sampling::SamplingParams;

use burn::tensor::{backend::Backend, Int, Tensor};

/// The operations a Gemma forward pass accelerates.
///
/// Implemented for every backend the crate supports; see the crate docs.
pub trait GemmaBackend: Backend {
    /// `x [n, in] @ weight[out, in]^T -> [n, out]`, the weight in its checkpoint layout.
    fn project(x: Tensor<Self, 2>, weight: Tensor<Self, 2>) -> Tensor<Self, 2> {
        linear::reference(x, weight)
    }

    /// Uploads a host-quantized matrix in the code layout this backend's kernels read (the
    /// reference keeps one `U8` code per weight and f32 scales).
    fn upload_quantized(host: &HostQuantized, device: &Self::Device) -> QuantizedMatrix<Self> {
        QuantizedMatrix::upload(host, false, burn::tensor::DType::F32, device)
    }

    /// `x [n, in] @ dequantize(weight)^T -> [n, out]` in `x`'s dtype, `weight` from
    /// [`GemmaBackend::upload_quantized`].
    fn project_quantized(x: Tensor<Self, 2>, weight: &QuantizedMatrix<Self>) -> Tensor<Self, 2> {
        quant::project_reference(x, weight)
    }

    /// [`GemmaBackend::embed`] over a quantized table, returning `dtype`.
    fn embed_quantized(
        table: &[QuantizedMatrix<Self>],
        ids: Tensor<Self, 2, Int>,
        scale: f64,
        dtype: burn::tensor::DType,
    ) -> Tensor<Self, 3> {
        quant::embed_reference(table, ids, scale, dtype)
    }

    /// `gelu_tanh(gate) * up` straight from the joined gate/up product: `weight` `[2m, in]` holds
    /// the gate and up rows interleaved in blocks of [`gelu::PAIR_BLOCK`]
    /// ([`gelu::interleave_pairs`], `m` a multiple of it); `x [n, in]` -> `[n, m]`.
    fn project_gelu_pairs(x: Tensor<Self, 2>, weight: Tensor<Self, 2>) -> Tensor<Self, 2> {
        gelu::pairs_reference(Self::project(x, weight))
    }

    /// [`GemmaBackend::project_gelu_pairs`] through a quantized matrix whose rows are interleaved
    /// likewise ([`HostQuantized::interleave_pairs`]).
    fn project_quantized_gelu_pairs(x: Tensor<Self, 2>, weight: &QuantizedMatrix<Self>) -> Tensor<Self, 2> {
        gelu::pairs_reference(Self::project_quantized(x, weight))
    }

    /// RMSNorm over the last dimension: `x * rsqrt(mean(x^2) + eps) * (1 + weight)`, computed in
    /// f32 and returned in `x`'s dtype.
    ///
    /// - `x`: `[..., n]`, `weight`: `[n]` (f32).
    fn rms_norm<const D: usize>(x: Tensor<Self, D>, weight: Tensor<Self, 1>, eps: f64) -> Tensor<Self, D> {
        rms_norm::reference(x, weight, eps)
    }

    /// Residual add fused with RMSNorm: returns `(residual + x, rms_norm(residual + x))`.
    ///
    /// - `residual`: `[batch, seq, hidden]` in f32 (the residual stream);
    /// - `x`: `[batch, seq, hidden]` in the activation dtype;
    /// - `x_weight`: a norm applied to `x` first (Gemma 2/3's post-attention and post-MLP norms),
    ///   its output rounded to `x`'s dtype; both norms use `eps`;
    /// - returns the new residual (f32) and the normalized value cast to `out_dtype`.
    fn add_rms_norm(
        residual: Tensor<Self, 3>,
        x: Tensor<Self, 3>,
        x_weight: Option<Tensor<Self, 1>>,
        weight: Tensor<Self, 1>,
        eps: f64,
        out_dtype: burn::tensor::DType,
    ) -> (Tensor<Self, 3>, Tensor<Self, 3>) {
        rms_norm::add_reference(residual, x, x_weight, weight, eps, out_dtype)
    }

    /// `gelu_tanh(gate) * up`, elementwise. Shapes `[batch, seq, intermediate]`.
    fn gelu_mul(gate: Tensor<Self, 3>, up: Tensor<Self, 3>) -> Tensor<Self, 3> {
        gelu::reference(gate, up)
    }

    /// [`GemmaBackend::gelu_mul`] of a joined gate/up projection: `x` is `[batch, seq, 2m]`
    /// (gate in the first `m` columns, up in the last `m`); returns `[batch, seq, m]`.
    fn gelu_mul_halves(x: Tensor<Self, 3>) -> Tensor<Self, 3> {
        gelu::halves_reference(x)
    }

    /// Rotary position embedding (rotate-half layout), optionally preceded by a per-head RMSNorm
    /// (Gemma 3's QK-norm).
    ///
    /// - `x`: `[batch, heads, seq, head_dim]`;
    /// - `cos`, `sin`: `[max_positions, head_dim / 2]` (f32) tables, theta and scaling applied;
    /// - `offset`: absolute position of `x`'s first row;
    /// - `norm`: `(weight [head_dim], eps)` for QK-norm.
    fn rope(
        x: Tensor<Self, 4>,
        cos: Tensor<Self, 2>,
        sin: Tensor<Self, 2>,
        offset: usize,
        norm: Option<(Tensor<Self, 1>, f64)>,
    ) -> Tensor<Self, 4> {
        rope::reference(x, cos, sin, offset, norm)
    }

    /// One decode position of an attention layer after its joined `q | k | v` projection:
    /// QK-norm and RoPE on queries and keys, keys and values written into slot `slot` of
    /// `store`, in one pass (see [`qkv`]).
    ///
    /// - `qkv`: `[batch, layout.width()]`, one position per sequence;
    /// - returns the queries `[batch, heads, 1, head_dim]` in `qkv`'s dtype, and the store.
    fn qkv_rope_append(
        qkv: Tensor<Self, 2>,
        layout: &QkvLayout<Self>,
        store: KvStore<Self>,
        slot: usize,
    ) -> (Tensor<Self, 4>, KvStore<Self>) {
        qkv::reference(qkv, layout, store, slot)
    }

    /// `tanh(x / cap) * cap`, elementwise.
    fn softcap<const D: usize>(x: Tensor<Self, D>, cap: f64) -> Tensor<Self, D> {
        softcap::reference(x, cap)
    }

    /// Embedding gather scaled by `scale`: `table[ids] * scale`, in the table's dtype.
    ///
    /// - `table`: the `[vocab, hidden]` table as consecutive row blocks (GPU APIs cap the size
    ///   of one buffer); `ids`: `[batch, seq]`; returns `[batch, seq, hidden]`.
    fn embed(table: &[Tensor<Self, 2>], ids: Tensor<Self, 2, Int>, scale: f64) -> Tensor<Self, 3> {
        embedding::reference(table, ids, scale)
    }

    /// Scaled dot-product attention with grouped KV heads, causal and sliding-window masking and
    /// optional logit softcapping. Softmax in f32.
    ///
    /// - `q`: `[batch, q_heads, q_len, head_dim]`;
    /// - `k`, `v`: `[batch, kv_heads, k_len, head_dim]` with `q_heads % kv_heads == 0`;
    /// - returns `[batch, q_heads, q_len, head_dim]`.
    fn grouped_attention(
        q: Tensor<Self, 4>,
        k: Tensor<Self, 4>,
        v: Tensor<Self, 4>,
        mask: AttentionMask,
        scale: f64,
        softcap: Option<f64>,
    ) -> Tensor<Self, 4> {
        attention::reference(q, k, v, mask, scale, softcap)
    }

    /// An int8 KV store of `shape` = `[batch, kv_heads, slots, head_dim]` (`head_dim` a
    /// multiple of 4), every slot zero.
    fn kv_int8_zeros(shape: [usize; 4], device: &Self::Device) -> Int8Kv<Self> {
        kv_quant::zeros_reference(shape, device)
    }

    /// Quantizes `x` (`[batch, kv_heads, t, head_dim]`) into slots `slot..slot + t`, one scale
    /// per (sequence, head, position).
    fn kv_int8_store(cache: Int8Kv<Self>, x: Tensor<Self, 4>, slot: usize) -> Int8Kv<Self> {
        kv_quant::store_reference(cache, x, slot)
    }

    /// Slots `range` dequantized to `dtype`: `[batch, kv_heads, range.len(), head_dim]`.
    fn kv_int8_load(
        cache: &Int8Kv<Self>,
        range: std::ops::Range<usize>,
        dtype: burn::tensor::DType,
    ) -> Tensor<Self, 4> {
        kv_quant::load_reference(cache, range, dtype)
    }

    /// [`GemmaBackend::grouped_attention`] over the first `len` slots of int8 keys and values;
    /// returns `q`'s dtype. The CubeCL kernel reads the codes directly.
    #[allow(clippy::too_many_arguments)]
    fn grouped_attention_int8(
        q: Tensor<Self, 4>,
        k: &Int8Kv<Self>,
        v: &Int8Kv<Self>,
        len: usize,
        mask: AttentionMask,
        scale: f64,
        softcap: Option<f64>,
    ) -> Tensor<Self, 4> {
        let dtype = q.dtype();
        let (k, v) = (Self::kv_int8_load(k, 0..len, dtype), Self::kv_int8_load(v, 0..len, dtype));
        Self::grouped_attention(q, k, v, mask, scale, softcap)
    }

    /// A weight in the layout the kernels read fastest, done once at load: CubeCL allocates
    /// `[rows, cols]` tensors with rows padded to an aligned pitch, which the kernels would
    /// otherwise copy to a packed layout on every call.
    fn pack<const D: usize>(weight: Tensor<Self, D>) -> Tensor<Self, D> {
        weight
    }

    /// Device memory currently reserved by the backend's allocator, in bytes, where the backend
    /// reports it (`None` for host backends).
    fn memory_reserved(_device: &Self::Device) -> Option<u64> {
        None
    }

    /// Picks one token per row of `logits` (`[batch, vocab]`, f32) with `params`, using
    /// `uniform[row]` in [0, 1) as the random draw. Returns the `[batch]` token ids; only they
    /// leave the device. The default reads the logits back and runs [`sampling::reference`].
    fn sample(logits: Tensor<Self, 2>, params: &SamplingParams, uniform: &[f32]) -> Tensor<Self, 1, Int> {
        let [batch, vocab] = logits.dims();
        let device = logits.device();
        let values =
            logits.cast(burn::tensor::DType::F32).into_data().convert::<f32>().into_vec::<f32>().unwrap_or_default();
        let ids: Vec<i64> = (0..batch)
            .map(|r| {
                let row = values.get(r * vocab..(r + 1) * vocab).unwrap_or(&[]);
                sampling::reference(row, params, uniform.get(r).copied().unwrap_or(0.0)) as i64
            })
            .collect();
        Tensor::from_data(burn::tensor::TensorData::new(ids, [batch]), &device)
    }
}

#[cfg(all(test, feature = "ndarray"))]
pub(crate) mod test_util {
    pub type TestBackend = burn::backend::NdArray<f32>;
}
