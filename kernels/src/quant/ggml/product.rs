//! The CPU product of activations with a GGUF block matrix, built on candle's block dot products.
//!
//! candle's own quantized matmul walks the activation rows in the outer loop, so a prompt of
//! `m` rows reads the whole weight matrix `m` times from memory. Here the activations are
//! quantized once (to the block type the weight's dot product reads: Q8_0, Q8_1 or Q8_K), and
//! the output columns are split into groups of `COLUMNS` weight rows that the threads take in
//! turn: a group's rows (a few KiB) stay in cache while every activation row is multiplied with
//! them, so the weights are read from memory once per product whatever `m` is. Each dot product
//! is candle's (`GgmlType::vec_dot`: AVX2 or NEON where candle has it for the type), so the
//! result equals candle's matmul exactly (tested).
//!
//! Products of [`DENSE_ROWS`] activation rows or more (prompts) run as int8 tiles
//! ([`super::tiles`]) where the CPU has AVX-512 VNNI and the block type unpacks to them (all
//! but Q2_K and Q3_K), and otherwise in f32, over the weights dequantized chunk by chunk
//! into a buffer kept between products (`dense_product`), with the f32 GEMM candle uses (the
//! `gemm` crate, called directly: no copy of the activations or of each chunk's result).

use super::tiles::{self, Kernel, Layout, QuantizedRows};
use candle_core::quantized::{
    k_quants::{
        BlockQ2K, BlockQ3K, BlockQ4K, BlockQ4_0, BlockQ4_1, BlockQ5K, BlockQ5_0, BlockQ5_1, BlockQ6K, BlockQ8K,
        BlockQ8_0, BlockQ8_1, GgmlType,
    },
    GgmlDType, QTensor,
};
use rayon::prelude::*;
use std::borrow::Cow;

/// Weight rows per task: 16 rows of a 2,048-wide Q8_0 matrix are 34 KiB.
const COLUMNS: usize = 16;

/// How far ahead of the weight row being multiplied its cache lines are requested
/// ([`prefetch`]): one decode token streams every weight once, and the block dot products leave
/// the memory system idle between their loads. A Q8_0 row of 262,144 x 640 (the real 270M's LM
/// head) streamed by our AVX2 dot on this repository's 2-core Xeon: 5.6 GB/s per thread without,
/// 7.3 GB/s 2 KiB ahead and 7.5 GB/s 4 KiB ahead (medians of 9; a plain AVX2 sum of the same
/// bytes reads 9 GB/s).
const PREFETCH_AHEAD: usize = 4096;

/// From this many activation rows on, products run in f32 over the weights dequantized
/// (`dense_product`): a prompt's products are bound by arithmetic, where candle's f32 GEMM
/// (register-blocked, AVX-512 where the CPU has it) outruns one integer dot product per pair
/// of rows; decode's few rows are bound by the bytes read, where the blocks win.
pub const DENSE_ROWS: usize = 16;

/// Bytes of f32 weights [`dense_product`] dequantizes at a time (at least one row): 3,276 rows
/// of a 640-wide matrix, 97 of Gemma 3 27B's 21,504-wide `down`. The buffer is kept by each
/// calling thread between products ([`DENSE_SCRATCH`]), so this is also what it holds.
const DENSE_CHUNK_BYTES: usize = 8 << 20;

std::thread_local! {
    /// [`dense_product`]'s dequantized chunk, reused: a fresh buffer per chunk cost its page
    /// faults and zeroing (with the copies around candle's matmul, 14% of a 128-token prompt of
    /// the real 270M on two cores).
    static DENSE_SCRATCH: std::cell::Cell<Vec<f32>> = const { std::cell::Cell::new(Vec::new()) };
}

/// Why a product could not run.
#[derive(Debug, thiserror::Error)]
pub enum ProductError {
    #[error("{0:?} is not a block type this product handles")]
    Type(GgmlDType),
    #[error("the blocks are not in host memory")]
    NotHost,
    #[error("activations of {len} values are not rows of {cols}")]
    Shape { len: usize, cols: usize },
    #[error("candle: {0}")]
    Candle(String),
}

