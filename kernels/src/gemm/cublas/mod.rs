//! The prefill products through NVIDIA's cuBLASLt, one more candidate of the shape tuner
//! ([`super::tune`]) on CUDA, timed for products of at least
//! [`super::tune::DEFAULT_CUBLASLT_FLOOR`] multiply-adds.
//!
//! Why a vendor library for this one operation: CubeCL 0.10's matmul kernels have no Hopper
//! `wgmma` path and reach about 30% of the H200's bf16 rate on Gemma's products; cuBLASLt's
//! kernels use `wgmma` with TMA-fed pipelines. Whole prompts on the H200
//! (`docs/runs/gpu/2026-11-27-order.md`, call 4, random bf16 weights): Gemma 3 4B pp4096 24,365 ->
//! 45,529 tok/s, 12B (16 of its layers) pp4096 26,060 -> 59,367 and pp512 19,589 -> 47,742;
//! 1B unchanged (its products are small, and stay on CubeCL's kernels). It is chosen only where
//! the tuner timed it faster on the shape, and every other backend (and a machine without
//! `libcublasLt`) keeps CubeCL's kernels.
//!
//! The library is loaded at run time (`cudarc`'s `cublaslt` module); nothing links against it.
//!
//! # Ordering with CubeCL's stream
//!
//! CubeCL launches on a stream of its own that it does not expose, so the products run on a
//! stream of ours, ordered against CubeCL's by one of two means ([`order`]): flags in device
//! memory polled by one-thread kernels on both streams (the default), or host waits. With host
//! waits the product alone ran at up to 654 TFLOP/s on the H200 (Gemma 3 4B's gate|up at 4,096
//! rows, `docs/runs/gpu/2026-11-27-prefill.md`) but whole prompts ran slower than with CubeCL's
//! kernels alone (each wait drains CubeCL's launch queue). Each host thread has its own stream,
//! workspace and flags.

pub mod order;

pub use order::Ordering;

use super::blas_layout::{Layouts, Problem};
use super::GemmError;
use super::GemmKernel;
use burn::tensor::DType;
use burn_cubecl::tensor::CubeTensor;
use cubecl::cuda::CudaRuntime;
use cubecl::prelude::*;
use cudarc::cublaslt::{result as lt, sys as lts};
use cudarc::driver::{result as drv, sys as drs};
use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::Mutex;

/// Workspace for cuBLASLt's kernels (split-k and stream-k partials): NVIDIA recommends 32 MiB
/// on Hopper.
const WORKSPACE_BYTES: usize = 32 << 20;

/// The cuBLASLt state of one calling thread (one CubeCL stream) on one device; used on CubeCL's
/// device thread ([`product`]).
struct Lane {
    ordinal: usize,
    handle: lts::cublasLtHandle_t,
    stream: drs::CUstream,
    workspace: drs::CUdeviceptr,
    algos: HashMap<Problem, lts::cublasLtMatmulAlgo_t>,
    /// The SMs cuBLASLt plans for: the device's less two, left to the ordering polls.
    sm_target: i32,
    /// Device-side ordering, made on first use; `None` also after a poll gave up.
    flags: Option<order::Flags>,
    /// A poll gave up: this lane orders by host waits from then on.
    host_only: bool,
}

// SAFETY: a lane's raw handles are used only on CubeCL's device thread, which made them, under
// the registry's lock.
unsafe impl Send for Lane {}

/// Lanes by (device ordinal, calling thread).
fn lanes() -> &'static Mutex<HashMap<(usize, std::thread::ThreadId), Lane>> {
    static LANES: std::sync::OnceLock<Mutex<HashMap<(usize, std::thread::ThreadId), Lane>>> =
        std::sync::OnceLock::new();
    LANES.get_or_init(Default::default)
}

/// Whether `libcublasLt` can be loaded on this machine (checked once).
pub fn available() -> bool {
    static PRESENT: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    // SAFETY: `is_culib_present` only tries to open the library.
    *PRESENT.get_or_init(|| unsafe { lts::is_culib_present() })
}

