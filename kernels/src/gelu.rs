//! GELU (tanh approximation) of the gate times the up projection.

use burn::tensor::{activation::gelu_approximate, backend::Backend, Tensor};

/// Reference: `gelu_tanh(gate) * up` in the input dtype.
pub fn reference<B: Backend>(gate: Tensor<B, 3>, up: Tensor<B, 3>) -> Tensor<B, 3> {
    gelu_approximate(gate) * up
}

/// Where the gate and up columns sit in a joined gate/up projection of width `2m`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GateUpLayout {
    /// The gate in the first `m` columns, the up projection in the last `m`.
    Halves,
    /// Interleaved in blocks of [`PAIR_BLOCK`] ([`interleave_pairs`]).
    Pairs,
}

/// Reference for a joined projection `x` (`[batch, seq, 2m]`, laid out as `layout` says):
/// `gelu_tanh(gate) * up`, `[batch, seq, m]`.
pub fn joined_reference<B: Backend>(x: Tensor<B, 3>, layout: GateUpLayout) -> Tensor<B, 3> {
    match layout {
        GateUpLayout::Halves => halves_reference(x),
        GateUpLayout::Pairs => {
            let [batch, seq, width] = x.dims();
            pairs_reference(x.reshape([batch * seq, width])).reshape([batch, seq, width / 2])
        }
    }
}

fn halves_reference<B: Backend>(x: Tensor<B, 3>) -> Tensor<B, 3> {
    let [batch, seq, width] = x.dims();
    let m = width / 2;
    let gate = x.clone().slice([0..batch, 0..seq, 0..m]);
    let up = x.slice([0..batch, 0..seq, m..width]);
    reference(gate, up)
}

/// Rows per block when the gate and up projections are interleaved for
/// [`crate::Epilogue::GeluPairs`]: rows `8j..8j+4` of the joined matrix are gate rows
/// `4j..4j+4`, rows `8j+4..8j+8` the up rows of the same features, so one GEMV cube (8 rows) holds
/// both halves of its 4 output features.
pub const PAIR_BLOCK: usize = 4;

/// Whether an MLP of `intermediate` features can use the interleaved layout.
pub fn pairs_fit(intermediate: usize) -> bool {
    intermediate > 0 && intermediate.is_multiple_of(PAIR_BLOCK)
}

/// The joined `[2m, in]` matrix of `gate` and `up` (`[m, in]` each, `m` a multiple of
/// [`PAIR_BLOCK`]) with their rows interleaved in blocks of [`PAIR_BLOCK`].
pub fn interleave_pairs<B: Backend>(gate: Tensor<B, 2>, up: Tensor<B, 2>) -> Tensor<B, 2> {
    let [m, inp] = gate.dims();
    let blocks = m / PAIR_BLOCK;
    let gate = gate.reshape([blocks, PAIR_BLOCK, inp]);
    let up = up.reshape([blocks, PAIR_BLOCK, inp]);
    Tensor::cat(vec![gate, up], 1).reshape([2 * m, inp])
}

/// Reference for a product through an interleaved matrix ([`interleave_pairs`]): `y` is
/// `[n, 2m]` with gate and up columns interleaved in blocks of [`PAIR_BLOCK`]; returns
/// `gelu_tanh(gate) * up`, `[n, m]`.
pub fn pairs_reference<B: Backend>(y: Tensor<B, 2>) -> Tensor<B, 2> {
    let [n, width] = y.dims();
    let (m, blocks) = (width / 2, width / (2 * PAIR_BLOCK));
    let y = y.reshape([n, blocks, 2, PAIR_BLOCK]);
    let gate = y.clone().slice([0..n, 0..blocks, 0..1, 0..PAIR_BLOCK]).reshape([n, m]);
    let up = y.slice([0..n, 0..blocks, 1..2, 0..PAIR_BLOCK]).reshape([n, m]);
    gelu_approximate(gate) * up
}

