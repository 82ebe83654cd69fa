//! Choosing the prefill GEMM kernel per product shape by timing the candidates once, the choice
//! cached in memory and on disk so that later runs start at full speed.
//!
//! No single CubeCL kernel is fastest on every Gemma product (on the H100 the best of
//! [`TUNED`] beats any one of them by up to 1.4x on some shape: `docs/runs/gpu/2026-11-24-prefill.md`).
//! The first product of a shape class (the device, the dtypes, the batch size, `n`, `k`, the
//! layout, and `m` rounded up to a power of two) runs each candidate that launches, checks its
//! result against CubeCL's per-unit kernel, times it, and keeps the fastest that agrees; that
//! costs a fraction of a second to a few seconds per class (kernel compilation included), once.
//! Choices are appended to `gemm-tune.txt` in the cache folder ([`cache_path`]) and read back by
//! the next process. A line that does not parse (a kernel this version does not know) is
//! ignored and that class tuned again.

use super::{kernel::matmul, GemmKernel};
use burn::tensor::DType;
use burn_cubecl::{tensor::CubeTensor, CubeRuntime};
use std::collections::HashMap;
use std::io::Write;
use std::path::PathBuf;
use std::sync::Mutex;
use std::time::{Duration, Instant};

pub use super::candidates::{DEFAULT, DEFAULT_CUBLASLT_FLOOR, TUNED};

/// Timed samples per candidate (after one launch that compiles and checks it), each
/// [`BATCH`] launches then one synchronization; the fastest sample counts.
const SAMPLES: usize = 3;
const BATCH: usize = 4;

/// What tuning has done in this process.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct TuningSummary {
    /// Shape classes timed in this process.
    pub tuned: usize,
    /// Time spent timing them (kernel compilation included).
    pub time: Duration,
    /// Choices read from the cache file.
    pub cached: usize,
    /// The cache file, where there is a cache folder.
    pub path: Option<PathBuf>,
}

/// The tuning summary so far (for `bench` and `generate` to report the first run's cost).
pub fn summary() -> TuningSummary {
    let state = state();
    let guard = state.lock().unwrap_or_else(|e| e.into_inner());
    TuningSummary { path: cache_path(), ..guard.summary.clone() }
}

/// `$BURN_GEMMA_CACHE/gemm-tune.txt` (the folder models are cached in), else
/// `$XDG_CACHE_HOME/burn-gemma/gemm-tune.txt`, else `$HOME/.cache/burn-gemma/gemm-tune.txt`;
/// `None` where none of these is set (choices are then kept for the process only).
pub fn cache_path() -> Option<PathBuf> {
    let var = |name| std::env::var_os(name).filter(|v| !v.is_empty()).map(PathBuf::from);
    let folder = var("BURN_GEMMA_CACHE")
        .or_else(|| var("XDG_CACHE_HOME").map(|d| d.join("burn-gemma")))
        .or_else(|| var("HOME").map(|d| d.join(".cache").join("burn-gemma")))?;
    Some(folder.join("gemm-tune.txt"))
}

#[derive(Default)]
struct State {
    /// Choices by key (loaded from the file on first use).
    choices: HashMap<String, GemmKernel>,
    loaded: bool,
    /// Whether this process has said that it is tuning.
    announced: bool,
    summary: TuningSummary,
}

fn state() -> &'static Mutex<State> {
    static STATE: std::sync::OnceLock<Mutex<State>> = std::sync::OnceLock::new();
    STATE.get_or_init(|| Mutex::new(State::default()))
}

/// The key of a shape class on `lhs`'s device: `lhs [.., m, k] @ rhs [.., k, n]`, `m` rounded up
/// to a power of two (prompt lengths vary). `n` and `k` are exact for single products (the
/// weights'), but for products batched over heads (the blocked attention's scores and values,
/// whose key length grows with every prompt chunk) they are classed by [`length_class`]: exact,
/// a 128K-token prompt timed a new class at each of its 64 chunks.
fn key<R: CubeRuntime>(lhs: &CubeTensor<R>, rhs: &CubeTensor<R>, out: DType) -> String {
    let hw = &lhs.client.properties().hardware;
    let shape = lhs.meta.shape();
    let rank = shape.len();
    let batch: usize = shape[..rank - 2].iter().product();
    let (m, k, n) = (shape[rank - 2], shape[rank - 1], rhs.meta.shape()[rank - 1]);
    // Whether `rhs` is contiguous along `k` (a weight's transposed view) or along `n`.
    let rhs_layout = if rhs.meta.strides()[rank - 2] == 1 { "t" } else { "n" };
    let dim = |d: usize| if batch > 1 { length_class(d) } else { d.to_string() };
    format!(
        "{}-sm{}-smem{} {:?}->{out:?} b{batch} m{} n{}{rhs_layout} k{}",
        R::name(&lhs.client),
        hw.num_streaming_multiprocessors.unwrap_or(0),
        hw.max_shared_memory_size,
        lhs.dtype,
        m.next_power_of_two(),
        dim(n),
        dim(k)
    )
}

