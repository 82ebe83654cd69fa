//! Times every `GemmaBackend` kernel against its plain-Burn reference and reports effective
//! bandwidth next to the device's measured copy bandwidth.
//!
//! `cargo run --release --features cuda,tools --example kernel_bench -- --backend cuda --dtype bf16`
//!
//! Sections (`--section`): `kernels` (each kernel on prefill-sized inputs against its
//! reference), `decode` (every decode kernel on the shapes of the Gemma 3 models, 1 and 8
//! activation rows, dense / Q8 / Q4 weights, bf16 and int8 KV at depth), `launch` (host cost of
//! small launches), or `all`; apart from `all`, `gemm` (CubeCL's matmul kernels on the prefill
//! products) and `experts` (a 26B-A4B experts layer by each `ExpertPath` at the `--rows` token
//! counts), `attention` (prompt attention by each kernel at the `--tokens` lengths). On CUDA,
//! decode kernels are timed on the GPU itself: calls
//! recorded into one CUDA graph, replayed, CUDA events around each replay (no host launch cost
//! in the figure, as in a replayed decode step); elsewhere by the host around synchronized
//! batches.

use burn::tensor::{DType, Distribution, Int, Tensor, TensorData};
use burn_gemma::{
    backends::{dispatch, parse_dtype, BackendKind, BackendTask},
    GemmaBackend,
};
use burn_gemma_kernels::attention::PrefillAttention;
use burn_gemma_kernels::{
    attention, embedding, gelu, linear, rms_norm, rope, softcap, AddNorm, AttentionMask, AttentionOptions, Epilogue,
    GateUpLayout, HostMatrix, HostQuantized, KvFormat, KvView, Matrix, QuantFormat, RopeTables, SamplingParams,
};
use clap::Parser;
use std::time::Instant;

/// The program's errors: the library's, or a message about its command line.
type CliError = Box<dyn std::error::Error>;

#[cfg(feature = "cuda")]
#[path = "kernel_bench/batched.rs"]
mod batched;
#[path = "kernel_bench/decode.rs"]
mod decode;
#[path = "kernel_bench/experts.rs"]
mod experts;
#[path = "kernel_bench/gemm.rs"]
mod gemm;
#[path = "kernel_bench/prompt_attention.rs"]
mod prompt_attention;

#[derive(Parser)]
struct Args {
    /// auto, cuda, rocm, vulkan, wgpu, metal, candle, ndarray.
    #[arg(long, default_value = "auto")]
    backend: String,
    /// Activation/weight dtype: f32, f16 or bf16.
    #[arg(long, default_value = "bf16")]
    dtype: String,
    /// Timed repetitions per kernel (after 3 warm-up runs); the median is reported.
    #[arg(long, default_value_t = 30)]
    reps: usize,
    /// Which tables: kernels, decode, launch or all.
    #[arg(long, default_value = "all")]
    section: Section,
    /// Gemm and experts sections: activation rows (tokens) of each product (comma-separated).
    #[arg(long, default_value = "512,4096")]
    rows: String,
    /// Gemm section: `all` also times every CubeCL kernel candidate, `tuned` only `project`.
    #[arg(long, value_enum, default_value_t = GemmKernels::Tuned)]
    gemm_kernels: GemmKernels,
    /// Attention section: prompt lengths (comma-separated).
    #[arg(long, default_value = "2048,4096,8192,16384")]
    tokens: String,
    /// Attention section: kernels to time (comma-separated: auto, flash, blocked, tiled).
    #[arg(long, default_value = "flash,blocked")]
    attention_kernels: String,
    /// Attention section: layouts the flash kernel is timed with (comma-separated
    /// `<planes>x<keys per tile>`, `p` appended for prefetching the next tile; `default`).
    #[arg(long, default_value = "default")]
    flash_layouts: String,
    /// Attention section: key and value formats (comma-separated: dense, int8).
    #[arg(long, default_value = "dense,int8")]
    kv: String,
    /// Decode section: only these models (comma-separated: 270m,1b,4b,12b,27b).
    #[arg(long, default_value = "270m,1b,4b,12b,27b")]
    models: String,
}