/// `x [m, cols] @ w^T -> [m, rows]` (row-major `f32`) for a `[rows, cols]` block matrix `w`.
pub fn product(x: &[f32], w: &QTensor) -> Result<Vec<f32>, ProductError> {
    let (rows, cols) = w.shape().dims2().map_err(|e| ProductError::Candle(e.to_string()))?;
    if cols == 0 || !x.len().is_multiple_of(cols) {
        return Err(ProductError::Shape { len: x.len(), cols });
    }
    let shape = Shape { m: x.len() / cols, k: cols, n: rows };
    with_blocks(w, Product { x, shape, chunk_bytes: DENSE_CHUNK_BYTES, prompt: PromptPath::best() })
}

/// Whether this CPU's prompt products ([`DENSE_ROWS`] rows and more) run as int8 tiles, rounding
/// their activations to 8 bits per 32 values as decode's block dot products do; else they run
/// in f32 over the dequantized weights (the reference product up to summation order).
pub fn prompts_round_activations() -> bool {
    matches!(PromptPath::best(), PromptPath::Tiles(_))
}

/// Every weight of a block matrix in f32, row-major: rows dequantized in parallel, each by the
/// block type's `to_float` (candle's, or this crate's where it has its own, as for the product).
pub fn dequantize(w: &QTensor) -> Result<Vec<f32>, ProductError> {
    let (rows, cols) = w.shape().dims2().map_err(|e| ProductError::Candle(e.to_string()))?;
    with_blocks(w, Dequantize { rows, cols })
}

/// Work over a block matrix, whatever block type it holds.
trait BlockWork {
    type Output;
    /// Runs over `w`, `[rows, cols]` blocks of `T`.
    fn run<T: GgmlType>(self, w: &[T], fns: BlockFns<T>) -> Result<Self::Output, ProductError>;
}

/// `work` over `w`'s blocks as the block type they are.
fn with_blocks<W: BlockWork>(w: &QTensor, work: W) -> Result<W::Output, ProductError> {
    let data = w.data().map_err(|e| ProductError::Candle(e.to_string()))?;
    let Cow::Borrowed(bytes) = data else { return Err(ProductError::NotHost) };
    match w.dtype() {
        GgmlDType::Q4_0 => typed::<BlockQ4_0, W>(bytes, work, BlockFns::candle()),
        GgmlDType::Q4_1 => typed::<BlockQ4_1, W>(bytes, work, BlockFns::candle()),
        // candle's Q5_0 dot product is scalar: ours runs AVX2 where the CPU has it.
        GgmlDType::Q5_0 => typed::<BlockQ5_0, W>(
            bytes,
            work,
            BlockFns { dot: super::q5_0::dot_fn(), to_float: super::q5_0::dequantize },
        ),
        GgmlDType::Q5_1 => typed::<BlockQ5_1, W>(bytes, work, BlockFns::candle()),
        // candle's Q8_0 dot converts its scales through run-time dispatched calls: ours by F16C.
        GgmlDType::Q8_0 => {
            typed::<BlockQ8_0, W>(bytes, work, BlockFns { dot: super::q8_0::dot_fn(), to_float: BlockQ8_0::to_float })
        }
        GgmlDType::Q8_1 => typed::<BlockQ8_1, W>(bytes, work, BlockFns::candle()),
        GgmlDType::Q2K => typed::<BlockQ2K, W>(bytes, work, BlockFns::candle()),
        GgmlDType::Q3K => typed::<BlockQ3K, W>(bytes, work, BlockFns::candle()),
        GgmlDType::Q4K => typed::<BlockQ4K, W>(bytes, work, BlockFns::candle()),
        GgmlDType::Q5K => typed::<BlockQ5K, W>(bytes, work, BlockFns::candle()),
        GgmlDType::Q6K => typed::<BlockQ6K, W>(bytes, work, BlockFns::candle()),
        GgmlDType::Q8K => typed::<BlockQ8K, W>(bytes, work, BlockFns::candle()),
        other @ (GgmlDType::F32 | GgmlDType::F16 | GgmlDType::BF16) => Err(ProductError::Type(other)),
    }
}