fn cuda_type(dtype: DType) -> Option<lts::cudaDataType> {
    match dtype {
        DType::BF16 => Some(lts::cudaDataType::CUDA_R_16BF),
        DType::F16 => Some(lts::cudaDataType::CUDA_R_16F),
        DType::F32 => Some(lts::cudaDataType::CUDA_R_32F),
        _ => None,
    }
}

fn refuse(m: usize, n: usize, k: usize, dtype: DType, reason: impl Into<String>) -> GemmError {
    GemmError { kernel: GemmKernel::CublasLt, m, n, k, dtype, reason: reason.into() }
}

/// `lhs [.., m, k] @ rhs [.., k, n] -> [.., m, n]` in `out_dtype` through cuBLASLt, or `Err`
/// where the runtime is not CUDA, the library is missing, a step is being recorded as a CUDA
/// graph, or the operands' layout or dtypes are not ones it takes.
pub(crate) fn matmul<R: burn_cubecl::CubeRuntime>(
    lhs: &CubeTensor<R>,
    rhs: &CubeTensor<R>,
    out: &CubeTensor<R>,
) -> Result<(), GemmError> {
    let shape = lhs.meta.shape();
    let rank = shape.len();
    let (m, k, n) = (shape[rank - 2], shape[rank - 1], rhs.meta.shape()[rank - 1]);
    let fail = |reason: &str| refuse(m, n, k, lhs.dtype, reason);
    let (Some(lhs), Some(rhs), Some(out)) = (
        (lhs as &dyn std::any::Any).downcast_ref::<CubeTensor<CudaRuntime>>(),
        (rhs as &dyn std::any::Any).downcast_ref::<CubeTensor<CudaRuntime>>(),
        (out as &dyn std::any::Any).downcast_ref::<CubeTensor<CudaRuntime>>(),
    ) else {
        return Err(fail("cuBLASLt runs on CUDA only"));
    };
    if crate::graph::recording() {
        return Err(fail("not inside a recorded CUDA graph"));
    }
    if !available() {
        return Err(fail("libcublasLt could not be loaded"));
    }
    product(lhs, rhs, out).map_err(|reason| refuse(m, n, k, lhs.dtype, reason))
}

/// [`matmul`] on CUDA tensors.
fn product(
    lhs: &CubeTensor<CudaRuntime>,
    rhs: &CubeTensor<CudaRuntime>,
    out: &CubeTensor<CudaRuntime>,
) -> Result<(), String> {
    let Some(layouts) = Layouts::of(lhs, rhs, out)? else {
        return Ok(());
    };
    let (Some(input), Some(output)) = (cuda_type(lhs.dtype), cuda_type(out.dtype)) else {
        return Err(format!("dtypes {:?} -> {:?}", lhs.dtype, out.dtype));
    };
    let client = &lhs.client;
    let ordinal = lhs.device.index;
    let sms = client.properties().hardware.num_streaming_multiprocessors.unwrap_or(0);
    // The lane of the calling thread (one per CubeCL stream), chosen before the task moves to
    // CubeCL's device thread.
    let key = (ordinal, std::thread::current().id());
    // Read here too: the tuning's scope belongs to the calling thread.
    let ordering = crate::tuning::current(|t| t.blas_ordering);
    // On CubeCL's device thread, in order with the launches queued before it: everything they
    // launch has been submitted to CUDA when this runs, and the pointer lookups and CubeCL's
    // ordering kernels run inline, so the calling thread waits once per product (four round
    // trips to the device thread each cost prompts on small models: `docs/runs/gpu/2026-11-27-order.md`).
    let task = || -> Result<(), String> {
        let pointer = |t: &CubeTensor<CudaRuntime>| -> Result<u64, String> {
            client.get_resource(t.handle.clone()).map(|r| r.resource().ptr).map_err(|e| format!("get_resource: {e:?}"))
        };
        let (lhs_ptr, rhs_ptr, out_ptr) = (pointer(lhs)?, pointer(rhs)?, pointer(out)?);
        let problem = layouts.problem([lhs_ptr, rhs_ptr, out_ptr]);
        let mut lanes = lanes().lock().unwrap_or_else(|e| e.into_inner());
        let lane = match lanes.entry(key) {
            std::collections::hash_map::Entry::Occupied(lane) => lane.into_mut(),
            std::collections::hash_map::Entry::Vacant(slot) => slot.insert(Lane::new(ordinal, sms)?),
        };
        lane.run(client, &problem, [input, output], [rhs_ptr, lhs_ptr, out_ptr], ordering)
    };
    client.exclusive(task).map_err(|e| format!("CubeCL's device thread: {e:?}"))?
}