/// Which kernels the gemm section times.
#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum GemmKernels {
    /// `project` only: the tuned kernel, dense and quantized weights.
    Tuned,
    /// Also every CubeCL kernel candidate on its own.
    All,
}

/// The tables to print.
#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum Section {
    All,
    Kernels,
    Decode,
    Launch,
    /// Prefill products (CubeCL's matmul kernels) and prefill attention (CUDA and wgpu only;
    /// not part of `all`).
    Gemm,
    /// A 26B-A4B experts layer by each path, at the token counts of `--rows` (CUDA and wgpu
    /// only; not part of `all`).
    Experts,
    /// The products of a batched decode step at the row counts of `--rows`, and with
    /// `--gemm-kernels all` every tiling of the quantized mma kernel (CUDA only; not part of
    /// `all`).
    Batched,
    /// Prompt attention by each kernel of `--attention-kernels` at the `--tokens` lengths,
    /// dense and int8 keys and values (CUDA and wgpu only; not part of `all`).
    Attention,
}

struct Bench {
    dtype: DType,
    reps: usize,
    section: Section,
    models: Vec<String>,
}

/// Calls issued back to back per timed sample: one synchronization (a round trip through the
/// runtime's queue, tens of microseconds on CUDA) per call would hide kernels of that size.
const BATCH: usize = 10;

/// Median seconds per call of `f` over `reps` samples of [`BATCH`] calls issued back to back
/// and then synchronized, after warm-up.
/// Uploads a matrix this tool generated (dense or quantized with this crate's formats, which
/// every backend uploads).
fn upload<B: GemmaBackend>(matrix: HostMatrix<B>, d: &B::Device) -> Matrix<B> {
    B::upload_matrix(matrix, d).expect("generated dense and Q8/Q4 matrices upload on every backend")
}

fn time<B: GemmaBackend, T>(device: &B::Device, reps: usize, mut f: impl FnMut() -> T) -> f64 {
    for _ in 0..3 {
        let _ = f();
    }
    let _ = B::sync(device);
    let mut times: Vec<f64> = (0..reps)
        .map(|_| {
            let start = Instant::now();
            let outs: Vec<T> = (0..BATCH).map(|_| f()).collect();
            let _ = B::sync(device);
            drop(outs);
            start.elapsed().as_secs_f64() / BATCH as f64
        })
        .collect();
    times.sort_by(f64::total_cmp);
    times[times.len() / 2]
}

