//! Which implementation each backend gets.

use crate::{
    cube, quant::kernel::Packed, AttentionMask, GemmaBackend, HostQuantized, Int8Kv, KvStore, QkvLayout,
    QuantizedMatrix, SamplingParams,
};
use burn::tensor::{backend::Backend, DType, Int, Tensor, TensorData};
use burn_cubecl::{BoolElement, CubeBackend, CubeRuntime, FloatElement, IntElement};

/// Every CubeCL runtime (CUDA, ROCm/HIP, wgpu) shares one implementation: the kernels in each
/// operation's `kernel` module.
impl<R, F, I, BT> GemmaBackend for CubeBackend<R, F, I, BT>
where
    R: CubeRuntime,
    F: FloatElement,
    I: IntElement,
    BT: BoolElement,
{
    /// Decode-sized inputs (at most `GEMV_MAX_ROWS` rows) go to the matrix-vector kernel, larger
    /// ones to the backend's matmul, which wins once the weight is reused across rows.
    fn project(x: Tensor<Self, 2>, weight: Tensor<Self, 2>) -> Tensor<Self, 2> {
        if x.dims()[0] <= crate::linear::GEMV_MAX_ROWS && x.dtype() == weight.dtype() {
            cube::tensor(crate::linear::kernel::gemv(cube::float(x), cube::float(weight), false))
        } else {
            crate::linear::reference(x, weight)
        }
    }

    /// Decode-sized inputs: GELU in the GEMV's epilogue (one launch, half the output written);
    /// larger ones: the backend's matmul, then one GELU kernel over the interleaved product.
    fn project_gelu_pairs(x: Tensor<Self, 2>, weight: Tensor<Self, 2>) -> Tensor<Self, 2> {
        if x.dims()[0] <= crate::linear::GEMV_MAX_ROWS && x.dtype() == weight.dtype() {
            cube::tensor(crate::linear::kernel::gemv(cube::float(x), cube::float(weight), true))
        } else {
            cube::tensor(crate::gelu::kernel::gelu_mul_joined(cube::float(Self::project(x, weight)), true))
        }
    }

    /// Codes packed into `u32` words; scales in f16 where the device has it.
    fn upload_quantized(host: &HostQuantized, device: &Self::Device) -> QuantizedMatrix<Self> {
        let scale_dtype = if Self::supports_dtype(device, DType::F16) { DType::F16 } else { DType::F32 };
        QuantizedMatrix::upload(host, true, scale_dtype, device)
    }

    /// Decode-sized inputs read the codes directly; larger ones dequantize the matrix once and
    /// use the backend's matmul.
    fn project_quantized(x: Tensor<Self, 2>, weight: &QuantizedMatrix<Self>) -> Tensor<Self, 2> {
        let packed = packed(weight);
        if x.dims()[0] <= crate::linear::GEMV_MAX_ROWS {
            cube::tensor(crate::quant::kernel::gemv(cube::float(x), &packed, false))
        } else {
            let dense = cube::tensor(crate::quant::kernel::dequantize(&packed, x.dtype()));
            crate::linear::reference(x, dense)
        }
    }

    fn project_quantized_gelu_pairs(x: Tensor<Self, 2>, weight: &QuantizedMatrix<Self>) -> Tensor<Self, 2> {
        if x.dims()[0] <= crate::linear::GEMV_MAX_ROWS {
            cube::tensor(crate::quant::kernel::gemv(cube::float(x), &packed(weight), true))
        } else {
            cube::tensor(crate::gelu::kernel::gelu_mul_joined(cube::float(Self::project_quantized(x, weight)), true))
        }
    }

    fn embed_quantized(
        table: &[QuantizedMatrix<Self>],
        ids: Tensor<Self, 2, Int>,
        scale: f64,
        dtype: DType,
    ) -> Tensor<Self, 3> {
        let blocks: Vec<_> = table.iter().map(packed).collect();
        cube::tensor(crate::quant::kernel::embed(&blocks, cube::int(ids), scale, dtype))
    }

    fn rms_norm<const D: usize>(x: Tensor<Self, D>, weight: Tensor<Self, 1>, eps: f64) -> Tensor<Self, D> {
        cube::tensor(crate::rms_norm::kernel::rms_norm(cube::float(x), cube::float(weight), eps))
    }

    fn add_rms_norm(
        residual: Tensor<Self, 3>,
        x: Tensor<Self, 3>,
        x_weight: Option<Tensor<Self, 1>>,
        weight: Tensor<Self, 1>,
        eps: f64,
        out_dtype: DType,
    ) -> (Tensor<Self, 3>, Tensor<Self, 3>) {
        let residual = residual.cast(DType::F32);
        let (sum, normed) = crate::rms_norm::kernel::add_rms_norm(
            cube::float(residual),
            cube::float(x),
            x_weight.map(cube::float),
            cube::float(weight),
            eps,
            out_dtype,
        );
        (cube::tensor(sum), cube::tensor(normed))
    }

    fn gelu_mul(gate: Tensor<Self, 3>, up: Tensor<Self, 3>) -> Tensor<Self, 3> {
        cube::tensor(crate::gelu::kernel::gelu_mul(cube::float(gate), cube::float(up)))
    }

    fn gelu_mul_halves(x: Tensor<Self, 3>) -> Tensor<Self, 3> {
        cube::tensor(crate::gelu::kernel::gelu_mul_joined(cube::float(x), false))
    }

    fn rope(
        x: Tensor<Self, 4>,
        cos: Tensor<Self, 2>,
        sin: Tensor<Self, 2>,
        offset: usize,
        norm: Option<(Tensor<Self, 1>, f64)>,
    ) -> Tensor<Self, 4> {
        let norm = norm.map(|(w, eps)| (cube::float(w), eps));
        cube::tensor(crate::rope::kernel::rope(
            cube::float_strided(x),
            cube::float(cos.cast(DType::F32)),
            cube::float(sin.cast(DType::F32)),
            offset,
            norm,
        ))
    }

    /// The kernels write the store's buffers in place (the store owns them).
    fn qkv_rope_append(
        qkv: Tensor<Self, 2>,
        layout: &QkvLayout<Self>,
        store: KvStore<Self>,
        slot: usize,
    ) -> (Tensor<Self, 4>, KvStore<Self>) {
        use crate::qkv::kernel::{qkv_rope_append, Layout, Store};
        let args = Layout {
            heads: layout.heads,
            kv_heads: layout.kv_heads,
            head_dim: layout.head_dim,
            cos: cube::float(layout.cos.clone().cast(DType::F32)),
            sin: cube::float(layout.sin.clone().cast(DType::F32)),
            position: layout.position,
            norm: layout.norm.clone().map(|(q, k, eps)| (cube::float(q), cube::float(k), eps)),
        };
        let qkv = cube::float(qkv);
        match store {
            KvStore::Dense { keys, values } => {
                let (keys, values) = (cube::float_strided(keys), cube::float_strided(values));
                let q = qkv_rope_append(qkv, &args, Store::Dense { keys: &keys, values: &values }, slot);
                (cube::tensor(q), KvStore::Dense { keys: cube::tensor(keys), values: cube::tensor(values) })
            }
            KvStore::Int8 { keys, values } => {
                let (k_codes, k_scales) = (cube::int(keys.codes), cube::float(keys.scales));
                let (v_codes, v_scales) = (cube::int(values.codes), cube::float(values.scales));
                let store =
                    Store::Int8 { k_codes: &k_codes, k_scales: &k_scales, v_codes: &v_codes, v_scales: &v_scales };
                let q = qkv_rope_append(qkv, &args, store, slot);
                let keys =
                    Int8Kv { codes: cube::int_tensor(k_codes), scales: cube::tensor(k_scales), shape: keys.shape };
                let values =
                    Int8Kv { codes: cube::int_tensor(v_codes), scales: cube::tensor(v_scales), shape: values.shape };
                (cube::tensor(q), KvStore::Int8 { keys, values })
            }
        }
    }

    fn softcap<const D: usize>(x: Tensor<Self, D>, cap: f64) -> Tensor<Self, D> {
        cube::tensor(crate::softcap::kernel::softcap(cube::float(x), cap))
    }

    fn embed(table: &[Tensor<Self, 2>], ids: Tensor<Self, 2, Int>, scale: f64) -> Tensor<Self, 3> {
        let blocks = table.iter().map(|b| cube::float(b.clone())).collect();
        cube::tensor(crate::embedding::kernel::embed(blocks, cube::int(ids), scale))
    }

    fn grouped_attention(
        q: Tensor<Self, 4>,
        k: Tensor<Self, 4>,
        v: Tensor<Self, 4>,
        mask: AttentionMask,
        scale: f64,
        softcap: Option<f64>,
    ) -> Tensor<Self, 4> {
        let (q, k, v) = (cube::float_strided(q), cube::float_strided(k), cube::float_strided(v));
        cube::tensor(crate::attention::kernel::attention(q, k, v, mask, scale, softcap))
    }

    fn pack<const D: usize>(weight: Tensor<Self, D>) -> Tensor<Self, D> {
        cube::tensor(cube::float(weight))
    }

    /// Four codes per `u32` word: `[batch, kv_heads, slots, head_dim / 4]`.
    fn kv_int8_zeros([b, h, slots, dim]: [usize; 4], device: &Self::Device) -> Int8Kv<Self> {
        Int8Kv {
            codes: Tensor::zeros([b, h, slots, dim / 4], (device, DType::U32)),
            scales: Tensor::zeros([b, h, slots], (device, DType::F32)),
            shape: [b, h, slots, dim],
        }
    }

    /// Quantizes in place into the cache's buffers (the cache owns them).
    fn kv_int8_store(cache: Int8Kv<Self>, x: Tensor<Self, 4>, slot: usize) -> Int8Kv<Self> {
        let (codes, scales) = (cube::int(cache.codes), cube::float(cache.scales));
        crate::kv_quant::kernel::store(cube::float_strided(x), &codes, &scales, slot);
        Int8Kv { codes: cube::int_tensor(codes), scales: cube::tensor(scales), shape: cache.shape }
    }

    fn kv_int8_load(cache: &Int8Kv<Self>, range: std::ops::Range<usize>, dtype: DType) -> Tensor<Self, 4> {
        let (codes, scales) = (cube::int(cache.codes.clone()), cube::float(cache.scales.clone()));
        cube::tensor(crate::kv_quant::kernel::load(&codes, &scales, range.start, range.len(), dtype))
    }

    fn grouped_attention_int8(
        q: Tensor<Self, 4>,
        k: &Int8Kv<Self>,
        v: &Int8Kv<Self>,
        len: usize,
        mask: AttentionMask,
        scale: f64,
        softcap: Option<f64>,
    ) -> Tensor<Self, 4> {
        let kv = crate::attention::kernel::Kv::Int8 {
            k_codes: cube::int(k.codes.clone()),
            k_scales: cube::float(k.scales.clone()),
            v_codes: cube::int(v.codes.clone()),
            v_scales: cube::float(v.scales.clone()),
            len,
        };
        cube::tensor(crate::attention::kernel::attention_kv(cube::float_strided(q), kv, mask, scale, softcap))
    }

    fn memory_reserved(device: &Self::Device) -> Option<u64> {
        R::client(device).memory_usage().ok().map(|usage| usage.bytes_reserved)
    }

    fn sample(logits: Tensor<Self, 2>, params: &SamplingParams, uniform: &[f32]) -> Tensor<Self, 1, Int> {
        let [batch, _] = logits.dims();
        let logits = cube::float(logits.cast(DType::F32));
        // Greedy never reads the draws: the logits stand in, so decoding uploads nothing.
        let uniform = if params.temperature == 0.0 {
            logits.clone()
        } else {
            let mut draws = uniform.to_vec();
            draws.resize(batch, 0.0);
            let device = logits.device.clone();
            cube::float(Tensor::<Self, 1>::from_data(TensorData::new(draws, [batch]), (&device, DType::F32)))
        };
        cube::int_tensor(crate::sampling::kernel::sample(logits, uniform, params, I::dtype()))
    }
}

