//! Backend type aliases (each behind its cargo feature) and runtime backend selection.
//!
//! GPU aliases are the unfused `CubeBackend` types, so the CubeCL kernels of
//! `burn-gemma-kernels` receive primitive tensors directly.

use crate::{
    error::{BackendError, OptionError},
    Error, GemmaBackend,
};

/// Pure-Rust CPU backend (feature `ndarray`, on by default).
#[cfg(feature = "ndarray")]
pub type NdArray = burn::backend::NdArray<f32>;
/// Candle CPU backend (feature `candle`).
#[cfg(feature = "candle")]
#[allow(deprecated)]
pub type Candle = burn::backend::Candle<f32, i64>;
/// wgpu backend: Vulkan, Metal, DX12 or WebGPU, whichever the platform offers (feature `wgpu`).
///
/// Named as the unfused `CubeBackend`, not `burn::backend::Wgpu`: a program that turns on Burn's
/// default features (which include `fusion`) gets `burn::backend::Wgpu = Fusion<..>`, whose
/// tensors the CubeCL kernels cannot take. This alias stays the same whatever Burn's features.
#[cfg(feature = "wgpu")]
pub type Wgpu = burn::backend::wgpu::CubeBackend<burn::backend::wgpu::WgpuRuntime, f32, i32, u32>;
/// wgpu through Vulkan with SPIR-V kernels (feature `vulkan`).
#[cfg(feature = "vulkan")]
pub type Vulkan = burn::backend::wgpu::CubeBackend<burn::backend::wgpu::WgpuRuntime, f32, i32, u8>;
/// wgpu through Metal with MSL kernels (feature `metal`).
#[cfg(feature = "metal")]
pub type Metal = burn::backend::wgpu::CubeBackend<burn::backend::wgpu::WgpuRuntime, f32, i32, u8>;
/// NVIDIA GPUs through CUDA (feature `cuda`); unfused whatever Burn's features, as [`Wgpu`].
#[cfg(feature = "cuda")]
pub type Cuda = burn_cubecl::CubeBackend<cubecl::cuda::CudaRuntime, f32, i32, u8>;
/// AMD GPUs through ROCm/HIP (feature `rocm`); unfused whatever Burn's features, as [`Wgpu`].
#[cfg(feature = "rocm")]
pub type Rocm = burn_cubecl::CubeBackend<cubecl::hip::HipRuntime, f32, i32, u8>;

/// Parses a compute dtype name: `f32`/`float32`, `f16`/`float16` or `bf16`/`bfloat16`.
pub fn parse_dtype(s: &str) -> Result<burn::tensor::DType, Error> {
    use burn::tensor::DType;
    match s.to_ascii_lowercase().as_str() {
        "f32" | "float32" => Ok(DType::F32),
        "f16" | "float16" => Ok(DType::F16),
        "bf16" | "bfloat16" => Ok(DType::BF16),
        other => {
            Err(OptionError::Unknown { option: "dtype", value: other.into(), expected: "f32, f16 or bf16" }.into())
        }
    }
}

/// The CPU thread count [`set_cpu_threads`] takes for `threads`: it, else the physical cores.
pub fn cpu_threads(threads: Option<std::num::NonZeroUsize>) -> usize {
    threads.map_or_else(|| num_cpus::get_physical().max(1), std::num::NonZeroUsize::get)
}

/// Sets how many threads the CPU backends use: rayon's global pool, which runs NdArray, candle's
/// quantized products and candle's dense products. `None` takes the machine's physical cores
/// (hyper-threads share a core's vector units and its memory bandwidth, which a decode step
/// saturates). Call it once, at the start of the program, before any CPU work starts the pool
/// with its default size. Returns the count.
///
/// Candle splits a dense product into as many tasks as `RAYON_NUM_THREADS` says (else the
/// logical CPUs). This function does not set that variable (changing the environment races
/// with the program's other threads); a program that wants candle's split to match sets it
/// itself before it starts any thread, as the examples do.
pub fn set_cpu_threads(threads: Option<std::num::NonZeroUsize>) -> Result<usize, Error> {
    let n = cpu_threads(threads);
    rayon::ThreadPoolBuilder::new()
        .num_threads(n)
        .build_global()
        .map_err(|e| BackendError::ThreadPool { threads: n, reason: e.to_string() })?;
    Ok(n)
}