/// The per-kernel table: each kernel against its plain-Burn reference, bandwidth vs copy.
fn kernels<B: GemmaBackend>(d: &B::Device, dt: DType, reps: usize) {
    let e = dt.size() as f64;
    let rand = |shape: Vec<usize>, dtype: DType| random::<B>(shape, dtype, d);

    let copy = rand(vec![64 << 20], DType::F32);
    let copy_s = time::<B, _>(d, reps, || copy.clone().mul_scalar(1.0));
    let copy_bw = 2.0 * (64 << 20) as f64 * 4.0 / copy_s / 1e9;
    println!("copy (read + write 256 MiB f32): {:.3} ms, {copy_bw:.0} GB/s\n", copy_s * 1e3);
    println!("| kernel | shape | kernel ms | reference ms | bytes moved | kernel GB/s | % of copy |");
    println!("|---|---|---:|---:|---:|---:|---:|");
    let row = |what: &str, shape: &str, kernel: f64, reference: f64, bytes: f64| {
        let bw = bytes / kernel / 1e9;
        println!(
            "| {what} | {shape} | {:.4} | {:.4} | {:.1} MB | {bw:.0} | {:.0}% |",
            kernel * 1e3,
            reference * 1e3,
            bytes / 1e6,
            100.0 * bw / copy_bw
        );
    };

    // Residual add + RMSNorm and RMSNorm: 4096 rows of Gemma 3 4B's hidden size.
    let (rows, hidden) = (4096, 2560);
    let residual = rand(vec![rows * hidden], DType::F32).reshape([1, rows, hidden]);
    let x = rand(vec![rows * hidden], dt).reshape([1, rows, hidden]);
    let w = rand(vec![hidden], DType::F32);
    let plain = AddNorm { post: None, weight: w.clone(), eps: 1e-6, scale: 1.0, out_dtype: dt };
    let k = time::<B, _>(d, reps, || B::add_rms_norm(residual.clone(), x.clone(), &plain));
    let r = time::<B, _>(d, reps, || rms_norm::add_reference(residual.clone(), x.clone(), &plain));
    row("add_rms_norm", "4096 x 2560", k, r, (rows * hidden) as f64 * (4.0 + e + 4.0 + e));
    // With the post-norm of `x` first (Gemma 2/3's sandwich norms): `x` is read twice.
    let sandwich = AddNorm { post: Some(rand(vec![hidden], DType::F32)), ..plain.clone() };
    let k = time::<B, _>(d, reps, || B::add_rms_norm(residual.clone(), x.clone(), &sandwich));
    let r = time::<B, _>(d, reps, || rms_norm::add_reference(residual.clone(), x.clone(), &sandwich));
    row("rms_norm + add_rms_norm", "4096 x 2560", k, r, (rows * hidden) as f64 * (4.0 + 2.0 * e + 4.0 + e));
    let k = time::<B, _>(d, reps, || B::rms_norm(x.clone(), w.clone(), 1e-6));
    let r = time::<B, _>(d, reps, || rms_norm::reference(x.clone(), w.clone(), 1e-6));
    row("rms_norm", "4096 x 2560", k, r, (rows * hidden) as f64 * 2.0 * e);

    // Decode projections (matrix-vector kernel): 4B's MLP up projection and an lm_head block.
    for (n, inp, out) in [(1usize, 2560usize, 10240usize), (1, 640, 52_428), (4, 2560, 10240)] {
        let x = rand(vec![n * inp], dt).reshape([n, inp]);
        // Packed as the model loads it (a pitched 640-wide weight would be copied per call).
        let dense = rand(vec![out * inp], dt).reshape([out, inp]);
        let w = upload(HostMatrix::Dense(dense.clone()), d);
        let k = time::<B, _>(d, reps, || B::project(x.clone(), &w, Epilogue::Identity));
        let r = time::<B, _>(d, reps, || linear::reference(x.clone(), dense.clone()));
        row("project (GEMV)", &format!("{n} x {inp} -> {out}"), k, r, (out * inp + n * inp + n * out) as f64 * e);
    }

    // GELU(gate) * up: 512 tokens of 4B's intermediate size.
    let inter = 10240;
    let joined = rand(vec![512 * 2 * inter], dt).reshape([1, 512, 2 * inter]);
    let k = time::<B, _>(d, reps, || B::gelu_mul(joined.clone(), GateUpLayout::Halves));
    let r = time::<B, _>(d, reps, || gelu::joined_reference(joined.clone(), GateUpLayout::Halves));
    row("gelu_mul", "512 x 10240", k, r, (512 * inter) as f64 * 3.0 * e);

    // RoPE + QK-norm on 512 positions of 8 heads x 256, read through the projection's swap.
    let (cos, sin) = rope::tables(4096, &rope::Frequencies::plain(256, 10_000.0));
    let cos = Tensor::<B, 2>::from_data(TensorData::new(cos, [4096, 128]), d);
    let sin = Tensor::<B, 2>::from_data(TensorData::new(sin, [4096, 128]), d);
    let q = rand(vec![512 * 8 * 256], dt).reshape([1, 512, 8, 256]).swap_dims(1, 2);
    let qn = rand(vec![256], DType::F32);
    let norm = Some((qn.clone(), 1e-6));
    let tables = RopeTables { cos: cos.clone(), sin: sin.clone() };
    let k = time::<B, _>(d, reps, || B::qk_norm_rope(q.clone(), &tables, 100, norm.clone()));
    let r = time::<B, _>(d, reps, || rope::reference(q.clone(), cos.clone(), sin.clone(), 100, norm.clone()));
    row("rope + qk_norm", "8 x 512 x 256", k, r, (512 * 8 * 256) as f64 * 2.0 * e + 512.0 * 256.0 * 4.0);

    // Softcap on a batch of 4 logit rows.
    let logits = rand(vec![4 * 262_144], DType::F32).reshape([4, 262_144]).mul_scalar(10.0);
    let k = time::<B, _>(d, reps, || B::softcap(logits.clone(), 30.0));
    let r = time::<B, _>(d, reps, || softcap::reference(logits.clone(), 30.0));
    row("softcap", "4 x 262144 f32", k, r, 4.0 * 262_144.0 * 8.0);

    // Embedding gather: 4096 tokens from a 262144 x 2560 table in 128 MiB blocks.
    let block_rows = (128usize << 20) / (hidden * dt.size());
    let dense_blocks: Vec<Tensor<B, 2>> = (0..262_144usize.div_ceil(block_rows))
        .map(|i| {
            let n = block_rows.min(262_144 - i * block_rows);
            rand(vec![n * hidden], dt).reshape([n, hidden])
        })
        .collect();
    let ids: Vec<i64> = (0..4096i64).map(|i| (i * 104_729) % 262_144).collect();
    let ids = Tensor::<B, 2, Int>::from_data(TensorData::new(ids, [1, 4096]), d);
    let blocks: Vec<Matrix<B>> = dense_blocks.iter().map(|b| upload(HostMatrix::Dense(b.clone()), d)).collect();
    let k = time::<B, _>(d, reps, || B::embed(&blocks, ids.clone(), 50.6, dt));
    let r = time::<B, _>(d, reps, || embedding::reference(&dense_blocks, ids.clone(), 50.6));
    row("embed", "4096 ids x 2560", k, r, 4096.0 * hidden as f64 * 2.0 * e);

    // Decode attention over a long cache (4B heads: 8 query, 4 KV, head_dim 256).
    for depth in [1024usize, 8192] {
        let q = rand(vec![8 * 256], dt).reshape([1, 8, 1, 256]);
        let kc = rand(vec![4 * depth * 256], dt).reshape([1, 4, depth, 256]);
        let vc = rand(vec![4 * depth * 256], dt).reshape([1, 4, depth, 256]);
        let mask = AttentionMask { q_offset: depth - 1, k_offset: 0, window: None };
        let options = AttentionOptions { mask, scale: 0.0625, softcap: None };
        let dense = || KvView::Dense { keys: kc.clone(), values: vc.clone() };
        let k = time::<B, _>(d, reps, || {
            B::grouped_attention(q.clone(), dense(), &options).expect("a host position reads nothing back")
        });
        let r = time::<B, _>(d, reps, || attention::reference(q.clone(), kc.clone(), vc.clone(), &options));
        row("decode attention", &format!("8q/4kv x {depth}"), k, r, (2 * 4 * depth * 256) as f64 * e);
        // The same over an int8 cache (codes + one f32 scale per position and head); the
        // reference column is the dense kernel above.
        let int8 = B::kv_write(B::kv_zeros([1, 4, depth, 256], KvFormat::Int8, d), kc.clone(), vc.clone(), 0);
        let k8 = time::<B, _>(d, reps, || {
            B::grouped_attention(q.clone(), int8.view(depth), &options).expect("a host position reads nothing back")
        });
        row("decode attention, int8 KV", &format!("8q/4kv x {depth}"), k8, k, (2 * 4 * depth * (256 + 4)) as f64);
    }

    // Quantized decode projections (the reference column is the dense GEMV of the same shape).
    for format in [QuantFormat::Q8, QuantFormat::Q4] {
        for (n, inp, out) in [(1usize, 2560usize, 10240usize), (1, 10240, 2560), (1, 640, 52_428), (4, 2560, 10240)] {
            let x = rand(vec![n * inp], dt).reshape([n, inp]);
            let values: Vec<f32> =
                rand(vec![out * inp], DType::F32).mul_scalar(0.02).into_data().to_vec::<f32>().unwrap_or_default();
            let Ok(host) = HostQuantized::quantize(&values, out, inp, format) else { continue };
            let wq = upload(HostMatrix::Quantized(host), d);
            let dense = Tensor::<B, 2>::from_data(TensorData::new(values, [out, inp]), d).cast(dt);
            let dense = upload(HostMatrix::Dense(dense), d);
            let k = time::<B, _>(d, reps, || B::project(x.clone(), &wq, Epilogue::Identity));
            let r = time::<B, _>(d, reps, || B::project(x.clone(), &dense, Epilogue::Identity));
            let bytes = wq.device_bytes() + (n * inp + n * out) * dt.size();
            row(&format!("project {format} (GEMV)"), &format!("{n} x {inp} -> {out}"), k, r, bytes as f64);
        }
    }

    // Prefill attention (compute-bound: also reported as TFLOP/s).
    let t = 2048;
    let q = rand(vec![8 * t * 256], dt).reshape([1, 8, t, 256]);
    let kc = rand(vec![4 * t * 256], dt).reshape([1, 4, t, 256]);
    let vc = rand(vec![4 * t * 256], dt).reshape([1, 4, t, 256]);
    for window in [None, Some(1024)] {
        let options =
            AttentionOptions { mask: AttentionMask { q_offset: 0, k_offset: 0, window }, scale: 0.0625, softcap: None };
        let k = time::<B, _>(d, reps.min(10), || {
            B::grouped_attention(q.clone(), KvView::Dense { keys: kc.clone(), values: vc.clone() }, &options)
                .expect("a host position reads nothing back")
        });
        let r = time::<B, _>(d, reps.min(10), || attention::reference(q.clone(), kc.clone(), vc.clone(), &options));
        let visible = (0..t).map(|i| window.map_or(i + 1, |w| (i + 1).min(w))).sum::<usize>() as f64;
        let flops = 8.0 * visible * 256.0 * 4.0;
        row(
            &format!("prefill attention ({:.1} TFLOP/s)", flops / k / 1e12),
            &format!("8q/4kv x {t}, window {window:?}"),
            k,
            r,
            (3 * 4 * t * 256 + 8 * t * 256) as f64 * e,
        );
    }

    // Sampling over the full vocabulary (only the id comes back).
    let row_logits = rand(vec![262_144], DType::F32).reshape([1, 262_144]).mul_scalar(3.0);
    for (what, params) in [
        ("sample greedy", SamplingParams::GREEDY),
        (
            "sample T=1 top-k 64 top-p 0.95",
            SamplingParams { temperature: 1.0, top_k: Some(64), top_p: Some(0.95), min_p: None },
        ),
    ] {
        let k = time::<B, _>(d, reps, || {
            B::sample(row_logits.clone(), &params, burn_gemma_kernels::Draws::Host(&[0.5]))
                .expect("sampled")
                .into_data()
        });
        let host = time::<B, _>(d, reps, || {
            let v = row_logits.clone().into_data().to_vec::<f32>().unwrap_or_default();
            burn_gemma_kernels::sampling::reference(&v, &params, 0.5)
        });
        row(what, "1 x 262144 f32 (incl. id readback)", k, host, 262_144.0 * 4.0);
    }
    println!("\nreference ms for sampling = copy the logits to the host and sample there");
}

