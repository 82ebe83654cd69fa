//! The k-quant kernels against f64 sums over the weights as candle dequantizes the file's
//! blocks: products of 1 to 70 activation rows (the matrix-vector kernel, then the dequantized
//! prefill GEMM), the GELU-pairs epilogue, a stacked q | k | v of two formats, and the gather.

use crate::gpu_test::{assert_close, seed, tolerance};
use crate::quant::check::{check_product, host, values};
use crate::quant::ggml::tests::random_blocks;
use crate::quant::GgmlBlocks;
use crate::{gelu, matrix, Epilogue, GemmaBackend, HostMatrix, Matrix};
use burn::tensor::{DType, Int, Tensor, TensorData};
use candle_core::quantized::GgmlDType;

const TYPES: [GgmlDType; 3] = [GgmlDType::Q4K, GgmlDType::Q5K, GgmlDType::Q6K];

fn activations<B: GemmaBackend>(n: usize, cols: usize, seed: u64, dtype: DType, device: &B::Device) -> Tensor<B, 2> {
    Tensor::<B, 2>::from_data(TensorData::new(values(n * cols, seed), [n, cols]), (device, DType::F32)).cast(dtype)
}

fn upload<B: GemmaBackend>(blocks: &GgmlBlocks, device: &B::Device) -> Matrix<B> {
    let w = B::upload_matrix(HostMatrix::Ggml(blocks.clone()), device).expect("k-quant upload");
    assert!(matches!(w, Matrix::KQuant(_)), "{:?} kept as it is", blocks.dtype());
    w
}

fn kquant<B: GemmaBackend>(device: &B::Device, dtype: DType) {
    let s = seed::<B>(device, "kquant");
    for (t, ty) in TYPES.into_iter().enumerate() {
        let s = s.wrapping_add(1000 * t as u64);
        for (i, (n, inp, out)) in [
            (1, 256, 37),
            (2, 512, 1001),
            (3, 1536, 75),
            (8, 256, 33),
            // Few features over long rows: row groups split over several planes.
            (1, 2560, 2100),
            (1, 4096, 100),
            (2, 3072, 300),
            // Past the matrix-vector kernel: the dequantized matrix and the prefill GEMM.
            (9, 512, 129),
            (70, 768, 64),
        ]
        .into_iter()
        .enumerate()
        {
            let blocks = random_blocks(ty, out, inp, s + i as u64);
            let w = upload::<B>(&blocks, device);
            let x = activations::<B>(n, inp, s ^ (0xABCD + i as u64), dtype, device);
            let ws = blocks.dequantize().expect("candle dequantizes");
            check_product(x, &w, &ws, &format!("{ty:?} project {n}x{inp} -> {out}"));
        }
        // Gate and up rows interleaved in blocks of four, the GELU in the kernel's epilogue,
        // against f64 host products of the separate matrices.
        let (features, inp) = (48, 512);
        let gate = random_blocks(ty, features, inp, s + 50);
        let up = random_blocks(ty, features, inp, s + 51);
        let (gw, uw) = (gate.dequantize().expect("dequantizes"), up.dequantize().expect("dequantizes"));
        let joined = GgmlBlocks::interleave_pairs(gate, up, gelu::PAIR_BLOCK).expect("pairs");
        let w = upload::<B>(&joined, device);
        for n in [1, 2, 5] {
            let x = activations::<B>(n, inp, s + 60 + n as u64, dtype, device);
            let xs = host(x.clone());
            let dot = |r: usize, w: &[f32], o: usize| {
                (0..inp).map(|c| xs[r * inp + c] as f64 * w[o * inp + c] as f64).sum::<f64>()
            };
            let expected: Vec<f32> = (0..n)
                .flat_map(|r| (0..features).map(move |o| (r, o)))
                .map(|(r, o)| {
                    let (g, u) = (dot(r, &gw, o), dot(r, &uw, o));
                    (0.5 * g * (1.0 + (0.797_884_560_8 * (g + 0.044715 * g * g * g)).tanh()) * u) as f32
                })
                .collect();
            let expected = Tensor::<B, 2>::from_data(TensorData::new(expected, [n, features]), (device, DType::F32));
            let got = B::project(x, &w, Epilogue::GeluPairs);
            assert_eq!(got.dtype(), dtype);
            assert_close(got, expected, tolerance(dtype) * 2.0, &format!("{ty:?} GELU pairs {n} rows"));
        }
    }
    // q | k in Q4_K and v in Q6_K, as Q4_K_M files store them: one product.
    let inp = 512;
    let parts = [(GgmlDType::Q4K, 64), (GgmlDType::Q4K, 32), (GgmlDType::Q6K, 32)];
    let blocks: Vec<GgmlBlocks> =
        parts.iter().enumerate().map(|(i, &(ty, rows))| random_blocks(ty, rows, inp, s + 200 + i as u64)).collect();
    let w = Matrix::stacked(blocks.iter().map(|b| upload::<B>(b, device)).collect());
    let ws: Vec<f32> = blocks.iter().flat_map(|b| b.dequantize().expect("dequantizes")).collect();
    for n in [1, 3] {
        let x = activations::<B>(n, inp, s + 210 + n as u64, dtype, device);
        check_product(x, &w, &ws, &format!("q4_k|q4_k|q6_k stacked {n}x{inp}"));
    }
    // A Q6_K table of three row blocks (odd sizes), ids in every block.
    let (vocab, hidden) = (203, 512);
    let table_blocks = random_blocks(GgmlDType::Q6K, vocab, hidden, s + 300);
    let table: Vec<Matrix<B>> =
        [0..70, 70..141, 141..203].into_iter().map(|r| upload::<B>(&table_blocks.rows_slice(r), device)).collect();
    let ids: Vec<i64> = vec![0, 69, 70, 140, 141, 202, 5, 150, 99, 1];
    let got =
        B::embed(&table, Tensor::<B, 2, Int>::from_data(TensorData::new(ids.clone(), [2, 5]), device), 25.3, dtype);
    assert_eq!(got.dtype(), dtype);
    let s_rounded =
        host(Tensor::<B, 1>::from_data(TensorData::new(vec![25.3f32], [1]), (device, DType::F32)).cast(dtype))[0]
            as f64;
    let deq = table_blocks.dequantize().expect("dequantizes");
    let expected: Vec<f32> = ids
        .iter()
        .flat_map(|&id| {
            (0..hidden).map(|c| (deq[id as usize * hidden + c] as f64 * s_rounded) as f32).collect::<Vec<_>>()
        })
        .collect();
    let expected = Tensor::<B, 3>::from_data(TensorData::new(expected, [2, 5, hidden]), (device, DType::F32));
    assert_close(got, expected, tolerance(dtype) * 2.0, "q6_k embed");
    // The reference product (the matrix read back and dequantized on the host) agrees too.
    let blocks = random_blocks(GgmlDType::Q5K, 19, 256, s + 400);
    let w = upload::<B>(&blocks, device);
    let x = activations::<B>(2, 256, s + 401, DType::F32, device);
    let dense = Tensor::<B, 2>::from_data(
        TensorData::new(blocks.dequantize().expect("dequantizes"), [19, 256]),
        (device, DType::F32),
    );
    assert_close(
        matrix::reference(x.clone(), &w, Epilogue::Identity),
        crate::linear::reference(x, dense),
        tolerance(DType::F32),
        "q5_k reference",
    );
}

gpu_tests!(kquant_matches_candle => kquant);