/// CubeCL kernels: one unit per output element, computed in f32.
pub(crate) mod kernel {
    use super::{GateUpLayout, PAIR_BLOCK};
    use crate::cube::{elementwise, empty, tanh_f32, unit_index};
    use crate::graph::{arg, launch};
    use burn_cubecl::{tensor::CubeTensor, CubeRuntime};
    use cubecl::prelude::*;

    /// `gelu_tanh(g) * u` in f32.
    #[cube]
    pub(crate) fn gelu_mul_f32(g: f32, u: f32) -> f32 {
        // sqrt(2 / pi)
        let inner = 0.797_884_6f32 * (g + 0.044715f32 * g * g * g);
        0.5f32 * g * (1.0f32 + tanh_f32(inner)) * u
    }

    /// `x`: rows of `2 * m` values, the gate then the up projection, or with `pairs` the two
    /// interleaved in blocks of [`PAIR_BLOCK`] ([`super::interleave_pairs`]).
    #[cube(launch)]
    fn gelu_mul_joined_kernel<F: Float>(
        x: &Array<F>,
        out: &mut Array<F>,
        m: u32,
        #[comptime] pairs: bool,
        #[define(F)] _dtype: StorageType,
    ) {
        let i = unit_index();
        if i >= out.len() {
            terminate!();
        }
        let m = m as usize;
        let (row, f) = (i / m, i % m);
        let mut at = row * 2 * m + f;
        let mut up = m;
        if pairs {
            at = row * 2 * m + (f / PAIR_BLOCK) * 2 * PAIR_BLOCK + f % PAIR_BLOCK;
            up = PAIR_BLOCK;
        }
        out[i] = F::cast_from(gelu_mul_f32(f32::cast_from(x[at]), f32::cast_from(x[at + up])));
    }

    /// `gelu_tanh(gate[r, c]) * inputs[r, layer, c]` for rows of `width` values.
    #[cube(launch)]
    fn gelu_gate_kernel<F: Float, U: Float>(
        gate: &Array<F>,
        inputs: &Array<U>,
        out: &mut Array<F>,
        width: u32,
        layers: u32,
        layer: u32,
        #[define(F, U)] _dtypes: [StorageType; 2],
    ) {
        let i = unit_index();
        if i >= out.len() {
            terminate!();
        }
        let (width, layers) = (width as usize, layers as usize);
        let (row, c) = (i / width, i % width);
        let up = inputs[(row * layers + layer as usize) * width + c];
        out[i] = F::cast_from(gelu_mul_f32(f32::cast_from(gate[i]), f32::cast_from(up)));
    }

    /// `gate`: contiguous `[..., width]`; `inputs`: contiguous `[..., layers, width]` with the
    /// same leading dims. Returns `gelu_tanh(gate) * inputs[..., layer, :]` in `gate`'s dtype.
    pub fn gelu_gate<R: CubeRuntime>(gate: CubeTensor<R>, inputs: CubeTensor<R>, layer: usize) -> CubeTensor<R> {
        let shape = gate.meta.shape().clone();
        let dims = inputs.meta.shape().num_dims();
        let (layers, width) = (inputs.meta.shape()[dims - 2], inputs.meta.shape()[dims - 1]);
        let out = empty(&gate, shape.clone(), gate.dtype);
        let elements = shape.num_elements();
        if elements == 0 {
            return out;
        }
        let (count, dim) = elementwise(elements, 256);
        let dtypes = [gate.dtype.into(), inputs.dtype.into()];
        launch!(gelu_gate_kernel(
            &gate.client,
            count,
            dim,
            arg(&gate),
            arg(&inputs),
            arg(&out),
            width as u32,
            layers as u32,
            layer as u32,
            dtypes
        ));
        out
    }

