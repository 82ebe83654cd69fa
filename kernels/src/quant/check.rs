//! Tests shared by the CPU test of the reference and the GPU tests of the kernels: products and
//! gathers against f64 sums over the host-dequantized matrix.

use super::*;
use crate::{gpu_test::assert_close, Epilogue, GemmaBackend, HostMatrix, Matrix};
use burn::tensor::{backend::Backend, DType, Int, Tensor, TensorData};

/// Host random values with a few outliers per row, as real weights have.
pub fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed | 1;
    (0..n)
        .map(|i| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            let u = (s >> 11) as f32 / (1u64 << 53) as f32 - 0.5;
            if i % 97 == 0 {
                u * 0.8
            } else {
                u * 0.1
            }
        })
        .collect()
}

/// A tensor's values as f32 on the host.
pub fn host<B: Backend, const D: usize>(t: Tensor<B, D>) -> Vec<f32> {
    t.cast(DType::F32).into_data().to_vec::<f32>().expect("f32 data")
}

/// `x [n, in] @ w^T` through the backend against f64 sums over `ws` (`w` on the host,
/// `[out, in]` row-major), in `x`'s dtype.
pub(crate) fn check_product<B: GemmaBackend>(x: Tensor<B, 2>, w: &Matrix<B>, ws: &[f32], what: &str) {
    check_product_then(x, w, ws, Epilogue::Identity, what)
}

/// As [`check_product`], with `epilogue` applied to the f64 sums (rounded to f32) for the
/// reference.
pub(crate) fn check_product_then<B: GemmaBackend>(
    x: Tensor<B, 2>,
    w: &Matrix<B>,
    ws: &[f32],
    epilogue: Epilogue,
    what: &str,
) {
    let [n, inp] = x.dims();
    let out = ws.len() / inp;
    let (dtype, device) = (x.dtype(), x.device());
    let xs = host(x.clone());
    let expected: Vec<f32> = (0..n)
        .flat_map(|r| {
            let xs = &xs;
            (0..out).map(move |o| (0..inp).map(|c| xs[r * inp + c] as f64 * ws[o * inp + c] as f64).sum::<f64>() as f32)
        })
        .collect();
    let got = B::project(x, w, epilogue);
    assert_eq!(got.dtype(), dtype, "{what}");
    let expected = Tensor::<B, 2>::from_data(TensorData::new(expected, [n, out]), (&device, DType::F32));
    let expected = match epilogue {
        Epilogue::Identity => expected,
        Epilogue::GeluPairs => crate::gelu::pairs_reference(expected),
    };
    let tol = crate::gpu_test::tolerance(dtype)
        * if dtype == DType::F32 && n > crate::linear::GEMV_MAX_ROWS { 20.0 } else { 2.0 };
    assert_close(got, expected, tol, what);
}

