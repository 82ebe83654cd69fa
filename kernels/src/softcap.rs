//! Logit softcapping (Gemma 2).

use burn::tensor::{backend::Backend, Tensor};

/// Reference: `tanh(x / cap) * cap`.
pub fn reference<B: Backend, const D: usize>(x: Tensor<B, D>, cap: f64) -> Tensor<B, D> {
    x.div_scalar(cap).tanh().mul_scalar(cap)
}

/// CubeCL kernel: one unit per element, computed in f32.
pub(crate) mod kernel {
    use crate::cube::{elementwise, empty, tanh_f32, unit_index};
    use crate::graph::{arg, launch};
    use burn_cubecl::{tensor::CubeTensor, CubeRuntime};
    use cubecl::prelude::*;

    #[cube(launch)]
    fn softcap_kernel<F: Float>(x: &Array<F>, out: &mut Array<F>, cap: f32, #[define(F)] _dtype: StorageType) {
        let i = unit_index();
        if i >= out.len() {
            terminate!();
        }
        out[i] = F::cast_from(tanh_f32(f32::cast_from(x[i]) / cap) * cap);
    }

    /// `x`: contiguous.
    pub fn softcap<R: CubeRuntime>(x: CubeTensor<R>, cap: f64) -> CubeTensor<R> {
        let shape = x.meta.shape().clone();
        let out = empty(&x, shape.clone(), x.dtype);
        let elements = shape.num_elements();
        if elements == 0 {
            return out;
        }
        let (count, dim) = elementwise(elements, 256);
        let dtype = x.dtype.into();
        launch!(softcap_kernel(&x.client, count, dim, arg(&x), arg(&out), cap as f32, dtype,));
        out
    }
}

#[cfg(test)]
mod gpu {
    use crate::gpu_test::{assert_close, seed, tolerance};
    use crate::GemmaBackend;
    use burn::tensor::{DType, Distribution, Tensor};

    /// Gemma 2's caps (30 for logits, 50 for attention) on values well past the cap.
    pub fn softcap<B: GemmaBackend>(device: &B::Device, dtype: DType) {
        seed::<B>(device, "softcap");
        for (shape, cap) in [([1, 262_144], 30.0), ([7, 333], 50.0), ([3, 1], 30.0)] {
            let x = Tensor::<B, 2>::random(shape, Distribution::Normal(0.0, 60.0), device).cast(dtype);
            let got = B::softcap(x.clone(), cap);
            assert_eq!(got.dtype(), dtype);
            let expected = super::reference(x.cast(DType::F32), cap);
            assert_close(got, expected, tolerance(dtype), &format!("softcap {shape:?} cap {cap}"));
        }
    }

    gpu_tests!(softcap_matches_reference => softcap);
}