/// `bytes` (a candle `QTensor`'s host storage) as blocks of `T`, handed to `work`.
fn typed<T: GgmlType, W: BlockWork>(bytes: &[u8], work: W, fns: BlockFns<T>) -> Result<W::Output, ProductError> {
    let size = std::mem::size_of::<T>();
    if !bytes.len().is_multiple_of(size) {
        return Err(ProductError::Type(T::DTYPE));
    }
    if bytes.as_ptr().align_offset(std::mem::align_of::<T>()) != 0 {
        return Err(ProductError::NotHost);
    }
    // SAFETY: `bytes` is the storage of a candle `QTensor` of dtype `T::DTYPE` in host memory,
    // which candle keeps as a `Vec<T>` (`QuantizedType for Vec<T>`), viewed as bytes: its start is
    // aligned for `T` (checked above) and its length is a whole number of `T` (checked above).
    // Every block type is `#[repr(C)]` plain data (f16 and byte arrays), valid for any bits.
    let w: &[T] = unsafe { std::slice::from_raw_parts(bytes.as_ptr().cast::<T>(), bytes.len() / size) };
    work.run(w, fns)
}

/// [`dequantize`]'s work.
struct Dequantize {
    rows: usize,
    cols: usize,
}

impl BlockWork for Dequantize {
    type Output = Vec<f32>;

    fn run<T: GgmlType>(self, w: &[T], fns: BlockFns<T>) -> Result<Vec<f32>, ProductError> {
        let Self { rows, cols } = self;
        let per_row = cols / T::BLCK_SIZE;
        if !cols.is_multiple_of(T::BLCK_SIZE) || w.len() != rows * per_row {
            return Err(ProductError::Type(T::DTYPE));
        }
        to_f32(w, cols, fns.to_float)
    }
}

/// Whole `cols`-wide rows of blocks `w` in f32, rows in parallel, each by `to_float`.
fn to_f32<T: GgmlType>(w: &[T], cols: usize, to_float: fn(&[T], &mut [f32])) -> Result<Vec<f32>, ProductError> {
    let mut out = vec![0.0f32; w.len() * T::BLCK_SIZE];
    to_f32_into(w, cols, to_float, &mut out)?;
    Ok(out)
}

/// [`to_f32`] into `out` (`w.len() * T::BLCK_SIZE` values).
fn to_f32_into<T: GgmlType>(
    w: &[T],
    cols: usize,
    to_float: fn(&[T], &mut [f32]),
    out: &mut [f32],
) -> Result<(), ProductError> {
    // candle's Q8_1 `to_float` is `unimplemented!` (Q8_1 only ever pairs with other blocks in
    // dot products).
    if T::DTYPE == GgmlDType::Q8_1 {
        return Err(ProductError::Type(T::DTYPE));
    }
    let per_row = cols / T::BLCK_SIZE;
    if w.is_empty() {
        return Ok(());
    }
    if per_row == 0 || out.len() != w.len() * T::BLCK_SIZE {
        return Err(ProductError::Type(T::DTYPE));
    }
    // Whole rows per task (at least 64 KiB of output), so a thin matrix is not split finely.
    let rows_per_task = (16_384 / cols.max(1)).max(1);
    out.par_chunks_mut(rows_per_task * cols).zip(w.par_chunks(rows_per_task * per_row)).for_each(|(d, b)| {
        for (d, b) in d.chunks_exact_mut(cols).zip(b.chunks_exact(per_row)) {
            prefetch(b, PREFETCH_AHEAD);
            to_float(b, d);
        }
    });
    Ok(())
}

#[derive(Debug, Clone, Copy)]
struct Shape {
    m: usize,
    k: usize,
    n: usize,
}

/// A row of weight blocks times a row of activation blocks (`GgmlType::vec_dot`'s form).
type Dot<T> = fn(usize, &[T], &[<T as GgmlType>::VecDotType]) -> f32;