/// This process's resident memory (`VmRSS`) in bytes, where the system reports it (Linux).
pub fn resident_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
    let kib: u64 = line.trim_start_matches("VmRSS:").trim().trim_end_matches("kB").trim().parse().ok()?;
    Some(kib * 1024)
}

/// Resolves `--weights` (`auto`, `native`, `q8`, `q4`, or a dense dtype `bf16`/`f16`/`f32`) and
/// `--dtype` into the weight format and the compute dtype. A dense weight dtype is also the
/// compute dtype, so a different `--dtype` beside it is refused; otherwise the compute dtype is
/// `--dtype` or the backend's default (see [`default_dtype`]).
pub fn resolve_weights(
    weights: &str,
    dtype: Option<&str>,
    backend_name: &str,
) -> Result<(burn_gemma_model::WeightFormat, burn::tensor::DType), Error> {
    use burn_gemma_kernels::QuantFormat;
    use burn_gemma_model::WeightFormat;
    let asked = dtype.map(parse_dtype).transpose()?;
    let format = match weights.to_ascii_lowercase().as_str() {
        // NdArray dequantizes a quantized matrix on every product (the reference path), so dense
        // weights are much faster there; Candle multiplies GGUF blocks with candle's quantized
        // kernels and the GPU kernels read the codes directly.
        "auto" if backend_name.starts_with("ndarray") => WeightFormat::Dense,
        "auto" if backend_name.starts_with("candle") => WeightFormat::Native,
        // The GPU kernels decode Q4/Q8 faster than the file's k-quants (`PreferredBlocks`).
        "auto" => WeightFormat::Converted,
        "native" => WeightFormat::Native,
        "converted" => WeightFormat::Converted,
        "q8" | "q8_0" => WeightFormat::Quantized(QuantFormat::Q8),
        "q4" => WeightFormat::Quantized(QuantFormat::Q4),
        other => {
            let dense = parse_dtype(other).map_err(|_| OptionError::Unknown {
                option: "--weights",
                value: other.into(),
                expected: "auto, native, converted, q8, q4, bf16, f16 or f32",
            })?;
            if let Some(asked) = asked.filter(|&a| a != dense) {
                return Err(
                    OptionError::WeightsDtypeConflict { weights: other.into(), weights_dtype: dense, asked }.into()
                );
            }
            return Ok((WeightFormat::Dense, dense));
        }
    };
    Ok((format, asked.unwrap_or_else(|| default_dtype(backend_name))))
}

/// Parses `--kv-cache`: `auto` (the compute dtype), `bf16`, `f16`, `f32` or `int8`.
pub fn parse_kv_cache(s: &str, compute: burn::tensor::DType) -> Result<burn_gemma_model::KvFormat, Error> {
    use burn_gemma_model::KvFormat;
    match s.to_ascii_lowercase().as_str() {
        "auto" => Ok(KvFormat::Dense(compute)),
        "int8" | "i8" | "q8" => Ok(KvFormat::Int8),
        other => parse_dtype(other).map(KvFormat::Dense).map_err(|_| {
            OptionError::Unknown { option: "--kv-cache", value: other.into(), expected: "auto, bf16, f16, f32 or int8" }
                .into()
        }),
    }
}

/// The dtype to run in when none is asked for: bf16 on CUDA and ROCm (`backend_name` as
/// [`BackendTask::run`] receives it), f32 elsewhere (CPU backends and wgpu drivers without
/// bf16).
pub fn default_dtype(backend_name: &str) -> burn::tensor::DType {
    if backend_name.starts_with("cuda") || backend_name.starts_with("rocm") {
        burn::tensor::DType::BF16
    } else {
        burn::tensor::DType::F32
    }
}

/// Backends selectable at run time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BackendKind {
    /// The best backend compiled in and present: CUDA, ROCm, a Vulkan/Metal GPU, then CPU
    /// (Candle, else NdArray).
    Auto,
    Cuda,
    Rocm,
    Vulkan,
    Wgpu,
    Metal,
    Candle,
    NdArray,
}

