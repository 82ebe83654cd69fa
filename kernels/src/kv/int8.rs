//! int8 KV cache storage: one int8 code per element and one f32 scale per (sequence, KV head,
//! position), quantized on append (`scale = max|x| / 127` over the head dimension).
//!
//! As for quantized weights the backend chooses the code layout
//! ([`crate::GemmaBackend::kv_zeros`]): the reference keeps one `U8` code per element
//! (`q + 128`); the CubeCL backends pack four codes per `u32` word, `[batch, heads, slots,
//! head_dim / 4]`, and attention reads them directly.

use burn::tensor::{backend::Backend, s, DType, Int, Tensor};

/// Keys or values of one layer in int8.
#[derive(Debug, Clone)]
pub struct Int8Kv<B: Backend> {
    /// Codes in the backend's layout.
    pub codes: Tensor<B, 4, Int>,
    /// `[batch, heads, slots]` (f32).
    pub scales: Tensor<B, 3>,
    /// `[batch, heads, slots, head_dim]` of the dequantized tensor.
    pub shape: [usize; 4],
}

impl<B: Backend> Int8Kv<B> {
    /// Bytes on the device (codes and scales).
    pub fn device_bytes(&self) -> usize {
        self.codes.shape().num_elements() * self.codes.dtype().size() + self.scales.shape().num_elements() * 4
    }

    /// Sequences `rows` (slices of the codes and scales).
    pub fn rows(&self, rows: std::ops::Range<usize>) -> Self {
        let [_, h, slots, d] = self.shape;
        Self {
            codes: self.codes.clone().slice(s![rows.clone(), .., .., ..]),
            scales: self.scales.clone().slice(s![rows.clone(), .., ..]),
            shape: [rows.len(), h, slots, d],
        }
    }

    /// Sequences `rows` copied into buffers of their own (see [`crate::KvStore::copy_rows`]).
    pub fn copy_rows(&self, rows: std::ops::Range<usize>) -> Self {
        let [_, h, slots, d] = self.shape;
        let [_, ch, cs, cw] = self.codes.dims();
        let n = rows.len();
        let codes = Tensor::<B, 4, Int>::zeros([n, ch, cs, cw], (&self.codes.device(), self.codes.dtype()));
        let scales = Tensor::<B, 3>::zeros([n, h, slots], (&self.scales.device(), self.scales.dtype()));
        Self {
            codes: codes.slice_assign(s![.., .., .., ..], self.codes.clone().slice(s![rows.clone(), .., .., ..])),
            scales: scales.slice_assign(s![.., .., ..], self.scales.clone().slice(s![rows, .., ..])),
            shape: [n, h, slots, d],
        }
    }

    /// Sequences `at..` replaced by `rows` (same heads, slots, head size and code layout).
    pub(crate) fn assign_rows(self, at: usize, rows: Self) -> Self {
        let n = rows.shape[0];
        Self {
            codes: self.codes.slice_assign(s![at..at + n, .., .., ..], rows.codes),
            scales: self.scales.slice_assign(s![at..at + n, .., ..], rows.scales),
            shape: self.shape,
        }
    }
}

/// Reference storage: `U8` codes `[batch, heads, slots, head_dim]`, zero scales.
pub fn zeros_reference<B: Backend>(shape: [usize; 4], device: &B::Device) -> Int8Kv<B> {
    let [b, h, slots, _] = shape;
    Int8Kv {
        codes: Tensor::zeros(shape, (device, DType::U8)),
        scales: Tensor::zeros([b, h, slots], (device, DType::F32)),
        shape,
    }
}

/// Reference: quantizes `x` (`[batch, heads, t, head_dim]`) into slots `slot..slot + t`.
pub fn store_reference<B: Backend>(cache: Int8Kv<B>, x: Tensor<B, 4>, slot: usize) -> Int8Kv<B> {
    let [b, h, t, _] = x.dims();
    let x = x.cast(DType::F32);
    let scale = x.clone().abs().max_dim(3).div_scalar(127.0);
    let inv = scale.clone().recip().mask_fill(scale.clone().equal_elem(0.0), 0.0);
    let codes = (x * inv).round().clamp(-127.0, 127.0).add_scalar(128.0).int().cast(DType::U8);
    Int8Kv {
        codes: cache.codes.slice_assign(s![.., .., slot..slot + t, ..], codes),
        scales: cache.scales.slice_assign(s![.., .., slot..slot + t], scale.reshape([b, h, t])),
        shape: cache.shape,
    }
}