/// A failed cuBLASLt or driver call as our error text, naming the call.
fn call<E: std::fmt::Debug>(what: &'static str) -> impl Fn(E) -> String {
    move |e| format!("{what}: {e:?}")
}

/// The descriptors of one product, destroyed on drop.
struct Descriptors {
    desc: lts::cublasLtMatmulDesc_t,
    layouts: [lts::cublasLtMatrixLayout_t; 3],
}

impl Drop for Descriptors {
    fn drop(&mut self) {
        // SAFETY: created by `Descriptors::new` and used only by the call that made them.
        unsafe {
            for layout in self.layouts {
                if !layout.is_null() {
                    let _ = lt::destroy_matrix_layout(layout);
                }
            }
            if !self.desc.is_null() {
                let _ = lt::destroy_matmul_desc(self.desc);
            }
        }
    }
}

impl Descriptors {
    /// `sm_target`: the SMs cuBLASLt's heuristic and persistent kernels plan for.
    fn new(problem: &Problem, [input, output]: [lts::cudaDataType; 2], sm_target: i32) -> Result<Self, String> {
        let mut this = Self { desc: std::ptr::null_mut(), layouts: [std::ptr::null_mut(); 3] };
        this.desc = lt::create_matmul_desc(lts::cublasComputeType_t::CUBLAS_COMPUTE_32F, lts::cudaDataType::CUDA_R_32F)
            .map_err(call("cublasLtMatmulDescCreate"))?;
        use lts::cublasLtMatmulDescAttributes_t::*;
        for (attr, value) in [
            // `cublasOperation_t`: 0 is N, 1 is T (an i32).
            (CUBLASLT_MATMUL_DESC_TRANSA, i32::from(problem.a.transposed)),
            (CUBLASLT_MATMUL_DESC_TRANSB, i32::from(problem.b.transposed)),
            (CUBLASLT_MATMUL_DESC_SM_COUNT_TARGET, sm_target),
        ] {
            // SAFETY: the attribute's value is an i32 read for its size.
            unsafe {
                lt::set_matmul_desc_attribute(
                    this.desc,
                    attr,
                    &value as *const _ as *const c_void,
                    std::mem::size_of_val(&value),
                )
            }
            .map_err(call("cublasLtMatmulDescSetAttribute"))?;
        }
        for (i, (operand, dtype)) in
            [(problem.a, input), (problem.b, input), (problem.d, output)].into_iter().enumerate()
        {
            // D is stored as is (row-major out = column-major out^T); A and B as stored.
            let layout = lt::create_matrix_layout(dtype, operand.rows, operand.cols, operand.ld)
                .map_err(call("cublasLtMatrixLayoutCreate"))?;
            this.layouts[i] = layout;
            if problem.batch > 1 {
                let count = problem.batch;
                let stride = operand.batch_stride;
                // SAFETY: the values are an i32 and an i64, as these attributes take.
                unsafe {
                    lt::set_matrix_layout_attribute(
                        layout,
                        lts::cublasLtMatrixLayoutAttribute_t::CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT,
                        &count as *const i32 as *const c_void,
                        4,
                    )
                    .map_err(call("cublasLtMatrixLayoutSetAttribute"))?;
                    lt::set_matrix_layout_attribute(
                        layout,
                        lts::cublasLtMatrixLayoutAttribute_t::CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET,
                        &stride as *const i64 as *const c_void,
                        8,
                    )
                    .map_err(call("cublasLtMatrixLayoutSetAttribute"))?;
                }
            }
        }
        Ok(this)
    }
}