impl std::str::FromStr for BackendKind {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self, Error> {
        Ok(match s.to_ascii_lowercase().as_str() {
            "auto" => Self::Auto,
            "cuda" => Self::Cuda,
            "rocm" | "hip" => Self::Rocm,
            "vulkan" => Self::Vulkan,
            "wgpu" => Self::Wgpu,
            "metal" => Self::Metal,
            "candle" => Self::Candle,
            "ndarray" => Self::NdArray,
            other => {
                return Err(OptionError::Unknown {
                    option: "backend",
                    value: other.into(),
                    expected: "one of auto, cuda, rocm, vulkan, wgpu, metal, candle, ndarray",
                }
                .into())
            }
        })
    }
}

/// Work to run on a backend chosen at run time.
pub trait BackendTask {
    type Output;
    /// Runs on backend `B` and `device`; `name` says which, for the user.
    fn run<B: GemmaBackend>(self, device: B::Device, name: &str) -> Self::Output;
}

/// Runs `f`, turning a panic into `None`: the GPU runtimes panic where a device cannot be used.
/// The process's panic hook is left as it is (replacing it would race with the program's other
/// threads), so such a panic is still reported by it; [`cuda_present`] and [`wgpu_adapter`]
/// look for a device first without touching the runtimes, so that this happens only when a
/// device is there but fails.
fn probe<T>(f: impl FnOnce() -> T) -> Option<T> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).ok()
}

/// Whether the CUDA driver library loads and reports a device (without touching CubeCL, whose
/// runtime panics where there is none).
#[cfg(feature = "cuda")]
pub fn cuda_present() -> bool {
    burn_gemma_kernels::graph::cuda_device_count() > 0
}

/// Whether wgpu finds an adapter of the kind `device` asks for (without touching CubeCL, whose
/// runtime panics where there is none). It looks where CubeCL will: on the graphics API CubeCL
/// picks for this OS (Vulkan, Metal on macOS), taking an adapter of type `Other` where none of
/// the kind asked for is there. Other APIs' adapters (a GL driver on llvmpipe) do not count.
#[cfg(feature = "wgpu")]
pub fn wgpu_adapter(device: &burn::backend::wgpu::WgpuDevice) -> bool {
    use burn::backend::wgpu::{
        graphics::{AutoGraphicsApi, GraphicsApi},
        WgpuDevice,
    };
    use wgpu::DeviceType;
    let instance = wgpu::Instance::default();
    let api = AutoGraphicsApi::backend();
    let adapters = cubecl::future::block_on(instance.enumerate_adapters(api.into()));
    let kinds: Vec<DeviceType> = adapters.iter().map(|a| a.get_info().device_type).collect();
    let has = |kind: DeviceType| kinds.contains(&kind) || kinds.contains(&DeviceType::Other);
    match device {
        WgpuDevice::DiscreteGpu(_) => has(DeviceType::DiscreteGpu),
        WgpuDevice::IntegratedGpu(_) => has(DeviceType::IntegratedGpu),
        WgpuDevice::VirtualGpu(_) => has(DeviceType::VirtualGpu),
        WgpuDevice::Cpu => has(DeviceType::Cpu),
        _ => !kinds.is_empty(),
    }
}

/// Whether backend `B` can run a small computation on `device`.
#[cfg(any(feature = "cuda", feature = "rocm", feature = "wgpu"))]
fn usable<B: GemmaBackend>(device: &B::Device) -> bool {
    let device = device.clone();
    probe(move || {
        let t = burn::tensor::Tensor::<B, 1>::ones([4], &device);
        burn::tensor::ElementConversion::elem::<f32>(t.sum().into_scalar())
    })
    .is_some_and(|v| v == 4.0)
}

/// Fails unless backend `B` can run a matrix product in `dtype` on `device`. Some backends
/// report a dtype as supported but cannot multiply in it (Candle's CPU matmul and bf16).
pub fn check_dtype<B: GemmaBackend>(device: &B::Device, dtype: burn::tensor::DType) -> Result<(), Error> {
    let backend = B::name(device);
    let device = device.clone();
    let works = B::supports_dtype(&device, dtype)
        && probe(move || {
            let a = burn::tensor::Tensor::<B, 2>::ones([2, 2], (&device, dtype));
            let product = a.clone().matmul(a).cast(burn::tensor::DType::F32).into_data();
            product.to_vec::<f32>().map(|v| v.iter().sum::<f32>()).ok()
        })
        .flatten()
        .is_some_and(|v| v == 8.0);
    if works {
        Ok(())
    } else {
        Err(burn_gemma_model::ModelError::BackendDtype { backend, dtype }.into())
    }
}