/// Reference: slots `range` dequantized to `dtype`, `[batch, heads, range.len(), head_dim]`.
pub fn load_reference<B: Backend>(cache: &Int8Kv<B>, range: std::ops::Range<usize>, dtype: DType) -> Tensor<B, 4> {
    let [b, h, _, d] = cache.shape;
    let n = range.len();
    let codes = cache.codes.clone().slice(s![.., .., range.clone(), ..]).float().cast(DType::F32).sub_scalar(128.0);
    let scales = cache.scales.clone().slice(s![.., .., range]).reshape([b, h, n, 1]);
    (codes * scales).reshape([b, h, n, d]).cast(dtype)
}

/// CubeCL kernel: quantizes rows into the packed cache in place. One cube per `(sequence,
/// head, row)`; each unit packs one word of four codes; a shared-memory tree finds the row's
/// largest magnitude.
#[allow(clippy::manual_div_ceil)]
pub(crate) mod kernel {
    use crate::cube::{empty, pow2_ceil};
    use crate::graph::{launch, tensor_arg};
    use burn::tensor::DType;
    use burn_cubecl::{tensor::CubeTensor, CubeRuntime};
    use cubecl::prelude::*;

    /// Code `n` of a packed word as a signed value.
    #[cube]
    fn signed_code(word: u32, #[comptime] n: usize) -> f32 {
        f32::cast_from((word >> (n as u32 * 8)) & 255u32) - 128.0f32
    }

    /// Packs a code (already offset to `0..=255`) at position `n` of a word.
    #[cube]
    pub(crate) fn placed(code: f32, #[comptime] n: usize) -> u32 {
        u32::cast_from(code) << (n as u32 * 8)
    }

    #[cube(launch)]
    fn store_kernel<F: Float>(
        x: &Tensor<F>,
        codes: &mut Tensor<u32>,
        scales: &mut Tensor<f32>,
        slot: u32,
        #[define(F)] _dtype: StorageType,
    ) {
        let heads = x.shape(1);
        let dim = x.shape(3);
        let words = dim / 4;
        let slots = codes.shape(2);
        let row = CUBE_POS_X as usize;
        let bh = CUBE_POS_Y as usize;
        let b = bh / heads;
        let h = bh % heads;
        let unit = UNIT_POS_X as usize;
        let mut scratch = SharedMemory::<f32>::new(256usize);
        let x_base = b * x.stride(0) + h * x.stride(1) + row * x.stride(2);
        let mut v = Array::<f32>::new(4usize);
        let mut amax = 0.0f32;
        if unit < words {
            #[unroll]
            for n in 0..4usize {
                v[n] = f32::cast_from(x[x_base + (unit * 4 + n) * x.stride(3)]);
                let a = f32::abs(v[n]);
                if a > amax {
                    amax = a;
                }
            }
        }
        let scale = crate::cube::cube_max(amax, &mut scratch) / 127.0f32;
        let mut inv = 0.0f32;
        if scale > 0.0f32 {
            inv = 1.0f32 / scale;
        }
        let dst = (bh * slots + slot as usize + row) * words;
        if unit < words {
            let mut word = 0u32;
            #[unroll]
            for n in 0..4usize {
                let q = f32::round(v[n] * inv).clamp(f32::new(-127.0), 127.0f32) + 128.0f32;
                word |= placed(q, n);
            }
            codes[dst + unit] = word;
        }
        if unit == 0 {
            scales[bh * slots + slot as usize + row] = scale;
        }
    }

