//! Writing rows into a dense store in place.
//!
//! The store's buffers are written where they are, whoever else holds them: a recorded decode
//! step (see [`crate::graph`]) keeps the store's memory and must see what eager prefill writes
//! there. (Burn's `slice_assign` copies a tensor whose buffer is shared before writing it.)

/// CubeCL kernel: one unit per element of the rows, cast to the store's dtype.
pub(crate) mod kernel {
    use crate::cube::elementwise;
    use crate::graph::{launch, tensor_arg};
    use burn_cubecl::{tensor::CubeTensor, CubeRuntime};
    use cubecl::prelude::*;

    #[cube(launch)]
    fn write_kernel<F: Float, C: Float>(
        x: &Tensor<F>,
        store: &mut Tensor<C>,
        slot: u32,
        #[define(F, C)] _dtypes: [StorageType; 2],
    ) {
        let i = (CUBE_POS_Y * CUBE_COUNT_X + CUBE_POS_X) as usize * CUBE_DIM_X as usize + UNIT_POS_X as usize;
        let (heads, rows, dim) = (x.shape(1), x.shape(2), x.shape(3));
        if i >= x.shape(0) * heads * rows * dim {
            terminate!();
        }
        let d = i % dim;
        let r = (i / dim) % rows;
        let h = (i / (dim * rows)) % heads;
        let b = i / (dim * rows * heads);
        let from = b * x.stride(0) + h * x.stride(1) + r * x.stride(2) + d * x.stride(3);
        let to =
            b * store.stride(0) + h * store.stride(1) + (slot as usize + r) * store.stride(2) + d * store.stride(3);
        store[to] = C::cast_from(x[from]);
    }

    /// `x` (`[batch, heads, t, dim]`, any strides) into slots `slot..slot + t` of `store`
    /// (`[batch, heads, slots, dim]`, any strides), in place.
    pub fn write<R: CubeRuntime>(x: CubeTensor<R>, store: &CubeTensor<R>, slot: usize) {
        let elements = x.meta.num_elements();
        if elements == 0 {
            return;
        }
        let (count, dim) = elementwise(elements, 256);
        let dtypes = [x.dtype.into(), store.dtype.into()];
        launch!(write_kernel(&x.client, count, dim, tensor_arg(&x), tensor_arg(store), slot as u32, dtypes));
    }
}

#[cfg(test)]
mod gpu {
    use crate::gpu_test::{assert_close, seed};
    use crate::{GemmaBackend, KvFormat, KvStore};
    use burn::tensor::{s, DType, Distribution, Tensor};

    /// Rows written at the first, a middle and the last slots, from contiguous and strided
    /// (head-swapped) inputs, into stores of another dtype: the same as the reference, and the
    /// write lands in the store's own buffer even when that buffer is shared.
    pub fn dense_kv_write<B: GemmaBackend>(device: &B::Device, dtype: DType) {
        seed::<B>(device, "dense_kv_write");
        for (batch, heads, slots, dim, slot, t) in [(1, 1, 9, 256, 0, 1), (2, 3, 17, 64, 5, 7), (1, 4, 8, 12, 7, 1)] {
            for strided in [false, true] {
                let x = |seed_shift: f64| {
                    let x = if strided {
                        Tensor::<B, 4>::random([batch, t, heads, dim], Distribution::Normal(seed_shift, 1.0), device)
                            .swap_dims(1, 2)
                    } else {
                        Tensor::<B, 4>::random([batch, heads, t, dim], Distribution::Normal(seed_shift, 1.0), device)
                    };
                    x.cast(DType::F32)
                };
                let (k, v) = (x(0.0), x(0.5));
                let shape = [batch, heads, slots, dim];
                let store = B::kv_zeros(shape, KvFormat::Dense(dtype), device);
                let reference = crate::kv::write_reference(store.clone(), k.clone(), v.clone(), slot);
                // A second holder of the store's buffers must see the write (in place).
                let shared = store.clone();
                let written = B::kv_write(store, k, v, slot);
                let what = format!("dense kv b{batch} h{heads} slots {slots} d{dim} at {slot}+{t} strided {strided}");
                let (KvStore::Dense { keys: rk, values: rv }, KvStore::Dense { keys: wk, values: wv }) =
                    (reference, written)
                else {
                    panic!("{what}: dense stores expected");
                };
                assert_eq!(wk.dtype(), dtype, "{what}");
                assert_close(wk.clone(), rk.clone(), 0.0, &format!("{what}: keys"));
                assert_close(wv, rv, 0.0, &format!("{what}: values"));
                if let KvStore::Dense { keys: sk, .. } = shared {
                    assert_close(
                        sk.slice(s![.., .., slot..slot + t, ..]),
                        wk.slice(s![.., .., slot..slot + t, ..]),
                        0.0,
                        &format!("{what}: shared buffer"),
                    );
                }
            }
        }
    }

    gpu_tests!(dense_kv_write_matches_reference_in_place => dense_kv_write);
}