/// Measured copy bandwidth (GB/s): read and write 256 MiB of f32.
fn copy_bandwidth<B: GemmaBackend>(d: &B::Device, reps: usize) -> f64 {
    let copy = random::<B>(vec![64 << 20], DType::F32, d);
    let copy_s = time::<B, _>(d, reps, || copy.clone().mul_scalar(1.0));
    2.0 * (64 << 20) as f64 * 4.0 / copy_s / 1e9
}

fn random<B: GemmaBackend>(shape: Vec<usize>, dtype: DType, d: &B::Device) -> Tensor<B, 1> {
    Tensor::<B, 1>::random([shape.iter().product::<usize>()], Distribution::Normal(0.0, 1.0), d).cast(dtype)
}

const LAUNCHES: usize = 2000;

/// Host microseconds per call of `f` issued `LAUNCHES` times without waiting, and wall
/// microseconds per call until the device has finished them all.
fn launch_cost<B: GemmaBackend, T>(device: &B::Device, what: &str, mut f: impl FnMut() -> T) {
    for _ in 0..50 {
        drop(f());
    }
    let _ = B::sync(device);
    let start = Instant::now();
    for _ in 0..LAUNCHES {
        drop(f());
    }
    let host = start.elapsed().as_secs_f64();
    let _ = B::sync(device);
    let wall = start.elapsed().as_secs_f64();
    let per = |s: f64| s * 1e6 / LAUNCHES as f64;
    println!("| {what} | {:.1} | {:.1} |", per(host), per(wall));
}