/// Key lengths past which the products' choices are shared: by 16K keys every candidate has
/// tiles for all units, so the choice made there stands for longer ones. Timing each longer
/// power of two (on products that grow with it) took a 128K-token prompt on the 4B 155 s of
/// tuning (H200, 12 classes, `docs/runs/gpu/2026-11-28-long.md`).
const SHARED_LENGTH: usize = 16_384;

/// A key-length dimension's class: exact up to 2,048, then its power of two up to
/// [`SHARED_LENGTH`], one class past it; each with its remainder modulo 256 (a kernel that goes
/// wrong on some remainder of a tile still meets it in the class it was checked on).
fn length_class(d: usize) -> String {
    if d <= 2048 {
        d.to_string()
    } else if d <= SHARED_LENGTH {
        format!("{}~{}", d.next_power_of_two(), d % 256)
    } else {
        format!("{SHARED_LENGTH}+~{}", d % 256)
    }
}

/// The kernel for `lhs @ rhs` (as [`matmul`] takes them) on this device: the cached choice for
/// the shape class, or the fastest candidate (the tuning's, [`DEFAULT`] by default) timed now on these operands whose result agrees
/// with [`GemmKernel::Unit`]'s (a candidate CubeCL launches but computes wrongly for some shape
/// is never chosen); `None` when no candidate launches and agrees.
pub(crate) fn choose<R: CubeRuntime>(lhs: &CubeTensor<R>, rhs: &CubeTensor<R>, out: DType) -> Option<GemmKernel> {
    let state = state();
    let mut guard = state.lock().unwrap_or_else(|e| e.into_inner());
    // cuBLASLt is a candidate for the class where its multiply-adds (`m` rounded up as in the
    // key) reach the floor; such classes are keyed apart (` lt`), so that choices made without
    // it (in an earlier version's cache file) are timed again with it.
    let shape = lhs.meta.shape();
    let rank = shape.len();
    let macs = shape[..rank - 2].iter().product::<usize>()
        * shape[rank - 2].next_power_of_two()
        * shape[rank - 1]
        * rhs.meta.shape()[rank - 1];
    // The candidates and the floor of the tuning in effect ([`crate::KernelTuning`]).
    let (mut candidates, floor, default) = crate::tuning::current(|t| {
        (t.gemm_candidates.to_vec(), t.cublaslt_floor, t.gemm_candidates[..] == DEFAULT[..])
    });
    // cuBLASLt runs on CUDA only: elsewhere it is not a candidate (nor in the key).
    let cuda = R::name(&lhs.client) == "cuda";
    candidates.retain(|&k| k != GemmKernel::CublasLt || (cuda && macs >= floor));
    // hipBLASLt (only when named as a candidate) likewise on ROCm, keyed apart (` hlt`).
    let hip = R::name(&lhs.client) == "hip";
    candidates.retain(|&k| k != GemmKernel::HipBlasLt || (hip && macs >= floor));
    let mut key = key(lhs, rhs, out);
    if candidates.contains(&GemmKernel::CublasLt) {
        key.push_str(" lt");
    }
    if candidates.contains(&GemmKernel::HipBlasLt) {
        key.push_str(" hlt");
    }
    // Choices made among other candidates than the default's are kept apart from its choices.
    if !default {
        let names: Vec<String> = candidates.iter().map(GemmKernel::to_string).collect();
        key.push_str(&format!(" among[{}]", names.join(",")));
    }
    if !guard.loaded {
        guard.loaded = true;
        let loaded = load();
        guard.summary.cached = loaded.len();
        guard.choices.extend(loaded);
    }
    if let Some(&kernel) = guard.choices.get(&key).filter(|k| candidates.contains(k)) {
        return Some(kernel);
    }
    if !guard.announced {
        guard.announced = true;
        // Once per process: the first prompt on a new device waits for this (seconds to a minute).
        eprintln!(
            "burn-gemma: timing prefill GEMM kernels for product shapes new to this device (once; choices kept in {})",
            cache_path().map_or("memory only: no cache folder".into(), |p| p.display().to_string())
        );
    }
    // Timed without the lock: timing waits for the device, whose queue may hold a collective
    // that another thread's device must join first (tensor-parallel shards, one thread each,
    // meeting new shapes together), and that thread may be about to choose a kernel too.
    drop(guard);
    let start = Instant::now();
    let expected = matmul(lhs.clone(), rhs.clone(), out, GemmKernel::Unit).ok().and_then(|t| read(&t))?;
    let mut best: Option<(Duration, GemmKernel)> = None;
    let run = |kernel| matmul(lhs.clone(), rhs.clone(), out, kernel).ok().filter(|_| sync(lhs).is_ok());
    for kernel in candidates {
        // The first launch compiles the kernel and is checked; a refusal (no TMA, no `mma`)
        // or a disagreement skips it.
        let Some(result) = run(kernel) else { continue };
        if !read(&result).is_some_and(|got| agrees(&got, &expected)) {
            continue;
        }
        let mut fastest = Duration::MAX;
        for _ in 0..SAMPLES {
            let t = Instant::now();
            let launched = (0..BATCH).all(|_| matmul(lhs.clone(), rhs.clone(), out, kernel).is_ok());
            if !launched || sync(lhs).is_err() {
                fastest = Duration::MAX;
                break;
            }
            fastest = fastest.min(t.elapsed());
        }
        if best.is_none_or(|(b, _)| fastest < b) {
            best = Some((fastest, kernel));
        }
    }
    let (_, kernel) = best?;
    let mut guard = state.lock().unwrap_or_else(|e| e.into_inner());
    guard.summary.tuned += 1;
    guard.summary.time += start.elapsed();
    guard.choices.insert(key.clone(), kernel);
    save(&key, kernel);
    Some(kernel)
}