/// Products of quantized matrices for 1 to 17 activation rows and the gather from a quantized
/// table, with the backend's upload choosing the layout (or `layout` = `(codes, scale dtype)`
/// when given).
pub fn quantized<B: GemmaBackend>(device: &B::Device, dtype: DType, seed: u64, layout: Option<(CodeLayout, DType)>) {
    let upload = |h: &HostQuantized| match layout {
        Some((codes, scales)) => Matrix::Quantized(QuantizedMatrix::<B>::upload(h, codes, scales, device)),
        None => B::upload_matrix(HostMatrix::Quantized(h.clone()), device).expect("quantized upload"),
    };
    for format in [QuantFormat::Q8, QuantFormat::Q4] {
        for (i, (n, inp, out)) in [
            (1, 640, 1024),
            (3, 2560, 37),
            (8, 96, 1001),
            (5, 32, 3),
            (2, 224, 13),
            (1, 1152, 6912),
            (1, 64, 9000),
            (3, 64, 4500),
            // Few features over long rows: row groups split over several planes (four
            // features per plane and four planes per group, then one or two features per plane).
            (1, 4096, 2100),
            (2, 3072, 300),
            // As many splits as a cube's size allows (eight would need 2,048 units).
            (1, 4096, 100),
            // Many features over short rows (four per plane, one plane per row group), and
            // fewer over longer rows.
            (1, 192, 17000),
            (1, 2048, 9000),
            (9, 160, 75),
            (17, 64, 33),
            (70, 352, 129),
            (300, 768, 1024),
        ]
        .into_iter()
        .enumerate()
        {
            let hq = HostQuantized::quantize(&values(out * inp, seed + i as u64), out, inp, format).expect("quantize");
            let w = upload(&hq);
            let xs = values(n * inp, seed ^ (0xABCD + i as u64));
            let x = Tensor::<B, 2>::from_data(TensorData::new(xs, [n, inp]), (device, DType::F32)).cast(dtype);
            check_product(x, &w, &hq.dequantize(), &format!("{format} project {n}x{inp} -> {out}"));
        }
        // The GELU of gate and up rows taken in the products' epilogue (the gate|up product
        // of a decode step), for one to three activation rows.
        for (n, inp, out) in [(1, 192, 17000), (1, 2048, 9000), (1, 256, 1000), (3, 96, 200)] {
            let hq = HostQuantized::quantize(&values(out * inp, seed + 55), out, inp, format).expect("quantize");
            let xs = values(n * inp, seed ^ 0x5EED);
            let x = Tensor::<B, 2>::from_data(TensorData::new(xs, [n, inp]), (device, DType::F32)).cast(dtype);
            let what = format!("{format} project + GELU pairs {n}x{inp} -> {out}");
            check_product_then(x, &upload(&hq), &hq.dequantize(), Epilogue::GeluPairs, &what);
        }
        // A stacked matrix (blocks stored differently: this format, the other one, dense), as a
        // GGUF's q | k | v can be: one product whose columns are the blocks' products.
        let other = if format == QuantFormat::Q8 { QuantFormat::Q4 } else { QuantFormat::Q8 };
        let inp = 96;
        let rows = [37, 20, 13];
        let a = HostQuantized::quantize(&values(rows[0] * inp, seed + 101), rows[0], inp, format).expect("quantize");
        let b = HostQuantized::quantize(&values(rows[1] * inp, seed + 102), rows[1], inp, other).expect("quantize");
        let dense = Tensor::<B, 2>::from_data(
            TensorData::new(values(rows[2] * inp, seed + 103), [rows[2], inp]),
            (device, DType::F32),
        )
        .cast(dtype);
        let mut ws = a.dequantize();
        ws.extend(b.dequantize());
        ws.extend(host(dense.clone()));
        let w = Matrix::stacked(vec![
            upload(&a),
            upload(&b),
            B::upload_matrix(HostMatrix::Dense(dense), device).expect("dense upload"),
        ]);
        let out: usize = rows.iter().sum();
        assert_eq!(w.dims(), [out, inp]);
        for n in [1, 3, crate::linear::GEMV_MAX_ROWS + 4] {
            let x = Tensor::<B, 2>::from_data(
                TensorData::new(values(n * inp, seed + 104 + n as u64), [n, inp]),
                (device, DType::F32),
            )
            .cast(dtype);
            check_product(x, &w, &ws, &format!("{format}|{other}|dense stacked project {n}x{inp} -> {out}"));
        }
        // A table of three row blocks (odd sizes), ids in every block plus out-of-range ones.
        let (vocab, hidden) = (203, 96);
        let hq = HostQuantized::quantize(&values(vocab * hidden, seed + 77), vocab, hidden, format).expect("quantize");
        let table: Vec<_> = [0..70, 70..141, 141..203].into_iter().map(|r| upload(&hq.rows_slice(r))).collect();
        let ids: Vec<i64> = vec![0, 69, 70, 140, 141, 202, 5, 150, 99, 1];
        let id_tensor = Tensor::<B, 2, Int>::from_data(TensorData::new(ids.clone(), [2, 5]), device);
        let scale = 25.3;
        let got = B::embed(&table, id_tensor, scale, dtype);
        assert_eq!(got.dtype(), dtype);
        let round = |v: f32| {
            Tensor::<B, 1>::from_data(TensorData::new(vec![v], [1]), (device, DType::F32))
                .cast(dtype)
                .cast(DType::F32)
                .into_data()
                .to_vec::<f32>()
                .expect("f32")[0] as f64
        };
        let s = round(scale as f32);
        let deq = hq.dequantize();
        let expected: Vec<f32> = ids
            .iter()
            .flat_map(|&id| (0..hidden).map(|c| (deq[id as usize * hidden + c] as f64 * s) as f32).collect::<Vec<_>>())
            .collect();
        let expected = Tensor::<B, 3>::from_data(TensorData::new(expected, [2, 5, hidden]), (device, DType::F32));
        assert_close(got, expected, crate::gpu_test::tolerance(dtype) * 2.0, &format!("{format} embed"));
    }
}

#[cfg(all(test, feature = "ndarray"))]
mod reference_tests {
    use crate::test_util::TestBackend;
    use burn::tensor::DType;

    #[test]
    fn reference_matches_host_dequantization() {
        let seed = crate::gpu_test::host_seed("reference_matches_host_dequantization");
        super::quantized::<TestBackend>(&Default::default(), DType::F32, seed, None);
    }
}

#[cfg(test)]
mod gpu {
    use crate::gpu_test::seed;
    use crate::GemmaBackend;
    use burn::tensor::DType;

    /// The backend's own layout, and packed codes with f32 scales (what devices without f16
    /// use) where the backend's layout uses f16.
    pub fn quantized<B: GemmaBackend>(device: &B::Device, dtype: DType) {
        let s = seed::<B>(device, "quantized");
        super::quantized::<B>(device, dtype, s, None);
        super::quantized::<B>(device, dtype, s ^ 1, Some((crate::quant::CodeLayout::Words, DType::F32)));
    }

    gpu_tests!(quantized_matches_host => quantized);
}