impl BackendTask for Bench {
    type Output = Result<(), CliError>;

    fn run<B: GemmaBackend>(self, device: B::Device, name: &str) -> Result<(), CliError> {
        let (dt, reps, d) = (self.dtype, self.reps, &device);
        let rand = |shape: Vec<usize>, dtype: DType| random::<B>(shape, dtype, d);
        println!("backend {name}, dtype {dt:?}, per call: medians of {reps} samples of {BATCH} calls issued back to back, then synchronized, after warm-up\n");

        if matches!(self.section, Section::All | Section::Kernels) {
            kernels::<B>(d, dt, reps);
        }
        if matches!(self.section, Section::All | Section::Decode) {
            decode::run::<B>(d, dt, reps, &self.models)?;
        }
        if !matches!(self.section, Section::All | Section::Launch) {
            return Ok(());
        }

        // Launch cost: decode issues hundreds of small launches per token, so the host time per
        // launch bounds decode speed when each kernel is short.
        println!("\n| small operation ({LAUNCHES} issued back to back) | host us per call | wall us per call (until synchronized) |");
        println!("|---|---:|---:|");
        let tiny = rand(vec![640], dt).reshape([1, 640]);
        let weight = upload(HostMatrix::Dense(rand(vec![64 * 640], dt).reshape([64, 640])), d);
        let norm_w = rand(vec![640], DType::F32);
        let cache = rand(vec![256 * 256], dt).reshape([1, 1, 256, 256]);
        let new_k = rand(vec![256], dt).reshape([1, 1, 1, 256]);
        let heads = rand(vec![4 * 256], dt).reshape([1, 1, 4, 256]).swap_dims(1, 2);
        launch_cost::<B, _>(d, "burn mul_scalar (1 x 640)", || tiny.clone().mul_scalar(1.0));
        launch_cost::<B, _>(d, "softcap kernel (1 x 640)", || B::softcap(tiny.clone(), 30.0));
        launch_cost::<B, _>(d, "rms_norm kernel (1 x 640)", || B::rms_norm(tiny.clone(), norm_w.clone(), 1e-6));
        launch_cost::<B, _>(d, "project GEMV kernel (640 -> 64)", || {
            B::project(tiny.clone(), &weight, Epilogue::Identity)
        });
        launch_cost::<B, _>(d, "KV append: slice_assign one row", || {
            cache.clone().slice_assign([0..1, 0..1, 5..6, 0..256], new_k.clone())
        });
        launch_cost::<B, _>(d, "swap_dims + reshape (copy)", || heads.clone().reshape([1, 4 * 256]));
        launch_cost::<B, _>(d, "token upload (1 x 1 ids)", || {
            Tensor::<B, 2, Int>::from_data(TensorData::new(vec![5i64], [1, 1]), d)
        });
        Ok(())
    }
}