/// What a product does with blocks of `T`: their dot product with activation blocks (decode)
/// and their dequantization (prompts).
struct BlockFns<T: GgmlType> {
    dot: Dot<T>,
    to_float: fn(&[T], &mut [f32]),
}

impl<T: GgmlType> BlockFns<T> {
    /// candle's own.
    fn candle() -> Self {
        Self { dot: T::vec_dot, to_float: T::to_float }
    }
}

/// [`product`]'s work: activations `x` times the weight rows.
struct Product<'a> {
    x: &'a [f32],
    shape: Shape,
    /// [`DENSE_CHUNK_BYTES`] (tests: smaller, to cross chunks).
    chunk_bytes: usize,
    prompt: PromptPath,
}

/// How products of [`DENSE_ROWS`] rows or more (prompts) multiply.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum PromptPath {
    /// Integer tiles ([`tiles`]) for the block types they unpack, f32 for the others.
    Tiles(Kernel),
    /// f32 over the dequantized weights ([`dense_product`]).
    Dense,
}

impl PromptPath {
    /// Integer tiles where the CPU has AVX-512 VNNI (see [`tiles`] for what they gain);
    /// elsewhere f32, whose SIMD GEMM (the `gemm` crate: AVX2, AVX-512, NEON) outruns scalar
    /// integer code.
    fn best() -> Self {
        match Kernel::best() {
            Kernel::Avx512Vnni => Self::Tiles(Kernel::Avx512Vnni),
            Kernel::Scalar => Self::Dense,
        }
    }
}

impl BlockWork for Product<'_> {
    type Output = Vec<f32>;

    fn run<T: GgmlType>(self, w: &[T], fns: BlockFns<T>) -> Result<Vec<f32>, ProductError> {
        multiply(self.x, w, self.shape, fns, self.chunk_bytes, self.prompt)
    }
}

/// The product over the blocks `w` of `T`, each pair of rows multiplied by `fns.dot`.
fn multiply<T: GgmlType>(
    x: &[f32],
    w: &[T],
    Shape { m, k, n }: Shape,
    fns: BlockFns<T>,
    chunk_bytes: usize,
    prompt: PromptPath,
) -> Result<Vec<f32>, ProductError> {
    let per_row = k / T::BLCK_SIZE;
    if per_row == 0 || !k.is_multiple_of(T::BLCK_SIZE) || w.len() != n * per_row {
        return Err(ProductError::Type(T::DTYPE));
    }
    if m >= DENSE_ROWS {
        // Integer tiles where the CPU multiplies them faster than f32 (AVX-512 VNNI) and the
        // block type unpacks to them; f32 over the dequantized weights otherwise.
        if let (PromptPath::Tiles(kernel), Some(layout)) = (prompt, Layout::of(T::DTYPE)) {
            let quantized = QuantizedRows::new(x, k);
            return Ok(tiles::product(&quantized, super::q5_0::bytes(w), layout, n, kernel));
        }
        return dense_product(x, w, Shape { m, k, n }, fns.to_float, chunk_bytes);
    }
    let mut xq = vec![T::VecDotType::zeros(); m * per_row];
    for (src, dst) in x.chunks_exact(k).zip(xq.chunks_exact_mut(per_row)) {
        T::VecDotType::from_float(src, dst);
    }
    // Column-major output: column j's m values are one contiguous run, written by one task.
    let mut out = vec![0.0f32; n * m];
    out.par_chunks_mut(COLUMNS * m).zip(w.par_chunks(COLUMNS * per_row)).for_each(|(out, w)| {
        for (column, weights) in out.chunks_exact_mut(m).zip(w.chunks_exact(per_row)) {
            prefetch(weights, PREFETCH_AHEAD);
            for (value, activations) in column.iter_mut().zip(xq.chunks_exact(per_row)) {
                *value = (fns.dot)(k, weights, activations);
            }
        }
    });
    if m == 1 {
        return Ok(out);
    }
    let mut rows_major = vec![0.0f32; m * n];
    for (j, column) in out.chunks_exact(m).enumerate() {
        for (i, &v) in column.iter().enumerate() {
            rows_major[i * n + j] = v;
        }
    }
    Ok(rows_major)
}