    /// `x`: contiguous `[..., 2m]` laid out as `layout` says; returns `[..., m]`.
    pub fn gelu_mul_joined<R: CubeRuntime>(x: CubeTensor<R>, layout: GateUpLayout) -> CubeTensor<R> {
        let mut shape = x.meta.shape().clone();
        let last = shape.num_dims() - 1;
        let m = shape[last] / 2;
        shape[last] = m;
        let out = empty(&x, shape.clone(), x.dtype);
        let elements = shape.num_elements();
        if elements == 0 {
            return out;
        }
        let (count, dim) = elementwise(elements, 256);
        let dtype = x.dtype.into();
        launch!(gelu_mul_joined_kernel(
            &x.client,
            count,
            dim,
            arg(&x),
            arg(&out),
            m as u32,
            layout == GateUpLayout::Pairs,
            dtype,
        ));
        out
    }
}

#[cfg(test)]
mod gpu {
    use super::{GateUpLayout, PAIR_BLOCK};
    use crate::gpu_test::{assert_close, seed, tolerance};
    use crate::quant::check::{host, values};
    use crate::{Epilogue, GemmaBackend, HostMatrix, HostQuantized, QuantFormat};
    use burn::tensor::{DType, Distribution, Tensor, TensorData};

    /// Both joined layouts on odd sizes and Gemma's intermediate widths (the two halves must not
    /// be mixed up), with gate values large enough to saturate tanh.
    pub fn gelu_mul<B: GemmaBackend>(device: &B::Device, dtype: DType) {
        seed::<B>(device, "gelu_mul");
        let cases =
            [([1, 1, 2048], 1.0), ([2, 7, 6912], 3.0), ([1, 3, 1001], 25.0), ([3, 1, 10240], 1.0), ([2, 3, 36], 2.0)];
        for (shape, spread) in cases {
            let gate = Tensor::<B, 3>::random(shape, Distribution::Normal(0.0, spread), device).cast(dtype);
            let up = Tensor::<B, 3>::random(shape, Distribution::Normal(0.0, 1.0), device).cast(dtype);
            let expected = super::reference(gate.clone().cast(DType::F32), up.clone().cast(DType::F32));
            let [batch, seq, m] = shape;
            let mut joined = vec![(GateUpLayout::Halves, Tensor::cat(vec![gate.clone(), up.clone()], 2))];
            if m % PAIR_BLOCK == 0 {
                let blocks = |t: Tensor<B, 3>| t.reshape([batch, seq, m / PAIR_BLOCK, PAIR_BLOCK]);
                let pairs = Tensor::cat(vec![blocks(gate.clone()), blocks(up.clone())], 3).reshape([batch, seq, 2 * m]);
                joined.push((GateUpLayout::Pairs, pairs));
            }
            for (layout, x) in joined {
                let got = B::gelu_mul(x, layout);
                assert_eq!((got.dims(), got.dtype()), (shape, dtype));
                let what = format!("gelu_mul {layout:?} {shape:?} (gate std {spread})");
                assert_close(got, expected.clone(), tolerance(dtype), &what);
            }
            // Gemma 4's per-layer input gate: `up` as one layer of 3 (in f32), the others noise.
            let noise = || Tensor::<B, 4>::random([batch, seq, 1, m], Distribution::Normal(0.0, 1.0), device);
            let inputs = Tensor::cat(vec![noise(), up.clone().cast(DType::F32).unsqueeze_dim(2), noise()], 2);
            let got = B::gelu_gate(gate.clone(), inputs, 1);
            assert_eq!((got.dims(), got.dtype()), (shape, dtype));
            assert_close(got, expected.clone(), tolerance(dtype), &format!("gelu_gate {shape:?} (gate std {spread})"));
        }
    }

    /// `gelu_tanh(x @ gate^T) * (x @ up^T)` from f64 products on the host (`gate`, `up`:
    /// `[m, inp]` row-major); the tolerance covers the kernel's rounding of its products to the
    /// activation dtype.
    fn expected_pairs<B: GemmaBackend>(
        x: &[f32],
        gate: &[f32],
        up: &[f32],
        [n, inp, m]: [usize; 3],
        device: &B::Device,
    ) -> Tensor<B, 2> {
        let dot = |r: usize, w: &[f32], o: usize| {
            (0..inp).map(|c| x[r * inp + c] as f64 * w[o * inp + c] as f64).sum::<f64>()
        };
        let values: Vec<f32> = (0..n)
            .flat_map(|r| {
                (0..m).map(move |o| {
                    let (g, u) = (dot(r, gate, o), dot(r, up, o));
                    (0.5 * g * (1.0 + (0.797_884_560_8 * (g + 0.044715 * g * g * g)).tanh()) * u) as f32
                })
            })
            .collect();
        Tensor::<B, 2>::from_data(TensorData::new(values, [n, m]), (device, DType::F32))
    }