/// A contiguous product's values, as f32 on the host.
fn read<R: CubeRuntime>(t: &CubeTensor<R>) -> Option<Vec<f32>> {
    let bytes = t.client.read_one(t.handle.clone()).ok()?.to_vec();
    let values = match t.dtype {
        DType::F32 => bytes.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect(),
        DType::BF16 => bytes.chunks_exact(2).map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32()).collect(),
        DType::F16 => bytes.chunks_exact(2).map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32()).collect(),
        _ => return None,
    };
    Some(values)
}

/// Whether `got` matches `expected` to within two roundings of the output dtype (both sum in
/// f32, in different orders; a wrong kernel is off by whole products).
fn agrees(got: &[f32], expected: &[f32]) -> bool {
    got.len() == expected.len()
        && got.iter().zip(expected).all(|(g, e)| g.is_finite() && (g - e).abs() <= 1.6e-2 * (1.0 + e.abs()))
}

fn sync<R: CubeRuntime>(x: &CubeTensor<R>) -> Result<(), cubecl::server::ServerError> {
    cubecl::future::block_on(x.client.sync())
}

/// Every parsable `key = kernel` line of the cache file.
fn load() -> HashMap<String, GemmKernel> {
    let Some(text) = cache_path().and_then(|p| std::fs::read_to_string(p).ok()) else {
        return HashMap::new();
    };
    let known: HashMap<String, GemmKernel> = GemmKernel::candidates().into_iter().map(|k| (k.to_string(), k)).collect();
    let choices: HashMap<String, GemmKernel> = text
        .lines()
        .filter_map(|line| line.split_once(" = "))
        .filter_map(|(key, name)| known.get(name.trim()).map(|&k| (key.trim().to_string(), k)))
        .collect();
    choices
}

/// Appends a choice to the cache file; a folder that cannot be written keeps the choice for
/// this process only.
fn save(key: &str, kernel: GemmKernel) {
    let Some(path) = cache_path() else { return };
    if let Some(folder) = path.parent() {
        if std::fs::create_dir_all(folder).is_err() {
            return;
        }
    }
    if let Ok(mut file) = std::fs::OpenOptions::new().create(true).append(true).open(&path) {
        let _ = writeln!(file, "{key} = {kernel}");
    }
}

#[cfg(test)]
mod tests {
    use super::length_class;
    use std::collections::HashSet;

    #[test]
    fn chunked_prompt_key_lengths_share_classes() {
        // A 128K-token prompt in chunks of 2,048: the key lengths its chunks attend over fall
        // into one class per power of two up to 16K (2,048, 4K, 8K, 16K) and one past it,
        // instead of 64 lengths.
        let lengths: Vec<usize> = (1..=64).map(|chunk| chunk * 2048).collect();
        let classes: HashSet<String> = lengths.iter().map(|&d| length_class(d)).collect();
        assert_eq!(classes.len(), 4 + 1, "{classes:?}");
        // Up to 2,048 keys are exact, and a remainder of a tile stays apart from whole tiles.
        assert_eq!(length_class(2047), "2047");
        assert_ne!(length_class(12_000), length_class(12_288));
        assert_eq!(length_class(12_288), length_class(16_384));
        assert_ne!(length_class(16_384), length_class(16_385));
        // Past 16K one class per remainder, whatever the length.
        assert_eq!(length_class(20_480), length_class(131_072));
        assert_eq!(length_class(16_385), length_class(131_073));
        assert_ne!(length_class(131_071), length_class(131_072));
    }
}