fn not_compiled(name: &'static str, feature: &'static str) -> Error {
    BackendError::NotCompiled { name, feature }.into()
}

#[cfg(any(feature = "cuda", feature = "rocm", feature = "wgpu"))]
fn no_device(name: &'static str) -> Error {
    BackendError::NoDevice(name).into()
}

/// Devices detected per compiled backend, for `--list-devices`.
// Filled per compiled backend: what is pushed depends on the features.
#[allow(clippy::vec_init_then_push)]
pub fn list_devices() -> Vec<String> {
    let mut out = Vec::new();
    #[cfg(feature = "cuda")]
    {
        let d = burn::backend::cuda::CudaDevice::new(0);
        out.push(format!(
            "cuda: {}",
            if cuda_present() && usable::<Cuda>(&d) { "device 0 available" } else { "no device" }
        ));
    }
    #[cfg(feature = "rocm")]
    {
        let d = burn::backend::rocm::RocmDevice::new(0);
        out.push(format!("rocm: {}", if usable::<Rocm>(&d) { "device 0 available" } else { "no device" }));
    }
    #[cfg(feature = "wgpu")]
    {
        use burn::backend::wgpu::WgpuDevice;
        for (label, d) in [
            ("discrete GPU", WgpuDevice::DiscreteGpu(0)),
            ("integrated GPU", WgpuDevice::IntegratedGpu(0)),
            ("CPU adapter (software)", WgpuDevice::Cpu),
        ] {
            out.push(format!(
                "wgpu {label}: {}",
                if wgpu_adapter(&d) && usable::<Wgpu>(&d) { "available" } else { "none" }
            ));
        }
    }
    #[cfg(feature = "candle")]
    out.push("candle: CPU".to_string());
    #[cfg(feature = "ndarray")]
    out.push("ndarray: CPU".to_string());
    out
}