/// The device tensors of a quantized matrix as kernel arguments.
fn packed<R, F, I, BT>(w: &QuantizedMatrix<CubeBackend<R, F, I, BT>>) -> Packed<R>
where
    R: CubeRuntime,
    F: FloatElement,
    I: IntElement,
    BT: BoolElement,
{
    Packed {
        codes: cube::int(w.codes.val()),
        scales: cube::float(w.scales.val()),
        offsets: w.offsets.as_ref().map(|o| cube::float(o.val())),
        format: w.format,
    }
}

#[cfg(feature = "ndarray")]
impl<E, I, Q> GemmaBackend for burn::backend::NdArray<E, I, Q>
where
    E: burn::backend::ndarray::FloatNdArrayElement,
    I: burn::backend::ndarray::IntNdArrayElement,
    Q: burn::backend::ndarray::QuantElement,
    burn::backend::ndarray::NdArrayTensor: From<burn::backend::ndarray::SharedArray<E>>,
    burn::backend::ndarray::NdArrayTensor: From<burn::backend::ndarray::SharedArray<I>>,
{
}

// burn-candle is deprecated upstream in Burn 0.21 but still a supported CPU backend here.
#[cfg(feature = "candle")]
#[allow(deprecated)]
impl<F, I> GemmaBackend for burn::backend::Candle<F, I>
where
    F: burn::backend::candle::FloatCandleElement,
    I: burn::backend::candle::IntCandleElement,
{
}