impl Lane {
    /// Made on CubeCL's device thread, as every later run of the lane is: the context made
    /// current here stays current for them.
    fn new(ordinal: usize, sms: u32) -> Result<Self, String> {
        crate::graph::make_current(ordinal).map_err(|e| e.to_string())?;
        let sm_target = i32::try_from(sms.saturating_sub(2).max(1)).unwrap_or(i32::MAX);
        let handle = lt::create_handle().map_err(call("cublasLtCreate"))?;
        // SAFETY: plain driver calls in the current (primary) context; the stream and workspace
        // live as long as the process (lanes are never dropped).
        let (stream, workspace) = unsafe {
            let stream = drv::stream::create(drv::stream::StreamKind::NonBlocking).map_err(call("cuStreamCreate"))?;
            let workspace = drv::malloc_sync(WORKSPACE_BYTES).map_err(call("cuMemAlloc"))?;
            (stream, workspace)
        };
        Ok(Self { ordinal, handle, stream, workspace, algos: HashMap::new(), sm_target, flags: None, host_only: false })
    }

    /// cuBLASLt's first heuristic choice for `problem` (cached).
    fn algo(&mut self, problem: &Problem, descriptors: &Descriptors) -> Result<lts::cublasLtMatmulAlgo_t, String> {
        if let Some(algo) = self.algos.get(problem) {
            return Ok(*algo);
        }
        let pref = lt::create_matmul_pref().map_err(call("cublasLtMatmulPreferenceCreate"))?;
        let result = (|| {
            let workspace = WORKSPACE_BYTES as u64;
            use lts::cublasLtMatmulPreferenceAttributes_t::*;
            // SAFETY: each value is read for its size, as the attribute takes it.
            unsafe {
                lt::set_matmul_pref_attribute(
                    pref,
                    CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                    &workspace as *const u64 as *const c_void,
                    8,
                )
                .map_err(call("cublasLtMatmulPreferenceSetAttribute"))?;
                for (attr, align) in [
                    (CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, problem.a.align),
                    (CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, problem.b.align),
                    (CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, problem.d.align),
                    (CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, problem.d.align),
                ] {
                    lt::set_matmul_pref_attribute(pref, attr, &align as *const u32 as *const c_void, 4)
                        .map_err(call("cublasLtMatmulPreferenceSetAttribute"))?;
                }
                let [a, b, d] = descriptors.layouts;
                lt::get_matmul_algo_heuristic(self.handle, descriptors.desc, a, b, d, d, pref)
                    .map_err(call("cublasLtMatmulAlgoGetHeuristic"))
            }
        })();
        // SAFETY: created above, not used after this.
        unsafe {
            let _ = lt::destroy_matmul_pref(pref);
        }
        let algo = result?.algo;
        self.algos.insert(*problem, algo);
        Ok(algo)
    }

    fn run(
        &mut self,
        client: &ComputeClient<CudaRuntime>,
        problem: &Problem,
        types: [lts::cudaDataType; 2],
        pointers: [u64; 3],
        ordering: Ordering,
    ) -> Result<(), String> {
        let descriptors = Descriptors::new(problem, types, self.sm_target)?;
        // A problem's first run is ordered by host waits: it loads cuBLASLt's kernel for it, which
        // must not happen while a poll runs (see [`order`]).
        let first = !self.algos.contains_key(problem);
        let algo = self.algo(problem, &descriptors)?;
        if first || self.host_only || ordering == Ordering::Host {
            // CubeCL's work so far (the inputs, earlier users of the output's memory) first.
            cubecl::future::block_on(client.sync()).map_err(|e| format!("sync: {e:?}"))?;
            let product = self.launch(&descriptors, &algo, pointers);
            // SAFETY: this lane's stream.
            let synced = unsafe { drv::stream::synchronize(self.stream) }.map_err(call("cuStreamSynchronize"));
            return product.and(synced);
        }
        let flags = match self.flags.as_mut() {
            Some(flags) => flags,
            None => self.flags.insert(order::Flags::new(client, self.ordinal)?),
        };
        let n = flags.before(client, self.stream)?;
        let product = self.launch(&descriptors, &algo, pointers);
        let flags = self.flags.as_mut().ok_or("the ordering flags went missing")?;
        let after = flags.after(client, self.stream, n);
        if flags.sequence() % order::CHECK_EVERY == 0 {
            if let Err(e) = flags.check() {
                self.host_only = true;
                self.flags = None;
                return Err(e);
            }
        }
        product.and(after)
    }

