//! Rows of a product's left operand padded with zeros to a multiple of [`ROW_ALIGN`].
//!
//! CubeCL's tiled matmul kernels compile bounds checks into every load when `m` is not a
//! multiple of their stage's rows, and those run about ten times slower: on the H200 a random
//! 1B prompt of 513 tokens took 9.4x one of 512 (`docs/gpu-runs/2026-11-26-prefix`, call 5) and
//! its products 0.7 ms each where 512 rows take 0.05 ms (`docs/gpu-runs/2026-11-27-prefill`,
//! call 1). Padding the rows with zeros and dropping the extra output rows costs at most
//! `ROW_ALIGN - 1` rows of work.

use crate::cube::{elementwise, empty, unit_index};
use crate::graph::{arg, launch};
use burn_cubecl::{kernel::into_contiguous, kernel::slice, tensor::CubeTensor, CubeRuntime};
use cubecl::prelude::*;

/// Rows the tiled kernels' stages are a divisor of (a product of `m` rows runs as one of
/// `m.next_multiple_of(ROW_ALIGN)`).
pub const ROW_ALIGN: usize = 128;

/// `out[b, r, c] = r < rows ? x[b, r, c] : 0` for `x` `[batch, rows, cols]` and `out` `[batch,
/// padded, cols]`, both contiguous.
#[cube(launch)]
fn pad_rows_kernel<F: Numeric>(
    x: &Array<F>,
    out: &mut Array<F>,
    rows: u32,
    padded: u32,
    cols: u32,
    #[define(F)] _dtype: StorageType,
) {
    let (rows, padded, cols) = (rows as usize, padded as usize, cols as usize);
    let idx = unit_index();
    if idx >= out.len() {
        terminate!();
    }
    let c = idx % cols;
    let r = (idx / cols) % padded;
    let b = idx / (cols * padded);
    let mut value = F::from_int(0);
    if r < rows {
        value = x[(b * rows + r) * cols + c];
    }
    out[idx] = value;
}

/// `x` (`[.., m, k]`) with its rows padded with zeros to `padded` (contiguous), or `x` itself
/// where `m == padded`.
pub(crate) fn pad_rows<R: CubeRuntime>(x: CubeTensor<R>, padded: usize) -> CubeTensor<R> {
    let shape = x.meta.shape().to_vec();
    let rank = shape.len();
    let (rows, cols) = (shape[rank - 2], shape[rank - 1]);
    if rows == padded {
        return x;
    }
    let x = into_contiguous(x);
    let mut out_shape = shape;
    out_shape[rank - 2] = padded;
    let out = empty(&x, out_shape, x.dtype);
    let elements = out.meta.shape().num_elements();
    if elements == 0 {
        return out;
    }
    let (count, cube_dim) = elementwise(elements, 256);
    launch!(pad_rows_kernel(
        &x.client,
        count,
        cube_dim,
        arg(&x),
        arg(&out),
        rows as u32,
        padded as u32,
        cols as u32,
        x.dtype.into(),
    ));
    out
}

/// The first `rows` rows of `out` (`[.., padded, n]`, contiguous): a view where the batch is
/// one, else a contiguous copy.
pub(crate) fn take_rows<R: CubeRuntime>(out: CubeTensor<R>, rows: usize) -> CubeTensor<R> {
    let shape = out.meta.shape().to_vec();
    let rank = shape.len();
    if shape[rank - 2] == rows {
        return out;
    }
    let ranges: Vec<std::ops::Range<usize>> =
        shape.iter().enumerate().map(|(d, &n)| if d == rank - 2 { 0..rows } else { 0..n }).collect();
    into_contiguous(slice(out, &ranges))
}

/// The rows a product of `m` rows runs with.
pub(crate) fn padded_rows(m: usize) -> usize {
    m.next_multiple_of(ROW_ALIGN)
}

#[cfg(test)]
mod gpu {
    use crate::cube::{float, tensor, Cb};
    use crate::gpu_test::{assert_close, seed};
    use burn::tensor::{DType, Distribution, Tensor};
    use burn_cubecl::{BoolElement, CubeRuntime, FloatElement, IntElement};

    /// Padding then taking the rows back, against the reference (`cat` with zeros, then a
    /// slice), odd sizes, batched and not.
    fn pad<R: CubeRuntime, F: FloatElement, I: IntElement, BT: BoolElement>(device: &R::Device, dtype: DType) {
        seed::<Cb<R, F, I, BT>>(device, "pad_rows");
        for (batch, rows, cols) in [(1, 513, 37), (3, 5, 64), (2, 128, 9), (1, 1, 1153)] {
            let x = Tensor::<Cb<R, F, I, BT>, 3>::random([batch, rows, cols], Distribution::Normal(0.0, 1.0), device)
                .cast(dtype);
            let padded = super::padded_rows(rows);
            let got = tensor::<R, F, I, BT, 3>(super::pad_rows(float(x.clone()), padded));
            let zeros = Tensor::<Cb<R, F, I, BT>, 3>::zeros([batch, padded - rows, cols], device).cast(dtype);
            let expected = Tensor::cat(vec![x.clone(), zeros], 1);
            let what = format!("pad_rows {batch}x{rows}x{cols} -> {padded}");
            // A copy: exact.
            assert_close(got.clone(), expected, 0.0, &what);
            let back = tensor::<R, F, I, BT, 3>(super::take_rows(float(got), rows));
            assert_close(back, x, 0.0, &format!("{what}, rows taken back"));
        }
    }

    #[cfg(feature = "wgpu")]
    #[test]
    fn pad_rows_matches_reference_wgpu_f32() {
        pad::<cubecl::wgpu::WgpuRuntime, f32, i32, u32>(&Default::default(), DType::F32);
    }

    #[cfg(feature = "cuda")]
    #[test]
    fn pad_rows_matches_reference_cuda() {
        for dtype in [DType::F32, DType::BF16] {
            pad::<cubecl::cuda::CudaRuntime, f32, i32, u8>(&Default::default(), dtype);
        }
    }
}