/// `--section gemm` on a CubeCL backend (the kernels are CubeCL's, so no CPU backend has them).
fn gemm_section(kind: BackendKind, settings: &gemm::Settings) -> Result<(), CliError> {
    println!(
        "dtype {:?}, per call: medians of {} samples of {BATCH} calls issued back to back, then synchronized, after warm-up\n",
        settings.dtype, settings.reps
    );
    match kind {
        #[cfg(feature = "cuda")]
        BackendKind::Cuda => {
            let device = burn::backend::cuda::CudaDevice::new(0);
            gemm::section::<burn_gemma::backends::Cuda>(&device, settings, burn_gemma_kernels::gemm::product);
            Ok(())
        }
        #[cfg(feature = "wgpu")]
        BackendKind::Wgpu => {
            gemm::section::<burn_gemma::backends::Wgpu>(
                &Default::default(),
                settings,
                burn_gemma_kernels::gemm::product,
            );
            Ok(())
        }
        _ => Err(CliError::from("--section gemm runs on --backend cuda or wgpu (CubeCL's kernels)")),
    }
}

/// A `--flash-layouts` entry: `default`, or `<planes>x<keys per tile>` with `p` appended for
/// prefetching the next tile.
fn parse_layout(s: &str) -> Result<Option<burn_gemma_kernels::attention::FlashLayout>, String> {
    use burn_gemma_kernels::attention::{FlashLayout, Prefetch};
    if s == "default" {
        return Ok(None);
    }
    let (s, prefetch) = match s.strip_suffix('p') {
        Some(rest) => (rest, Prefetch::NextTile),
        None => (s, Prefetch::None),
    };
    let (planes, bk) = s.split_once('x').ok_or("expected <planes>x<keys>, e.g. 4x64 or 4x64p")?;
    let number = |x: &str| x.parse::<usize>().map_err(|e| format!("{x:?}: {e}"));
    Ok(Some(FlashLayout { planes: number(planes)?, bk: number(bk)?, prefetch }))
}