    /// Queues the product on this lane's stream.
    fn launch(
        &self,
        descriptors: &Descriptors,
        algo: &lts::cublasLtMatmulAlgo_t,
        [a, b, d]: [u64; 3],
    ) -> Result<(), String> {
        let (alpha, beta) = (1.0f32, 0.0f32);
        let [la, lb, ld] = descriptors.layouts;
        // SAFETY: the pointers are live CubeCL buffers of the sizes the layouts describe (the
        // caller holds the tensors until CubeCL's later work is ordered after the product); the
        // stream, handle and workspace are this lane's.
        unsafe {
            lt::matmul(
                self.handle,
                descriptors.desc,
                &alpha as *const f32 as *const c_void,
                &beta as *const f32 as *const c_void,
                a as *const c_void,
                la,
                b as *const c_void,
                lb,
                d as *const c_void,
                ld,
                d as *mut c_void,
                ld,
                algo,
                self.workspace as *mut c_void,
                WORKSPACE_BYTES,
                self.stream as lts::cudaStream_t,
            )
        }
        .map_err(call("cublasLtMatmul"))
    }
}

/// Device-side ordering's checks (run by the CUDA kernel tests; the marks are read by
/// [`order::Flags::check`]).
#[cfg(test)]
pub(crate) fn check_marks() -> Result<(), String> {
    let lanes = lanes().lock().unwrap_or_else(|e| e.into_inner());
    for lane in lanes.values() {
        // Lanes run on CubeCL's device thread; this test thread needs the context too.
        crate::graph::make_current(lane.ordinal).map_err(|e| e.to_string())?;
        if let Some(flags) = &lane.flags {
            flags.check()?;
        }
        if lane.host_only {
            return Err("a lane fell back to host ordering".into());
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::super::{kernel, GemmKernel};
    use crate::cube::{float_strided, tensor, Cb};
    use crate::gpu_test::{assert_close, seed};
    use burn::tensor::{DType, Distribution, Tensor, TensorData};
    use cubecl::cuda::CudaRuntime;

    type B = Cb<CudaRuntime, f32, i32, u8>;

    fn host<const D: usize>(t: Tensor<B, D>) -> Vec<f32> {
        t.cast(DType::F32).into_data().to_vec::<f32>().expect("f32")
    }

    /// cuBLASLt against f64 products on the host of the same (rounded) inputs: odd sizes, the
    /// weight's transposed view and row-major right operands, batches as the blocked attention
    /// launches them, a slice at an offset (alignment below 16 bytes), bf16 and f16 in, the
    /// input dtype or f32 out.
    #[test]
    fn cublaslt_matches_host_product() {
        assert!(super::available(), "libcublasLt did not load: put its folder on LD_LIBRARY_PATH");
        let device = Default::default();
        seed::<B>(&device, "cublaslt");
        // (batch, m, k, n, rhs as a transposed [n, k] view, f32 out, first row of lhs skipped)
        let cases = [
            (1, 37, 333, 1001, true, false, false),
            (1, 257, 1152, 1536, true, false, false),
            (1, 513, 640, 1536, true, false, true),
            (3, 130, 72, 200, false, true, false),
            (2, 5, 64, 513, true, true, false),
            (4, 96, 256, 77, false, false, true),
            (1, 1, 256, 17, false, false, false),
        ];
        for (batch, m, k, n, transposed, f32_out, offset) in cases {
            for dtype in [DType::BF16, DType::F16] {
                let normal = Distribution::Normal(0.0, 1.0);
                let first = usize::from(offset);
                let lhs = Tensor::<B, 3>::random([batch, m + first, k], normal, &device).cast(dtype);
                let lhs = lhs.slice(burn::tensor::s![.., first.., ..]);
                let small = Distribution::Normal(0.0, 0.05);
                let rhs = match transposed {
                    true => Tensor::<B, 3>::random([batch, n, k], small, &device).cast(dtype).swap_dims(1, 2),
                    false => Tensor::<B, 3>::random([batch, k, n], small, &device).cast(dtype),
                };
                let out_dtype = if f32_out { DType::F32 } else { dtype };
                // The first run of a problem is ordered by host waits, the second on the device.
                let [first_run, got] = [0, 1].map(|_| {
                    let got = kernel::matmul(
                        float_strided(lhs.clone()),
                        float_strided(rhs.clone()),
                        out_dtype,
                        GemmKernel::CublasLt,
                    )
                    .expect("cuBLASLt takes the product");
                    tensor::<CudaRuntime, f32, i32, u8, 3>(got)
                });
                assert_eq!(got.dtype(), out_dtype);
                let (a, b) = (host(lhs), host(rhs));
                let expected: Vec<f32> = (0..batch)
                    .flat_map(|p| {
                        let (a, b) = (&a, &b);
                        (0..m * n).map(move |i| {
                            let (r, c) = (i / n, i % n);
                            (0..k).map(|j| a[(p * m + r) * k + j] as f64 * b[(p * k + j) * n + c] as f64).sum::<f64>()
                                as f32
                        })
                    })
                    .collect();
                let expected = Tensor::<B, 3>::from_data(TensorData::new(expected, [batch, m, n]), &device);
                // f32 out: the f32 accumulation alone; else one rounding to the output dtype.
                let tol = if f32_out { 1e-4 } else { crate::gpu_test::tolerance(dtype) };
                let what = format!(
                    "cublaslt b{batch} {m}x{k}x{n} {dtype:?} -> {out_dtype:?} transposed {transposed} offset {offset}"
                );
                assert_close(first_run, expected.clone(), tol, &format!("{what} (first run)"));
                assert_close(got, expected, tol, &what);
            }
        }
        super::check_marks().expect("no ordering poll gave up");
    }

    /// Device-side ordering under memory reuse: each step's product reads operands CubeCL has
    /// just written, a CubeCL kernel reads the product at once, and the product's buffer is
    /// dropped so that the next step's CubeCL kernels reuse its memory. Any step run out of order
    /// reads or leaves stale values; each step is checked against an f64 host product of its
    /// inputs as read back.
    #[test]
    fn cublaslt_device_order_keeps_dependencies() {
        assert!(super::available(), "libcublasLt did not load: put its folder on LD_LIBRARY_PATH");
        assert_eq!(
            crate::tuning::current(|t| t.blas_ordering),
            super::Ordering::Device,
            "device ordering is the default"
        );
        let device = Default::default();
        seed::<B>(&device, "cublaslt-order");
        let (m, k, n, steps) = (77, 320, 448, 40);
        let dtype = DType::BF16;
        let w = Tensor::<B, 2>::random([n, k], Distribution::Normal(0.0, 0.05), &device).cast(dtype);
        let mut kept = Vec::new();
        for step in 0..steps {
            let x = Tensor::<B, 2>::random([m, k], Distribution::Normal(0.0, 1.0), &device).cast(dtype);
            let y = kernel::matmul(
                float_strided(x.clone()),
                float_strided(w.clone().transpose()),
                DType::F32,
                GemmKernel::CublasLt,
            )
            .expect("cuBLASLt takes the product");
            let y = tensor::<CudaRuntime, f32, i32, u8, 2>(y);
            // Read at once by CubeCL; `y` is dropped here and its memory reused next step.
            let z = y * 2.0 + (step as f64);
            kept.push((x, z));
        }
        let wt = host(w);
        for (step, (x, z)) in kept.into_iter().enumerate() {
            let a = host(x);
            let expected: Vec<f32> = (0..m * n)
                .map(|i| {
                    let (r, c) = (i / n, i % n);
                    let dot = (0..k).map(|j| a[r * k + j] as f64 * wt[c * k + j] as f64).sum::<f64>();
                    (2.0 * dot + step as f64) as f32
                })
                .collect();
            let expected = Tensor::<B, 2>::from_data(TensorData::new(expected, [m, n]), &device);
            // f32 accumulation of k = 320 bf16 products (exact in f32), doubled: 1e-4 relative.
            assert_close(z, expected, 1e-4, &format!("device-ordered step {step}"));
        }
        super::check_marks().expect("no ordering poll gave up");
    }
}