/// Asks the CPU to bring the cache lines `ahead` bytes past each of `row`'s into cache: the
/// rows that follow it in the matrix, which the same task (or the next) multiplies next. A
/// prefetch never faults, so lines past the matrix's end are harmless; the addresses are formed
/// with `wrapping_add` and never read here.
#[inline]
fn prefetch<T>(row: &[T], ahead: usize) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
        let start = row.as_ptr().cast::<i8>();
        let bytes = std::mem::size_of_val(row);
        for offset in (0..bytes).step_by(64) {
            // SAFETY: `_mm_prefetch` is an SSE instruction (every x86-64 CPU has it), a hint that
            // reads nothing and does not fault whatever the address.
            unsafe { _mm_prefetch::<_MM_HINT_T0>(start.wrapping_add(ahead + offset)) };
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (row, ahead);
}

/// The product in f32: chunks of about `chunk_bytes` ([`DENSE_CHUNK_BYTES`]) of weight rows dequantized (rows
/// in parallel) into the calling thread's [`DENSE_SCRATCH`], each multiplied by the `gemm`
/// crate's f32 GEMM (candle's, with the strides candle's `x.matmul(&w.t())` hands it) straight
/// into its columns of the output; the activations are not quantized, so the result is the
/// reference product up to summation order.
fn dense_product<T: GgmlType>(
    x: &[f32],
    w: &[T],
    Shape { m, k, n }: Shape,
    to_float: fn(&[T], &mut [f32]),
    chunk_bytes: usize,
) -> Result<Vec<f32>, ProductError> {
    let per_row = k / T::BLCK_SIZE;
    let chunk_rows = (chunk_bytes / (4 * k.max(1))).max(1);
    let mut out = vec![0.0f32; m * n];
    let threads = rayon::current_num_threads();
    let parallelism = if threads > 1 { gemm::Parallelism::Rayon(threads) } else { gemm::Parallelism::None };
    // Taken for the product and put back after it (a product that fails drops it).
    let mut dense = DENSE_SCRATCH.take();
    for (c, blocks) in w.chunks(chunk_rows * per_row).enumerate() {
        let rows = blocks.len() / per_row;
        if dense.len() < rows * k {
            dense.resize(rows * k, 0.0);
        }
        let dense = &mut dense[..rows * k];
        to_f32_into(blocks, k, to_float, dense)?;
        let first = c * chunk_rows;
        // SAFETY: `out` is `m x n` row-major and columns `first..first + rows` lie within
        // its `n` (the chunks cover the weight rows in order); `x` is `m x k` row-major and
        // `dense` is `rows x k` row-major, read as its transpose (`k x rows`: row stride 1,
        // column stride `k`; `multiply` checked `w`, `product` derived `m` from `x`). All three
        // outlive the call, and `out` is not otherwise
        // borrowed during it. (The transposed product, `dense` as the left operand, measured
        // no faster: prompt pairs 0.90-1.05x.)
        unsafe {
            gemm::gemm(
                m,
                rows,
                k,
                out.as_mut_ptr().add(first),
                1,
                n as isize,
                false,
                x.as_ptr(),
                1,
                k as isize,
                dense.as_ptr(),
                k as isize,
                1,
                0.0f32,
                1.0f32,
                false,
                false,
                false,
                parallelism,
            );
        }
    }
    DENSE_SCRATCH.set(dense);
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::super::tests::{random_blocks, seed};
    use super::*;

    fn activations(m: usize, cols: usize, seed: u64) -> Vec<f32> {
        let mut s = seed ^ m as u64;
        (0..m * cols)
            .map(|_| {
                s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                ((s >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 4.0
            })
            .collect()
    }

    /// The parallel dequantization is candle's, bit for bit, for every block type a GGUF file
    /// holds (rows spread over several tasks, the last one partial).
    #[test]
    fn dequantize_matches_candle() {
        let seed = seed();
        let (rows, cols) = (67, 512);
        for dtype in [
            GgmlDType::Q4_0,
            GgmlDType::Q4_1,
            GgmlDType::Q5_0,
            GgmlDType::Q5_1,
            GgmlDType::Q8_0,
            GgmlDType::Q2K,
            GgmlDType::Q3K,
            GgmlDType::Q4K,
            GgmlDType::Q5K,
            GgmlDType::Q6K,
        ] {
            let q = random_blocks(dtype, rows, cols, seed).qtensor().expect("a candle tensor");
            let expected =
                q.dequantize(&candle_core::Device::Cpu).and_then(|t| t.flatten_all()).and_then(|t| t.to_vec1::<f32>());
            let expected = expected.expect("candle dequantizes");
            let ours = dequantize(&q).expect("dequantizes");
            assert_eq!(ours.len(), rows * cols, "{dtype:?}");
            assert!(ours.iter().all(|v| v.is_finite()), "{dtype:?}: a value is not finite");
            for (i, (a, b)) in ours.iter().zip(&expected).enumerate() {
                assert_eq!(a.to_bits(), b.to_bits(), "{dtype:?} value {i}: {a} against candle's {b} (seed {seed})");
            }
        }
    }

    /// How far two summation orders of a Q5_0 or Q8_0 x Q8_0 dot product of activations `x` and dequantized
    /// weights `w` may differ: 2 (blocks + 8) roundings of the sum of the terms' magnitudes,
    /// bounded by |w| (|x| + its block's largest |x| / 127).
    fn order_bound(x: &[f32], w: &[f32]) -> f64 {
        let magnitude: f64 = x
            .chunks_exact(32)
            .zip(w.chunks_exact(32))
            .map(|(xb, wb)| {
                let step = xb.iter().fold(0f32, |a, v| a.max(v.abs())) as f64 / 127.0;
                xb.iter().zip(wb).map(|(x, w)| (w.abs() as f64) * (x.abs() as f64 + step)).sum::<f64>()
            })
            .sum();
        2.0 * (x.len() / 32 + 8) as f64 * f32::EPSILON as f64 * magnitude
    }

    /// Decode-sized products (under [`DENSE_ROWS`] rows) are candle's matmul, bit for bit (Q5_0
    /// and Q8_0 through our AVX2 dot products: up to the rounding of their summation order;
    /// candle's Q8_0 dot sums as ours only where candle is compiled for AVX2, and a build for
    /// x86-64 without it runs candle's scalar one against our run-time-detected kernel).
    #[test]
    fn products_equal_candles_matmul() {
        let seed = seed();
        // Row counts that leave a partial task; even block counts per row (candle's debug
        // assertions ask for them in Q4_1 / Q5_0 / Q5_1).
        for (dtype, rows, cols) in [
            (GgmlDType::Q8_0, 37, 128),
            (GgmlDType::Q5_0, 19, 192),
            (GgmlDType::Q4_0, 33, 64),
            (GgmlDType::Q4_1, 7, 64),
            (GgmlDType::Q4K, 21, 512),
            (GgmlDType::Q6K, 13, 256),
        ] {
            let w = random_blocks(dtype, rows, cols, seed).qtensor().expect("candle tensor");
            for m in [1, 3, DENSE_ROWS - 1] {
                let x = activations(m, cols, seed);
                let got = product(&x, &w).expect("product");
                let expected = candle_core::Tensor::from_slice(&x, (m, cols), &candle_core::Device::Cpu)
                    .and_then(|x| x.apply_op1_no_bwd(&w))
                    .and_then(|y| y.flatten_all())
                    .and_then(|y| y.to_vec1::<f32>())
                    .expect("candle's matmul");
                assert!(got.iter().all(|v| v.is_finite()), "{dtype:?} m {m}");
                if matches!(dtype, GgmlDType::Q5_0 | GgmlDType::Q8_0) && super::super::q5_0::simd() {
                    // Our AVX2 dot products sum their blocks in eight lanes, candle's scalar
                    // ones in order: equal up to `order_bound`.
                    let dense = random_blocks(dtype, rows, cols, seed).dequantize().expect("dequantizes");
                    for i in 0..m {
                        for j in 0..rows {
                            let bound = order_bound(&x[i * cols..(i + 1) * cols], &dense[j * cols..(j + 1) * cols]);
                            let (g, e) = (got[i * rows + j] as f64, expected[i * rows + j] as f64);
                            assert!((g - e).abs() <= bound, "{dtype:?} m {m} ({i}, {j}): {g} vs candle's {e}");
                        }
                    }
                } else {
                    assert_eq!(got, expected, "{dtype:?} m {m}");
                }
            }
        }
    }

    /// Prompt-sized products are the f32 product with the dequantized weights.
    #[test]
    fn prompt_products_are_the_dequantized_f32_product() {
        let seed = seed();
        for (dtype, rows, cols) in [
            (GgmlDType::Q8_0, 37, 128),
            (GgmlDType::Q5_0, 19, 192),
            (GgmlDType::Q4K, 21, 512),
            (GgmlDType::Q6K, 13, 256),
        ] {
            let blocks = random_blocks(dtype, rows, cols, seed);
            let w = blocks.qtensor().expect("candle tensor");
            let dense = blocks.dequantize().expect("dequantizes");
            // One chunk, and chunks of 5 rows (the last partial), each into its output columns.
            for (m, chunk_bytes) in
                [(DENSE_ROWS, DENSE_CHUNK_BYTES), (41, DENSE_CHUNK_BYTES), (DENSE_ROWS, 5 * 4 * cols)]
            {
                let x = activations(m, cols, seed);
                let shape = Shape { m, k: cols, n: rows };
                let got =
                    with_blocks(&w, Product { x: &x, shape, chunk_bytes, prompt: PromptPath::Dense }).expect("product");
                for i in 0..m {
                    for j in 0..rows {
                        let expected: f64 =
                            (0..cols).map(|c| x[i * cols + c] as f64 * dense[j * cols + c] as f64).sum();
                        let scale: f64 = (0..cols).map(|c| (x[i * cols + c] * dense[j * cols + c]).abs() as f64).sum();
                        let v = got[i * rows + j];
                        assert!(v.is_finite(), "{dtype:?} m {m} ({i}, {j})");
                        assert!(
                            (v as f64 - expected).abs() <= 1e-5 * scale + 1e-7,
                            "{dtype:?} m {m} chunks of {chunk_bytes} bytes ({i}, {j}): {v} vs {expected}"
                        );
                    }
                }
            }
        }
    }

    /// Prompt-sized products of the block types the tiles unpack are the tiles' product of the
    /// quantized activations, bit for bit; the other types (Q3_K here) stay in f32.
    #[test]
    fn prompt_products_take_the_tiles_where_a_type_has_them() {
        let seed = seed();
        let (m, rows) = (DENSE_ROWS + 3, 11);
        for (dtype, cols) in
            [(GgmlDType::Q8_0, 96), (GgmlDType::Q5_0, 64), (GgmlDType::Q4K, 256), (GgmlDType::Q3K, 256)]
        {
            let blocks = random_blocks(dtype, rows, cols, seed);
            let w = blocks.qtensor().expect("candle tensor");
            let x = activations(m, cols, seed);
            let shape = Shape { m, k: cols, n: rows };
            let run = |prompt| with_blocks(&w, Product { x: &x, shape, chunk_bytes: DENSE_CHUNK_BYTES, prompt });
            let got = run(PromptPath::Tiles(Kernel::Scalar)).expect("product");
            let expected = match Layout::of(dtype) {
                Some(layout) => {
                    tiles::product(&QuantizedRows::new(&x, cols), blocks.bytes(), layout, rows, Kernel::Scalar)
                }
                None => run(PromptPath::Dense).expect("dense product"),
            };
            assert!(got.iter().all(|v| v.is_finite()), "{dtype:?}");
            assert_eq!(got, expected, "{dtype:?} (seed {seed})");
        }
    }

    #[test]
    fn mismatched_activations_are_refused() {
        let w = random_blocks(GgmlDType::Q8_0, 2, 64, 3).qtensor().expect("candle tensor");
        assert!(matches!(product(&[0.0; 65], &w), Err(ProductError::Shape { len: 65, cols: 64 })));
    }
}