    /// The GELU epilogue of the joined gate/up product (dense and Q8/Q4 weights): 1 to 8 rows
    /// (the GEMV kernels), 9 and 12 (the matmul path), odd and Gemma widths, against f64 host
    /// products of the separate matrices.
    pub fn project_gelu_pairs<B: GemmaBackend>(device: &B::Device, dtype: DType) {
        let seed = seed::<B>(device, "project_gelu_pairs");
        let shapes =
            [(1, 1152, 6912), (3, 640, 36), (8, 96, 4), (2, 2560, 1028), (2, 4096, 1056), (9, 64, 12), (12, 160, 20)];
        for (i, (n, inp, m)) in shapes.into_iter().enumerate() {
            let x = Tensor::<B, 2>::random([n, inp], Distribution::Normal(0.0, 1.0), device).cast(dtype);
            let tol =
                tolerance(dtype) * if dtype == DType::F32 && n > crate::linear::GEMV_MAX_ROWS { 20.0 } else { 2.0 };
            // Dense weights in the activation dtype.
            let gate = Tensor::<B, 2>::random([m, inp], Distribution::Normal(0.0, 0.05), device).cast(dtype);
            let up = Tensor::<B, 2>::random([m, inp], Distribution::Normal(0.0, 0.05), device).cast(dtype);
            let expected =
                expected_pairs::<B>(&host(x.clone()), &host(gate.clone()), &host(up.clone()), [n, inp, m], device);
            let joined =
                B::upload_matrix(HostMatrix::Dense(super::interleave_pairs(gate, up)), device).expect("dense upload");
            let got = B::project(x.clone(), &joined, Epilogue::GeluPairs);
            assert_eq!((got.dims(), got.dtype()), ([n, m], dtype));
            assert_close(got, expected, tol, &format!("dense gelu pairs {n}x{inp} -> {m}"));
            // Block-quantized weights, interleaved on the host.
            for format in [QuantFormat::Q8, QuantFormat::Q4] {
                let quantize = |s: u64| HostQuantized::quantize(&values(m * inp, s), m, inp, format).expect("quantize");
                let (gate, up) = (quantize(seed + 2 * i as u64), quantize(seed + 2 * i as u64 + 1));
                let expected =
                    expected_pairs::<B>(&host(x.clone()), &gate.dequantize(), &up.dequantize(), [n, inp, m], device);
                let joined = HostQuantized::interleave_pairs(gate, up, super::PAIR_BLOCK).expect("same shapes");
                let joined = B::upload_matrix(HostMatrix::Quantized(joined), device).expect("quantized upload");
                let got = B::project(x.clone(), &joined, Epilogue::GeluPairs);
                assert_eq!((got.dims(), got.dtype()), ([n, m], dtype));
                assert_close(got, expected, tol, &format!("{format} gelu pairs {n}x{inp} -> {m}"));
            }
        }
    }

    gpu_tests!(
        gelu_mul_matches_reference => gelu_mul,
        project_gelu_pairs_matches_host => project_gelu_pairs,
    );
}

#[cfg(all(test, feature = "ndarray"))]
mod reference_tests {
    use crate::test_util::TestBackend;
    use burn::tensor::DType;

    /// The reference path (matrix product, then the interleaved halves taken apart) against the
    /// separate host products.
    #[test]
    fn pairs_reference_matches_host() {
        super::gpu::project_gelu_pairs::<TestBackend>(&Default::default(), DType::F32);
    }
}
