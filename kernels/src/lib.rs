//! Backend extension for Gemma inference.
//!
//! [`GemmaBackend`] has one method per hot operation of a Gemma forward pass. Every method has a
//! default implementation written with plain Burn tensor operations (the *reference*, which lives
//! next to each operation in its own module). CPU backends (NdArray, Candle) use the references,
//! Candle with its block-quantized matrices kept in GGUF's own block types and multiplied by
//! candle's quantized kernels ([`quant::ggml`]);
//! the CubeCL backends (`CubeBackend<R, F, I, BT>`: CUDA, ROCm/HIP, wgpu) get the same trait from
//! one implementation generic over the runtime, so kernels are written once for every GPU API.
//!
//! GPU backends are used *unfused* (`CubeBackend`, not `Fusion<CubeBackend>`): the hot paths are
//! covered by hand-written kernels here, and an unfused backend lets us hand primitive tensors
//! straight to those kernels without going through the fusion stream.
//!
//! On CUDA, a decode step built from these operations can be recorded once and replayed as one
//! CUDA graph per token ([`graph`]); the per-token values it needs are read by the kernels from
//! device buffers ([`step`], [`Draws`]).
//!
//! Conventions shared by all operations:
//! - RMSNorm weights use the Hugging Face convention: the scale applied is `1 + w`.
//! - Attention tensors are `[batch, heads, seq, head_dim]`.
//! - Normalization and softmax accumulate in f32 whatever the activation dtype.

// The kernels' checks run on the GPU backends (`gpu_test!`: wgpu, CUDA); a test build without
// one compiles them unused.
#![cfg_attr(all(test, not(any(feature = "wgpu", feature = "cuda", feature = "rocm"))), allow(dead_code))]

#[cfg(test)]
#[macro_use]
pub(crate) mod gpu_test;

pub mod attention;
#[cfg(feature = "cuda")]
pub mod collective;
mod dtype;
pub mod embedding;
pub mod experts;
pub mod gelu;
pub mod gemm;
pub mod graph;
pub mod greedy;
pub mod kv;
pub mod linear;
pub mod matrix;
pub mod qkv;
pub mod quant;
pub mod rms_norm;
pub mod rope;
pub mod sampling;
pub mod softcap;
pub mod step;
pub mod tuning;

mod backends;
mod cube;

pub use attention::{AttentionMask, AttentionOptions};
pub use experts::{ExpertProduct, ExpertWeights, Experts, Routes};
pub use gelu::GateUpLayout;
pub use kv::{BlockTable, Int8Kv, KvFormat, KvStore, KvView, StoreMismatch};
pub use matrix::{Epilogue, HostMatrix, Matrix};
pub use qkv::{HeadNorms, KvRows, QkvLayout, ValueNorm};
pub use tuning::KernelTuning;
/// A value that could not be read back from the device.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("reading {what} back from the device failed: {reason}")]
pub struct ReadBackError {
    /// What was being read.
    pub what: &'static str,
    /// The runtime's words.
    pub reason: String,
}

/// The values of a float tensor on the host as f32, or why they could not be read.
pub fn read_back<B: burn::tensor::backend::Backend, const D: usize>(
    t: Tensor<B, D>,
    what: &'static str,
) -> Result<Vec<f32>, ReadBackError> {
    let fail = |reason: String| ReadBackError { what, reason };
    t.try_into_data()
        .map_err(|e| fail(format!("{e:?}")))?
        .convert::<f32>()
        .into_vec::<f32>()
        .map_err(|e| fail(format!("{e:?}")))
}

pub use quant::{
    GgmlBlocks, GgmlMatrix, HostKQuant, HostQuantized, KQuantFormat, KQuantMatrix, QuantError, QuantFormat,
    QuantizedMatrix,
};

/// How a backend best keeps a checkpoint's block-quantized matrices by default
/// ([`GemmaBackend::preferred_blocks`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PreferredBlocks {
    /// As the file stores them.
    Native,
    /// Converted to the closest of Q8 and Q4. The GPU backends' choice: on the H200 their Q4
    /// and Q8 matrix-vector kernels decode faster than the k-quant ones read the file's fewer
    /// bytes (Gemma 3 12B shapes, tg128: 510 against 460 tok/s for Q4_K, 473 against 379 for
    /// Q6_K, 179 against 156 on a Q4_K_M file; `docs/runs/gpu/2026-11-28-kquant.md`): the k-quant
    /// kernels decode more per weight and are bound by issuing instructions, not by memory.
    Converted,
    /// Dequantized, dense in the model dtype.
    Dense,
}
pub use greedy::HeadChoice;
pub use rms_norm::AddNorm;
pub use rope::{Frequencies, RopeTables};
pub use sampling::{Draws, SamplingParams};
pub use step::{StepPosition, StepRows};