/// `--section attention` on the CubeCL backends.
fn attention_section(kind: BackendKind, settings: &prompt_attention::Settings) -> Result<(), CliError> {
    println!(
        "dtype {:?}, per call: medians of {} samples of {BATCH} calls issued back to back, then synchronized, after warm-up",
        settings.dtype, settings.reps
    );
    match kind {
        #[cfg(feature = "cuda")]
        BackendKind::Cuda => {
            prompt_attention::section::<burn_gemma::backends::Cuda>(&burn::backend::cuda::CudaDevice::new(0), settings);
            Ok(())
        }
        #[cfg(feature = "wgpu")]
        BackendKind::Wgpu => {
            prompt_attention::section::<burn_gemma::backends::Wgpu>(&Default::default(), settings);
            Ok(())
        }
        _ => Err(CliError::from("--section attention runs on --backend cuda or wgpu (the CubeCL kernels)")),
    }
}

/// `--section batched` on CUDA (the quantized mma kernel runs there only).
fn batched_section(kind: BackendKind, settings: &gemm::Settings) -> Result<(), CliError> {
    println!(
        "dtype {:?}, per call: medians of {} samples, by CUDA graph replay where the calls record\n",
        settings.dtype, settings.reps
    );
    match kind {
        #[cfg(feature = "cuda")]
        BackendKind::Cuda => {
            use cubecl::Runtime;
            let device = burn::backend::cuda::CudaDevice::new(0);
            let sms = burn_gemma_kernels::quant::mma::multiprocessors(&cubecl::cuda::CudaRuntime::client(&device));
            batched::section::<burn_gemma::backends::Cuda>(
                &device,
                settings,
                sms,
                burn_gemma_kernels::quant::mma::project_with,
            );
            Ok(())
        }
        _ => Err(CliError::from("--section batched runs on --backend cuda")),
    }
}