    #[cube(launch)]
    fn load_kernel<F: Float>(
        codes: &Tensor<u32>,
        scales: &Tensor<f32>,
        out: &mut Tensor<F>,
        start: u32,
        #[define(F)] _dtype: StorageType,
    ) {
        let idx = crate::cube::unit_index();
        let words = codes.shape(3);
        let n = out.shape(2);
        if idx >= out.len() / 4 {
            terminate!();
        }
        let w = idx % words;
        let row = (idx / words) % n;
        let bh = idx / (words * n);
        let slot = bh * codes.shape(2) + start as usize + row;
        let word = codes[slot * words + w];
        let scale = scales[slot];
        #[unroll]
        for n in 0..4usize {
            out[idx * 4 + n] = F::cast_from(signed_code(word, n) * scale);
        }
    }

    /// Quantizes `x` (`[batch, heads, t, dim]`, any strides) into slots `slot..slot + t` of the
    /// packed `codes` (`[batch, heads, slots, dim / 4]`) and `scales` (`[batch, heads, slots]`),
    /// writing their buffers in place: the caller owns them.
    pub fn store<R: CubeRuntime>(x: CubeTensor<R>, codes: &CubeTensor<R>, scales: &CubeTensor<R>, slot: usize) {
        let [b, h, t, dim] = [x.meta.shape()[0], x.meta.shape()[1], x.meta.shape()[2], x.meta.shape()[3]];
        if b * h * t * dim == 0 {
            return;
        }
        let threads = pow2_ceil(dim / 4).clamp(32, 256) as u32;
        let dtype = x.dtype.into();
        launch!(store_kernel(
            &x.client,
            CubeCount::Static(t as u32, (b * h) as u32, 1),
            CubeDim::new_1d(threads),
            tensor_arg(&x),
            tensor_arg(codes),
            tensor_arg(scales),
            slot as u32,
            dtype,
        ));
    }

    /// Slots `start..start + n` dequantized to `dtype`, `[batch, heads, n, dim]`.
    pub fn load<R: CubeRuntime>(
        codes: &CubeTensor<R>,
        scales: &CubeTensor<R>,
        start: usize,
        n: usize,
        dtype: DType,
    ) -> CubeTensor<R> {
        let [b, h, _, words] =
            [codes.meta.shape()[0], codes.meta.shape()[1], codes.meta.shape()[2], codes.meta.shape()[3]];
        let out = empty(codes, [b, h, n, words * 4], dtype);
        let total = b * h * n * words;
        if total == 0 {
            return out;
        }
        let (count, dim) = crate::cube::elementwise(total, 256);
        launch!(load_kernel(
            &codes.client,
            count,
            dim,
            tensor_arg(codes),
            tensor_arg(scales),
            tensor_arg(&out),
            start as u32,
            dtype.into(),
        ));
        out
    }
}

#[cfg(test)]
pub(crate) mod check {
    use super::*;
    use crate::kv::{KvFormat, KvStore};
    use crate::{gpu_test::assert_close, AttentionMask, AttentionOptions, GemmaBackend};
    use burn::tensor::{Distribution, TensorData};

    fn host<B: Backend, const D: usize>(t: Tensor<B, D>) -> Vec<f32> {
        t.cast(DType::F32).into_data().to_vec::<f32>().expect("f32 data")
    }