use burn::tensor::{backend::Backend, DType, Int, Tensor};
use std::ops::Range;

/// What a device can still allocate, where the backend can tell.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MemoryLimits {
    /// The largest single buffer the device allocates.
    pub largest_buffer: Option<u64>,
    /// Bytes still free for new buffers.
    pub available: Option<u64>,
}

/// Device memory: what the backend's allocator holds, and the largest buffer worth asking for.
pub trait ReservedMemory: Backend {
    /// Bytes currently reserved on `device` (`None` for host backends).
    fn memory_reserved(_device: &Self::Device) -> Option<u64> {
        None
    }

    /// What `device` can still allocate. The default (host backends): the system's available
    /// memory where it reports it (Linux `MemAvailable`), no per-buffer limit.
    fn memory_limits(_device: &Self::Device) -> MemoryLimits {
        MemoryLimits { largest_buffer: None, available: host_available_bytes() }
    }

    /// The largest buffer a large table (the embedding) is kept in before it is split into row
    /// blocks: 128 MiB, wgpu's default limit on a storage binding, which every adapter
    /// supports; CUDA takes its allocator's page size, so the table and the lm_head are one
    /// matrix.
    fn max_buffer_bytes(_device: &Self::Device) -> usize {
        1 << 27
    }
}

/// The system's available memory (`MemAvailable` of `/proc/meminfo`), where it is reported.
pub fn host_available_bytes() -> Option<u64> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = info.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.trim_start_matches("MemAvailable:").trim().trim_end_matches("kB").trim().parse().ok()?;
    kib.checked_mul(1024)
}

/// Runs `work` on a thread of the CPU backends' thread pool (rayon's global pool) unless the
/// caller is one already. Each parallel product a pass runs from a thread outside the pool is
/// handed to the pool and waited for, two context switches per product; from inside it the
/// caller's thread takes part and no handover happens. On the real 270M (Candle, this
/// repository's 2-core AMD EPYC, `bench --gen 64`, alternating runs): decode 68-72 -> 85-86 tok/s
/// on 2 threads, 34-40 -> 40-52 on 1.
pub fn on_cpu_pool<R: Send>(work: impl FnOnce() -> R + Send) -> R {
    if rayon::current_thread_index().is_some() {
        return work();
    }
    // `join` from outside the pool runs both closures on the pool's threads and blocks until
    // they are done; the empty second one costs nothing.
    rayon::join(work, || ()).0
}

/// The operations a Gemma forward pass accelerates.
///
/// Each method takes what it reads as one type whatever its storage: a [`Matrix`] (dense or
/// quantized), a [`KvStore`] or [`KvView`] (dense or int8), [`AttentionOptions`]. Implemented for
/// every backend the crate supports; see the crate docs.
pub trait GemmaBackend: ReservedMemory {
    /// The activation dtype a model runs in when none is asked for: f32, except where the
    /// backend's matrix units make bf16 the fast choice (CUDA).
    fn preferred_dtype(_device: &Self::Device) -> DType {
        DType::F32
    }

    /// Runs a forward pass `work`: on the calling thread, except on the CPU backends (see
    /// [`on_cpu_pool`]).
    fn run_pass<R: Send>(work: impl FnOnce() -> R + Send) -> R {
        work()
    }

    /// How this backend best keeps a checkpoint's block-quantized matrices when a load asks
    /// for nothing else: as the file stores them (candle's block products), converted to Q8/Q4
    /// (the GPU kernels: see [`PreferredBlocks::Converted`]), or dense (the plain reference
    /// dequantizes on every product).
    fn preferred_blocks() -> PreferredBlocks {
        PreferredBlocks::Native
    }

    /// Puts a checkpoint matrix in the layout this backend's kernels read, once at load: dense
    /// weights packed (CubeCL pads the rows of `[rows, cols]` allocations to an aligned pitch,
    /// which a kernel would otherwise copy away on every call), quantized ones with their codes
    /// in the backend's layout (the reference keeps one `U8` code per weight and f32 scales),
    /// GGUF blocks as they are where the backend multiplies them (Candle) and converted to the
    /// closest of this crate's formats elsewhere; fails on blocks that do not convert.
    fn upload_matrix(matrix: HostMatrix<Self>, device: &Self::Device) -> Result<Matrix<Self>, QuantError> {
        matrix::upload_reference(matrix, device)
    }