/// `--section experts` on a CubeCL backend (the paths are the CubeCL backends').
fn experts_section(kind: BackendKind, dtype: DType, reps: usize, rows: &[usize]) -> Result<(), CliError> {
    println!("dtype {dtype:?}, per call: medians of {reps} samples of {BATCH} calls issued back to back, then synchronized, after warm-up\n");
    match kind {
        #[cfg(feature = "cuda")]
        BackendKind::Cuda => {
            let device = burn::backend::cuda::CudaDevice::new(0);
            experts::section::<burn_gemma::backends::Cuda>(
                &device,
                dtype,
                reps,
                rows,
                burn_gemma_kernels::experts::project_on,
            )
        }
        #[cfg(feature = "wgpu")]
        BackendKind::Wgpu => experts::section::<burn_gemma::backends::Wgpu>(
            &Default::default(),
            dtype,
            reps,
            rows,
            burn_gemma_kernels::experts::project_on,
        ),
        _ => Err(CliError::from("--section experts runs on --backend cuda or wgpu (the CubeCL paths)")),
    }
}

fn main() -> Result<(), CliError> {
    let args = Args::parse();
    let dtype = parse_dtype(&args.dtype)?;
    let kind: BackendKind = args.backend.parse()?;
    let models: Vec<String> = args.models.split(',').map(|m| m.trim().to_string()).filter(|m| !m.is_empty()).collect();
    let rows = || {
        args.rows
            .split(',')
            .map(|r| r.trim().parse::<usize>().map_err(|e| CliError::from(format!("--rows {r:?}: {e}"))))
            .collect::<Result<Vec<_>, _>>()
    };
    if args.section == Section::Experts {
        return experts_section(kind, dtype, args.reps.max(1), &rows()?);
    }
    let all = args.gemm_kernels == GemmKernels::All;
    if args.section == Section::Batched {
        let rows = if args.rows == "512,4096" { vec![1, 2, 3, 4, 8, 16, 32, 64] } else { rows()? };
        return batched_section(kind, &gemm::Settings { dtype, reps: args.reps.max(1), rows, models, all });
    }
    if args.section == Section::Attention {
        let list =
            |s: &str| s.split(',').map(str::trim).filter(|x| !x.is_empty()).map(str::to_string).collect::<Vec<_>>();
        let tokens = list(&args.tokens)
            .iter()
            .map(|t| t.parse::<usize>().map_err(|e| CliError::from(format!("--tokens {t:?}: {e}"))))
            .collect::<Result<Vec<_>, _>>()?;
        let kernels = list(&args.attention_kernels)
            .iter()
            .map(|k| match k.as_str() {
                "auto" => Ok(PrefillAttention::Auto),
                "flash" => Ok(PrefillAttention::Flash),
                "blocked" => Ok(PrefillAttention::Blocked),
                "tiled" => Ok(PrefillAttention::Tiled),
                other => Err(CliError::from(format!(
                    "--attention-kernels: unknown kernel {other:?} (auto, flash, blocked, tiled)"
                ))),
            })
            .collect::<Result<Vec<_>, _>>()?;
        let int8 = list(&args.kv)
            .iter()
            .map(|k| match k.as_str() {
                "dense" => Ok(false),
                "int8" => Ok(true),
                other => Err(CliError::from(format!("--kv: unknown format {other:?} (dense, int8)"))),
            })
            .collect::<Result<Vec<_>, _>>()?;
        let layouts = list(&args.flash_layouts)
            .iter()
            .map(|l| parse_layout(l).map_err(|e| CliError::from(format!("--flash-layouts {l:?}: {e}"))))
            .collect::<Result<Vec<_>, _>>()?;
        let settings = prompt_attention::Settings { dtype, reps: args.reps.max(1), tokens, kernels, int8, layouts };
        return attention_section(kind, &settings);
    }
    if args.section == Section::Gemm {
        let rows = rows()?;
        return gemm_section(kind, &gemm::Settings { dtype, reps: args.reps.max(1), rows, models, all });
    }
    dispatch(kind, Bench { dtype, reps: args.reps.max(1), section: args.section, models }, &mut |note| {
        eprintln!("{note}")
    })?
}
