//! GELU (tanh approximation) of the gate times the up projection.

use burn::tensor::{activation::gelu_approximate, backend::Backend, Tensor};

/// Reference: `gelu_tanh(gate) * up` in the input dtype.
pub fn reference<B: Backend>(gate: Tensor<B, 3>, up: Tensor<B, 3>) -> Tensor<B, 3> {
    gelu_approximate(gate) * up
}

/// Reference for a joined projection: `x` is `[..., 2m]` with the gate in the first `m` columns
/// and the up projection in the last `m`; returns `[..., m]`.
pub fn halves_reference<B: Backend>(x: Tensor<B, 3>) -> Tensor<B, 3> {
    let [batch, seq, width] = x.dims();
    let m = width / 2;
    let gate = x.clone().slice([0..batch, 0..seq, 0..m]);
    let up = x.slice([0..batch, 0..seq, m..width]);
    reference(gate, up)
}

/// CubeCL kernels: one unit per output element, computed in f32.
pub(crate) mod kernel {
    use crate::cube::{elementwise, empty, tanh_f32, unit_index};
    use burn_cubecl::{tensor::CubeTensor, CubeRuntime};
    use cubecl::prelude::*;

    /// `gelu_tanh(g) * u` in f32.
    #[cube]
    fn gelu_mul_f32(g: f32, u: f32) -> f32 {
        // sqrt(2 / pi)
        let inner = 0.797_884_6f32 * (g + 0.044715f32 * g * g * g);
        0.5f32 * g * (1.0f32 + tanh_f32(inner)) * u
    }

    #[cube(launch)]
    fn gelu_mul_kernel<F: Float>(gate: &Array<F>, up: &Array<F>, out: &mut Array<F>, #[define(F)] _dtype: StorageType) {
        let i = unit_index();
        if i >= out.len() {
            terminate!();
        }
        out[i] = F::cast_from(gelu_mul_f32(f32::cast_from(gate[i]), f32::cast_from(up[i])));
    }

    /// `x`: rows of `2 * m` values, the gate then the up projection.
    #[cube(launch)]
    fn gelu_mul_halves_kernel<F: Float>(x: &Array<F>, out: &mut Array<F>, m: u32, #[define(F)] _dtype: StorageType) {
        let i = unit_index();
        if i >= out.len() {
            terminate!();
        }
        let m = m as usize;
        let at = (i / m) * 2 * m + i % m;
        out[i] = F::cast_from(gelu_mul_f32(f32::cast_from(x[at]), f32::cast_from(x[at + m])));
    }

    /// `x`: contiguous `[..., 2m]`; returns `[..., m]`.
    pub fn gelu_mul_halves<R: CubeRuntime>(x: CubeTensor<R>) -> CubeTensor<R> {
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
        gelu_mul_halves_kernel::launch::<R>(&x.client, count, dim, x.clone().into_array_arg(), out.clone().into_array_arg(), m as u32, dtype);
        out
    }

    /// `gate`, `up`: contiguous, same shape and dtype.
    pub fn gelu_mul<R: CubeRuntime>(gate: CubeTensor<R>, up: CubeTensor<R>) -> CubeTensor<R> {
        let shape = gate.meta.shape().clone();
        let out = empty(&gate, shape.clone(), gate.dtype);
        let elements = shape.num_elements();
        if elements == 0 {
            return out;
        }
        let (count, dim) = elementwise(elements, 256);
        let dtype = gate.dtype.into();
        gelu_mul_kernel::launch::<R>(
            &gate.client,
            count,
            dim,
            gate.clone().into_array_arg(),
            up.into_array_arg(),
            out.clone().into_array_arg(),
            dtype,
        );
        out
    }
}

#[cfg(test)]
mod gpu {
    use crate::gpu_test::{assert_close, seed, tolerance};
    use crate::GemmaBackend;
    use burn::tensor::{DType, Distribution, Tensor};

    /// Odd sizes, Gemma's intermediate widths, and gate values large enough to saturate tanh.
    pub fn gelu_mul<B: GemmaBackend>(device: &B::Device, dtype: DType) {
        seed::<B>(device, "gelu_mul");
        for (shape, spread) in [([1, 1, 2048], 1.0), ([2, 7, 6912], 3.0), ([1, 3, 1001], 25.0), ([3, 1, 10240], 1.0)] {
            let gate = Tensor::<B, 3>::random(shape, Distribution::Normal(0.0, spread), device).cast(dtype);
            let up = Tensor::<B, 3>::random(shape, Distribution::Normal(0.0, 1.0), device).cast(dtype);
            let got = B::gelu_mul(gate.clone(), up.clone());
            assert_eq!(got.dtype(), dtype);
            let expected = super::reference(gate.cast(DType::F32), up.cast(DType::F32));
            assert_close(got, expected, tolerance(dtype), &format!("gelu_mul {shape:?} (gate std {spread})"));
        }
    }

    /// The joined form on odd widths (the two halves must not be mixed up).
    pub fn gelu_mul_halves<B: GemmaBackend>(device: &B::Device, dtype: DType) {
        seed::<B>(device, "gelu_mul_halves");
        for shape in [[1, 1, 2 * 1152], [2, 3, 2 * 37], [1, 5, 2 * 6912]] {
            let x = Tensor::<B, 3>::random(shape, Distribution::Normal(0.0, 2.0), device).cast(dtype);
            let got = B::gelu_mul_halves(x.clone());
            assert_eq!((got.dims(), got.dtype()), ([shape[0], shape[1], shape[2] / 2], dtype));
            let expected = super::halves_reference(x.cast(DType::F32));
            assert_close(got, expected, tolerance(dtype), &format!("gelu_mul_halves {shape:?}"));
        }
    }

    gpu_tests!(gelu_mul_matches_reference => gelu_mul, gelu_mul_halves_matches_reference => gelu_mul_halves);
}