    /// `x [n, in] @ weight^T` in `x`'s dtype, then `epilogue`: `[n, out]`, or `[n, out / 2]` for
    /// [`Epilogue::GeluPairs`].
    fn project(x: Tensor<Self, 2>, weight: &Matrix<Self>, epilogue: Epilogue) -> Tensor<Self, 2> {
        matrix::reference(x, weight, epilogue)
    }

    /// Embedding gather scaled by `scale`: `table[ids] * scale` in `dtype`.
    ///
    /// - `table`: the `[vocab, hidden]` table as consecutive row blocks (GPU APIs cap the size
    ///   of one buffer); `ids`: `[batch, seq]`; returns `[batch, seq, hidden]`.
    fn embed(table: &[Matrix<Self>], ids: Tensor<Self, 2, Int>, scale: f64, dtype: DType) -> Tensor<Self, 3> {
        embedding::table_reference(table, ids, scale, dtype)
    }

    /// RMSNorm over the last dimension: `x * rsqrt(mean(x^2) + eps) * (1 + weight)`, computed in
    /// f32 and returned in `x`'s dtype.
    ///
    /// - `x`: `[..., n]`, `weight`: `[n]` (f32).
    fn rms_norm<const D: usize>(x: Tensor<Self, D>, weight: Tensor<Self, 1>, eps: f64) -> Tensor<Self, D> {
        rms_norm::reference(x, weight, eps)
    }

    /// Residual add fused with RMSNorm: returns `(residual + x', norm(residual + x'))` where `x'`
    /// is `x` normalized by `norms.post` when given.
    ///
    /// - `residual`: `[batch, seq, hidden]`, the residual stream: f32, or the activation dtype
    ///   before the first add (the embeddings);
    /// - `x`: `[batch, seq, hidden]` in the activation dtype;
    /// - returns the new residual (f32) and the normalized value in `norms.out_dtype`.
    fn add_rms_norm(
        residual: Tensor<Self, 3>,
        x: Tensor<Self, 3>,
        norms: &AddNorm<Self>,
    ) -> (Tensor<Self, 3>, Tensor<Self, 3>) {
        rms_norm::add_reference(residual, x, norms)
    }

    /// `gelu_tanh(gate) * up` of a joined gate/up projection `x` `[batch, seq, 2m]` laid out as
    /// `layout` says; returns `[batch, seq, m]`.
    fn gelu_mul(x: Tensor<Self, 3>, layout: GateUpLayout) -> Tensor<Self, 3> {
        gelu::joined_reference(x, layout)
    }

    /// Gemma 4's per-layer input gate: `gelu_tanh(gate) * inputs[:, :, layer, :]` in `gate`'s
    /// dtype, reading the layer's slice in place (no copy of it is made).
    ///
    /// - `gate`: `[batch, seq, width]`; `inputs`: `[batch, seq, layers, width]` (any float dtype).
    fn gelu_gate(gate: Tensor<Self, 3>, inputs: Tensor<Self, 4>, layer: usize) -> Tensor<Self, 3> {
        let [batch, seq, layers, width] = inputs.dims();
        let up =
            inputs.slice([0..batch, 0..seq, layer..(layer + 1).min(layers), 0..width]).reshape([batch, seq, width]);
        let dtype = gate.dtype();
        gelu::reference(gate, up.cast(dtype))
    }

    /// Rotary position embedding (rotate-half layout), preceded by a per-head RMSNorm when
    /// `qk_norm` (`(weight [head_dim], eps)`, Gemma 3's QK-norm) is given.
    ///
    /// - `x`: `[batch, heads, seq, head_dim]`, its first row at absolute position `position`;
    /// - `tables`: the layer type's [`RopeTables`].
    fn qk_norm_rope(
        x: Tensor<Self, 4>,
        tables: &RopeTables<Self>,
        position: usize,
        qk_norm: Option<(Tensor<Self, 1>, f64)>,
    ) -> Tensor<Self, 4> {
        rope::reference(x, tables.cos.clone(), tables.sin.clone(), position, qk_norm)
    }