/// Runs `task` on the backend `kind` names. `Auto` tries CUDA, ROCm, a wgpu GPU, then CPU, and
/// reports what it skipped through `note`.
pub fn dispatch<T: BackendTask>(kind: BackendKind, task: T, note: &mut dyn FnMut(&str)) -> Result<T::Output, Error> {
    // `note` reports skipped GPU backends; without GPU features there is nothing to skip.
    let _ = &note;
    match kind {
        BackendKind::Auto => {
            #[cfg(feature = "cuda")]
            {
                let d = burn::backend::cuda::CudaDevice::new(0);
                if cuda_present() && usable::<Cuda>(&d) {
                    return Ok(task.run::<Cuda>(d, "cuda"));
                }
                note("cuda: no device found, trying the next backend");
            }
            #[cfg(feature = "rocm")]
            {
                let d = burn::backend::rocm::RocmDevice::new(0);
                if usable::<Rocm>(&d) {
                    return Ok(task.run::<Rocm>(d, "rocm"));
                }
                note("rocm: no device found, trying the next backend");
            }
            #[cfg(feature = "wgpu")]
            {
                use burn::backend::wgpu::WgpuDevice;
                for d in [WgpuDevice::DiscreteGpu(0), WgpuDevice::IntegratedGpu(0)] {
                    if wgpu_adapter(&d) && usable::<Wgpu>(&d) {
                        return Ok(task.run::<Wgpu>(d, "wgpu"));
                    }
                }
                note("wgpu: no GPU adapter found, using the CPU");
            }
            // On CPU, Candle's matrix products are several times faster than NdArray's.
            #[cfg(feature = "candle")]
            {
                return Ok(task.run::<Candle>(Default::default(), "candle (CPU)"));
            }
            #[cfg(all(feature = "ndarray", not(feature = "candle")))]
            {
                return Ok(task.run::<NdArray>(Default::default(), "ndarray (CPU)"));
            }
            #[allow(unreachable_code)]
            Err(BackendError::NoneCompiled.into())
        }
        BackendKind::Cuda => {
            #[cfg(feature = "cuda")]
            {
                let d = burn::backend::cuda::CudaDevice::new(0);
                return if cuda_present() && usable::<Cuda>(&d) {
                    Ok(task.run::<Cuda>(d, "cuda"))
                } else {
                    Err(no_device("cuda"))
                };
            }
            #[allow(unreachable_code)]
            Err(not_compiled("cuda", "cuda"))
        }
        BackendKind::Rocm => {
            #[cfg(feature = "rocm")]
            {
                let d = burn::backend::rocm::RocmDevice::new(0);
                return if usable::<Rocm>(&d) { Ok(task.run::<Rocm>(d, "rocm")) } else { Err(no_device("rocm")) };
            }
            #[allow(unreachable_code)]
            Err(not_compiled("rocm", "rocm"))
        }
        BackendKind::Vulkan | BackendKind::Wgpu | BackendKind::Metal => {
            #[cfg(feature = "wgpu")]
            {
                let d = burn::backend::wgpu::WgpuDevice::DefaultDevice;
                return if wgpu_adapter(&d) && usable::<Wgpu>(&d) {
                    Ok(task.run::<Wgpu>(d, "wgpu"))
                } else {
                    Err(no_device("wgpu"))
                };
            }
            #[allow(unreachable_code)]
            Err(not_compiled("wgpu", "wgpu"))
        }
        BackendKind::Candle => {
            #[cfg(feature = "candle")]
            {
                return Ok(task.run::<Candle>(Default::default(), "candle (CPU)"));
            }
            #[allow(unreachable_code)]
            Err(not_compiled("candle", "candle"))
        }
        BackendKind::NdArray => {
            #[cfg(feature = "ndarray")]
            {
                return Ok(task.run::<NdArray>(Default::default(), "ndarray (CPU)"));
            }
            #[allow(unreachable_code)]
            Err(not_compiled("ndarray", "ndarray"))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::tensor::DType;
    use burn_gemma_kernels::QuantFormat;
    use burn_gemma_model::{KvFormat, WeightFormat};

    #[test]
    fn weights_and_kv_flags_resolve() {
        assert_eq!(resolve_weights("auto", None, "candle (CPU)").unwrap(), (WeightFormat::Native, DType::F32));
        assert_eq!(resolve_weights("auto", None, "ndarray (CPU)").unwrap(), (WeightFormat::Dense, DType::F32));
        assert_eq!(resolve_weights("auto", None, "cuda:0").unwrap(), (WeightFormat::Converted, DType::BF16));
        assert_eq!(resolve_weights("native", None, "cuda:0").unwrap(), (WeightFormat::Native, DType::BF16));
        assert_eq!(
            resolve_weights("Q4", Some("f16"), "cuda:0").unwrap(),
            (WeightFormat::Quantized(QuantFormat::Q4), DType::F16)
        );
        assert_eq!(resolve_weights("f32", None, "cuda:0").unwrap(), (WeightFormat::Dense, DType::F32));
        assert_eq!(resolve_weights("converted", None, "cuda:0").unwrap(), (WeightFormat::Converted, DType::BF16));
        assert_eq!(resolve_weights("bf16", Some("bf16"), "cuda:0").unwrap(), (WeightFormat::Dense, DType::BF16));
        let conflict = resolve_weights("f32", Some("bf16"), "cuda:0").unwrap_err().to_string();
        assert!(conflict.contains("--weights f32") && conflict.contains("--dtype"), "{conflict}");
        let unknown = resolve_weights("q3", None, "cuda:0").unwrap_err().to_string();
        assert!(unknown.contains("unknown --weights \"q3\""), "{unknown}");
        assert_eq!(parse_kv_cache("auto", DType::BF16).unwrap(), KvFormat::Dense(DType::BF16));
        assert_eq!(parse_kv_cache("INT8", DType::BF16).unwrap(), KvFormat::Int8);
        assert_eq!(parse_kv_cache("f32", DType::BF16).unwrap(), KvFormat::Dense(DType::F32));
        assert!(parse_kv_cache("fp8", DType::BF16).unwrap_err().to_string().contains("unknown --kv-cache \"fp8\""));
    }
}