    /// Stores rows in two appends (keys and values alike), loads them back and attends over them (decode and a short
    /// prefill, global and windowed, GQA), against host int8 quantization and the reference
    /// attention over the host-dequantized keys and values.
    pub fn int8_kv<B: GemmaBackend>(device: &B::Device, dtype: DType) {
        for (batch, heads, q_heads, dim, slots, first, second) in
            [(1, 1, 4, 256, 700, 517, 1), (2, 2, 4, 64, 37, 30, 5), (1, 3, 3, 12, 9, 2, 7)]
        {
            let shape = [batch, heads, slots, dim];
            let mut cache: KvStore<B> = B::kv_zeros(shape, KvFormat::Int8, device);
            let a =
                Tensor::<B, 4>::random([batch, heads, first, dim], Distribution::Normal(0.0, 1.0), device).cast(dtype);
            let b =
                Tensor::<B, 4>::random([batch, heads, second, dim], Distribution::Normal(0.0, 3.0), device).cast(dtype);
            cache = B::kv_write(cache, a.clone(), a.clone(), 0);
            // The second append through a transposed view: the kernel reads strides.
            let b_strided = b.clone().swap_dims(2, 3).into_data();
            let b_view = Tensor::<B, 4>::from_data(b_strided, device).swap_dims(2, 3);
            cache = B::kv_write(cache, b_view.clone(), b_view, first);
            let len = first + second;
            let all = Tensor::cat(vec![a, b], 2);
            // Host quantization of every (sequence, head, row).
            let xs = host(all.clone());
            let mut expected = vec![0.0f32; xs.len()];
            for (src, dst) in xs.chunks_exact(dim).zip(expected.chunks_exact_mut(dim)) {
                let scale = src.iter().fold(0.0f32, |m, v| m.max(v.abs())) / 127.0;
                for (d, &v) in dst.iter_mut().zip(src) {
                    *d = if scale > 0.0 { (v / scale).round().clamp(-127.0, 127.0) * scale } else { 0.0 };
                }
            }
            let expected =
                Tensor::<B, 4>::from_data(TensorData::new(expected, [batch, heads, len, dim]), (device, DType::F32));
            let (loaded, loaded_values) = B::kv_read(&cache, 0..len, dtype);
            assert_eq!(loaded.dtype(), dtype);
            assert_close(loaded_values, loaded.clone(), 0.0, "int8 values stored like the keys");
            // One code step: rounding at a .5 boundary may differ by one.
            assert_close(
                loaded.clone(),
                expected.clone(),
                crate::gpu_test::tolerance(dtype).max(2.0 / 127.0 * 3.0),
                &format!("int8 kv load {shape:?}"),
            );
            let (tail, _) = B::kv_read(&cache, first..len, dtype);
            assert_close(
                tail,
                expected.clone().slice(s![.., .., first..len, ..]),
                crate::gpu_test::tolerance(dtype).max(6.0 / 127.0),
                "int8 kv load tail",
            );

            let dense = loaded.clone();
            for (q_len, window) in [(1, None), (1, Some(5)), (3, None), (2, Some(4))] {
                let q = Tensor::<B, 4>::random([batch, q_heads, q_len, dim], Distribution::Normal(0.0, 1.0), device)
                    .cast(dtype);
                let mask = AttentionMask { q_offset: len - q_len, k_offset: 0, window };
                let scale = (dim as f64).powf(-0.5);
                let options = AttentionOptions { mask, scale, softcap: Some(50.0) };
                let got = B::grouped_attention(q.clone(), cache.view(len), &options).expect("no position to read");
                // f64 on the host: the backend's own matmul may run f32 at TF32 precision.
                let dims = [batch, q_heads, heads, q_len, len, dim];
                let want = crate::attention::naive(
                    &host(q.clone()),
                    &host(dense.clone()),
                    &host(dense.clone()),
                    dims,
                    &options,
                );
                let want = Tensor::<B, 4>::from_data(
                    TensorData::new(want, [batch, q_heads, q_len, dim]),
                    (device, DType::F32),
                );
                assert_eq!(got.dtype(), dtype);
                assert_close(
                    got,
                    want,
                    crate::gpu_test::tolerance(dtype) * 4.0,
                    &format!("int8 attention q_len {q_len} window {window:?} {shape:?}"),
                );
            }
        }
    }
}

#[cfg(all(test, feature = "ndarray"))]
mod reference_tests {
    #[test]
    fn reference_round_trips_and_attends() {
        super::check::int8_kv::<crate::test_util::TestBackend>(&Default::default(), burn::tensor::DType::F32);
    }
}

#[cfg(test)]
mod gpu {
    use crate::gpu_test::seed;
    use crate::GemmaBackend;
    use burn::tensor::DType;

    pub fn int8_kv<B: GemmaBackend>(device: &B::Device, dtype: DType) {
        seed::<B>(device, "int8_kv");
        super::check::int8_kv::<B>(device, dtype);
    }

    gpu_tests!(int8_kv_matches_host => int8_kv);
}