    /// One decode position of an attention layer after its joined `q | k | v` projection:
    /// QK-norm and RoPE on queries and keys, keys and values written into slot `position %
    /// slots` of `store` (see [`step`]), in one pass (see [`qkv`]).
    ///
    /// - `qkv`: `[batch, layout.width()]`, one position per sequence;
    /// - returns the queries `[batch, heads, 1, head_dim]` in `qkv`'s dtype, and the store.
    ///
    /// Fails only where a position on the device must be read back and the read fails.
    fn qkv_rope_append(
        qkv: Tensor<Self, 2>,
        layout: &QkvLayout<Self>,
        store: KvStore<Self>,
    ) -> Result<(Tensor<Self, 4>, KvStore<Self>), ReadBackError> {
        qkv::reference(qkv, layout, store)
    }

    /// Puts one projection of a layer's `count` experts in the layout this backend's expert
    /// products read, once at load: `stacked` is `[count * rows, cols]`, expert `e` at rows `e
    /// * rows..`, in the checkpoint's own format. The default keeps one matrix per expert
    /// ([`experts::upload_reference`]).
    fn upload_experts(
        stacked: HostMatrix<Self>,
        count: usize,
        device: &Self::Device,
    ) -> Result<Experts<Self>, QuantError> {
        experts::upload_reference(stacked, count, device)
    }

    /// The router's choice from its scores (`[tokens, experts]`, any float dtype): each token's
    /// `top_k` experts by softmax probability, their probabilities renormalized over the
    /// `top_k` and times `per_expert_scale` (`[experts]`, f32). The default reads the scores
    /// back ([`experts::route_reference`]).
    fn route_experts(
        scores: Tensor<Self, 2>,
        per_expert_scale: Tensor<Self, 1>,
        top_k: usize,
    ) -> Result<Routes<Self>, ReadBackError> {
        experts::route_reference(scores, per_expert_scale, top_k)
    }

    /// One projection of the routed experts (see [`ExpertProduct`] for the shapes), returned
    /// in `dtype`; `x` may be in any float dtype. The default groups the tokens by expert on
    /// the host ([`experts::project_reference`]).
    ///
    /// Fails only where the routes must be read back and the read fails.
    fn project_experts(
        x: Tensor<Self, 2>,
        experts: &Experts<Self>,
        routes: &Routes<Self>,
        product: ExpertProduct,
        dtype: DType,
    ) -> Result<Tensor<Self, 2>, ReadBackError> {
        experts::project_reference(x, experts, routes, product, dtype)
    }

    /// `tanh(x / cap) * cap`, elementwise.
    fn softcap<const D: usize>(x: Tensor<Self, D>, cap: f64) -> Tensor<Self, D> {
        softcap::reference(x, cap)
    }

    /// Scaled dot-product attention with grouped KV heads, causal and sliding-window masking and
    /// optional logit softcapping, softmax in f32, over dense or int8 keys and values (the
    /// kernels read int8 codes directly).
    ///
    /// - `q`: `[batch, q_heads, q_len, head_dim]`; `kv`: `kv_heads` heads with `q_heads %
    ///   kv_heads == 0`; returns `[batch, q_heads, q_len, head_dim]` in `q`'s dtype.
    ///
    /// Fails only where a position on the device must be read back and the read fails.
    fn grouped_attention(
        q: Tensor<Self, 4>,
        kv: KvView<'_, Self>,
        options: &AttentionOptions,
    ) -> Result<Tensor<Self, 4>, ReadBackError> {
        let (keys, values, options) = match kv {
            KvView::Dense { keys, values } => (keys, values, *options),
            KvView::Int8 { keys, values, len } => {
                let store = KvStore::Int8 { keys: keys.clone(), values: values.clone() };
                let (keys, values) = Self::kv_read(&store, 0..len, q.dtype());
                (keys, values, *options)
            }
            KvView::Decode { store, position, blocks: Some(table) } => {
                let own = kv::paged::gather_reference(store, table, q.dims()[0]);
                return Self::grouped_attention(q, KvView::Decode { store: &own, position, blocks: None }, options);
            }
            KvView::Decode { store, position, blocks: None } => {
                let batch = q.dims()[0];
                let positions = position.resolve_rows(batch)?;
                if batch > 0 && (batch != store.shape()[0] || positions.windows(2).any(|w| w[0] != w[1])) {
                    // Sequences at positions of their own (or fewer than the store's), or
                    // consecutive rows of one sequence: one at a time.
                    return attention::decode_each_sequence(q, store, (&position, &positions), options);
                }
                let p = positions.first().copied().unwrap_or(0);
                let (visible, mask) = step::decode_visible(p, store.shape()[2], options.mask.window);
                let (keys, values) = Self::kv_read(store, 0..visible, q.dtype());
                (keys, values, AttentionOptions { mask, ..*options })
            }
        };
        Ok(attention::reference(q, keys, values, &options))
    }

