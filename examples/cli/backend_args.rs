//! The backend options the example programs share (`#[command(flatten)]` into their own).

use burn::tensor::DType;
use burn_gemma::{
    backends::{cpu_threads, parse_kv_cache, resolve_weights, set_cpu_threads, BackendKind},
    Error, KvFormat, WeightFormat,
};
use std::num::NonZeroUsize;

#[derive(clap::Args, Debug, Clone)]
pub struct BackendArgs {
    /// auto | cuda | rocm | vulkan | wgpu | metal | candle | ndarray
    #[arg(long, default_value = "auto")]
    pub backend: String,
    /// f32 | f16 | bf16: compute dtype; default: bf16 on CUDA/ROCm, f32 elsewhere.
    #[arg(long)]
    pub dtype: Option<String>,
    /// auto | native | converted | q8 | q4 | bf16 | f16 | f32: how weight matrices are kept on
    /// the device (`native`: a GGUF's own block types, multiplied as they are on Candle and by
    /// the GPU kernels for Q4_K/Q5_K/Q6_K, other types converted to q8/q4 on GPUs; `converted`:
    /// every block type converted to the closest of q8/q4; dense for safetensors; `auto`:
    /// native on Candle, converted on GPUs (their Q8/Q4 kernels decode faster than the
    /// k-quant ones), dense on NdArray, which dequantizes on every product).
    #[arg(long, default_value = "auto")]
    pub weights: String,
    /// auto | bf16 | f16 | f32 | int8: how the KV cache stores keys and values (`auto`: the
    /// compute dtype; `int8`: one scale per position and head, read directly by attention).
    #[arg(long, default_value = "auto")]
    pub kv_cache: String,
    /// CPU threads of the CPU backends (candle, ndarray); default: the machine's physical cores.
    #[arg(long)]
    pub threads: Option<NonZeroUsize>,
}

impl BackendArgs {
    /// The backend asked for, with the weight, dtype and KV options checked as far as they
    /// can be without a backend: everything the user typed, before any download or load.
    pub fn check(&self) -> Result<BackendKind, Error> {
        let kind: BackendKind = self.backend.parse()?;
        let (_, dtype) = resolve_weights(&self.weights, self.dtype.as_deref(), "")?;
        parse_kv_cache(&self.kv_cache, dtype)?;
        Ok(kind)
    }

    /// Sizes the CPU thread pools and returns the thread count. Candle splits its dense
    /// products into `RAYON_NUM_THREADS` tasks, so this sets that variable too: call it while
    /// the program has no other thread, before any pool starts.
    pub fn start_threads(&self) -> Result<usize, Error> {
        let threads = cpu_threads(self.threads);
        std::env::set_var("RAYON_NUM_THREADS", threads.to_string());
        set_cpu_threads(NonZeroUsize::new(threads))?;
        Ok(threads)
    }

    /// The weight format, compute dtype and KV format on the backend named `backend`.
    pub fn formats(&self, backend: &str) -> Result<(WeightFormat, DType, KvFormat), Error> {
        let (weights, dtype) = resolve_weights(&self.weights, self.dtype.as_deref(), backend)?;
        Ok((weights, dtype, parse_kv_cache(&self.kv_cache, dtype)?))
    }
}