    /// A store of `shape` = `[batch, kv_heads, slots, head_dim]` in `format` (int8: `head_dim` a
    /// multiple of 4), every slot zero.
    fn kv_zeros(shape: [usize; 4], format: KvFormat, device: &Self::Device) -> KvStore<Self> {
        kv::zeros_reference(shape, format, device)
    }

    /// Writes `keys` and `values` (`[batch, kv_heads, t, head_dim]`) into slots `slot..slot + t`
    /// (cast to the store's dtype, or quantized with one scale per (sequence, head, position)).
    fn kv_write(store: KvStore<Self>, keys: Tensor<Self, 4>, values: Tensor<Self, 4>, slot: usize) -> KvStore<Self> {
        kv::write_reference(store, keys, values, slot)
    }

    /// Slots `range` of the keys and values in `dtype`: `[batch, kv_heads, range.len(),
    /// head_dim]` each.
    fn kv_read(store: &KvStore<Self>, range: Range<usize>, dtype: DType) -> (Tensor<Self, 4>, Tensor<Self, 4>) {
        kv::read_reference(store, range, dtype)
    }

    /// A paged `store` with `rows` (one sequence in a store of its own, `[1, kv_heads, slots,
    /// head_dim]`, the same format) copied into its blocks `blocks` (slots `i * block_size..`
    /// into block `blocks[i]`), for the blocks that cover its first `len` slots (see
    /// [`kv::paged::scatter_sequence`], the reference). The CubeCL backends write in place, so
    /// that a recorded decode step over the store sees the copy.
    fn kv_scatter_blocks(
        store: KvStore<Self>,
        rows: &KvStore<Self>,
        blocks: &[u32],
        block_size: usize,
        len: usize,
    ) -> KvStore<Self> {
        kv::paged::scatter_sequence(store, rows, blocks, block_size, len)
    }

    /// The lm_head of a greedy decode step: `x [n, in]` times the table whose consecutive row
    /// blocks are `table` (`[vocab, in]` together), softcapped by `cap` when given, and each
    /// row's greedy choice: what [`GemmaBackend::project`] per block, [`GemmaBackend::softcap`]
    /// and [`GemmaBackend::sample`] with [`SamplingParams::GREEDY`] give
    /// ([`greedy::reference`], the default).
    ///
    /// Fails only where something had to be read back from the device and could not be.
    fn project_greedy(
        x: Tensor<Self, 2>,
        table: &[Matrix<Self>],
        cap: Option<f64>,
    ) -> Result<HeadChoice<Self>, ReadBackError> {
        greedy::reference(x, table, cap)
    }

    /// Picks one token per row of `logits` (`[batch, vocab]`, any float dtype) with `params`,
    /// using `draws` (one uniform number in [0, 1) per row) as the randomness. Returns the
    /// `[batch]` token ids; only they leave the device. The default reads the logits back and
    /// runs [`sampling::reference`].
    ///
    /// Fails only where something had to be read back from the device and could not be.
    fn sample(
        logits: Tensor<Self, 2>,
        params: &SamplingParams,
        draws: Draws<'_, Self>,
    ) -> Result<Tensor<Self, 1, Int>, ReadBackError> {
        let [batch, vocab] = logits.dims();
        let device = logits.device();
        let uniform = draws.resolve(batch)?;
        let values = read_back(logits.cast(DType::F32), "the logits")?;
        let ids: Vec<i64> = (0..batch)
            .map(|r| {
                let row = values.get(r * vocab..(r + 1) * vocab).unwrap_or(&[]);
                sampling::reference(row, params, uniform[r]) as i64
            })
            .collect();
        Ok(Tensor::from_data(burn::tensor::TensorData::new(ids, [batch]), &device))
    }
}

#[cfg(all(test, feature = "ndarray"))]
pub(crate) mod test_util {
    pub type TestBackend = burn::backend::NdArray<f32>;
}
