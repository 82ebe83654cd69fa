//! The prefill products through AMD's hipBLASLt on ROCm: the counterpart of [`super::cublas`],
//! a candidate of the shape tuner ([`super::tune`]) when named (`GemmKernel::HipBlasLt`,
//! `bench --gemm-candidates default,hipblaslt`).
//!
//! **Untested**: this compiles with the `rocm` feature but has never run (no ROCm device or
//! library on the machines this project is built and measured on). It is therefore not among
//! the default candidates; the tuner still checks every candidate's first result against
//! CubeCL's per-unit kernel before timing it, so a wrong product here is never chosen.
//!
//! Why a vendor library: as on CUDA (see [`super::cublas`]), CubeCL 0.10's matmul kernels leave
//! most of the matrix units' rate unused on large products, and hipBLASLt carries AMD's tuned
//! kernels for them.
//!
//! # Ordering with CubeCL's stream
//!
//! CubeCL 0.10 does not expose its HIP stream, so each product is ordered by host waits, from
//! CubeCL's device thread (`ComputeClient::exclusive`): CubeCL's queued work is synchronized,
//! the product runs on a stream of ours, and that stream is synchronized before CubeCL's device
//! thread goes on. This is the ordering that made whole prompts slower on small models on CUDA
//! (each wait drains the launch queue; `docs/runs/gpu/2026-11-27-prefill.md`); the device-side
//! flags of [`super::cublas::order`] are CUDA C and not ported.
//!
//! The library is opened at run time (`libloading`); nothing links against it.

use super::blas_layout::{Layouts, Problem};
use super::{GemmError, GemmKernel};
use burn::tensor::DType;
use burn_cubecl::tensor::CubeTensor;
use cubecl::hip::HipRuntime;
use cubecl_hip_sys as hip;
use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Mutex, OnceLock};

/// Workspace for hipBLASLt's kernels (split-k partials).
const WORKSPACE_BYTES: usize = 32 << 20;

/// hipBLASLt's enumerations, as its headers (`hipblaslt.h`, `hipblas-common.h`) and HIP's
/// `hipDataType` number them.
mod abi {
    pub const SUCCESS: i32 = 0;
    pub const COMPUTE_32F: i32 = 2;
    pub const R_32F: i32 = 0;
    pub const R_16F: i32 = 2;
    pub const R_16BF: i32 = 14;
    pub const OP_N: i32 = 111;
    pub const OP_T: i32 = 112;
    pub const DESC_TRANSA: i32 = 0;
    pub const DESC_TRANSB: i32 = 1;
    pub const LAYOUT_BATCH_COUNT: i32 = 0;
    pub const LAYOUT_STRIDED_BATCH_OFFSET: i32 = 1;
    pub const PREF_MAX_WORKSPACE_BYTES: i32 = 1;

    /// `hipblasLtMatmulAlgo_t`.
    #[repr(C)]
    #[derive(Debug, Clone, Copy, Default)]
    pub struct Algo {
        pub data: [u8; 16],
        pub max_workspace_bytes: usize,
    }

    /// `hipblasLtMatmulHeuristicResult_t`.
    #[repr(C)]
    #[derive(Debug, Clone, Copy, Default)]
    pub struct Heuristic {
        pub algo: Algo,
        pub workspace_size: usize,
        pub state: i32,
        pub waves_count: f32,
        pub reserved: [i32; 4],
    }
}

type Ptr = *mut c_void;

/// The library's entry points used here.
struct Api {
    create: unsafe extern "C" fn(*mut Ptr) -> i32,
    desc_create: unsafe extern "C" fn(*mut Ptr, i32, i32) -> i32,
    desc_set: unsafe extern "C" fn(Ptr, i32, *const c_void, usize) -> i32,
    desc_destroy: unsafe extern "C" fn(Ptr) -> i32,
    layout_create: unsafe extern "C" fn(*mut Ptr, i32, u64, u64, i64) -> i32,
    layout_set: unsafe extern "C" fn(Ptr, i32, *const c_void, usize) -> i32,
    layout_destroy: unsafe extern "C" fn(Ptr) -> i32,
    pref_create: unsafe extern "C" fn(*mut Ptr) -> i32,
    pref_set: unsafe extern "C" fn(Ptr, i32, *const c_void, usize) -> i32,
    pref_destroy: unsafe extern "C" fn(Ptr) -> i32,
    #[allow(clippy::type_complexity)]
    heuristic: unsafe extern "C" fn(Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, i32, *mut abi::Heuristic, *mut i32) -> i32,
    #[allow(clippy::type_complexity)]
    matmul: unsafe extern "C" fn(
        Ptr,
        Ptr,
        *const c_void,
        *const c_void,
        Ptr,
        *const c_void,
        Ptr,
        *const c_void,
        *const c_void,
        Ptr,
        Ptr,
        Ptr,
        *const abi::Algo,
        Ptr,
        usize,
        hip::hipStream_t,
    ) -> i32,
    /// Keeps the symbols above valid.
    _library: libloading::Library,
}

impl Api {
    fn open() -> Result<Self, String> {
        let names = ["libhipblaslt.so", "libhipblaslt.so.1", "libhipblaslt.so.0"];
        // SAFETY: opening a shared library runs its initializers; hipBLASLt's only set up its
        // own state.
        let library = names
            .iter()
            .find_map(|name| unsafe { libloading::Library::new(name) }.ok())
            .ok_or_else(|| format!("none of {names:?} could be loaded"))?;
        /// One symbol as a plain function pointer (valid while `library` lives, which `Api` keeps).
        unsafe fn symbol<T: Copy>(library: &libloading::Library, name: &[u8]) -> Result<T, String> {
            // SAFETY: the caller names the symbol with the signature its header declares.
            unsafe { library.get::<T>(name) }.map(|s| *s).map_err(|e| format!("{e}"))
        }
        // SAFETY: each symbol's type is its declaration in `hipblaslt.h`.
        unsafe {
            Ok(Self {
                create: symbol(&library, b"hipblasLtCreate\0")?,
                desc_create: symbol(&library, b"hipblasLtMatmulDescCreate\0")?,
                desc_set: symbol(&library, b"hipblasLtMatmulDescSetAttribute\0")?,
                desc_destroy: symbol(&library, b"hipblasLtMatmulDescDestroy\0")?,
                layout_create: symbol(&library, b"hipblasLtMatrixLayoutCreate\0")?,
                layout_set: symbol(&library, b"hipblasLtMatrixLayoutSetAttribute\0")?,
                layout_destroy: symbol(&library, b"hipblasLtMatrixLayoutDestroy\0")?,
                pref_create: symbol(&library, b"hipblasLtMatmulPreferenceCreate\0")?,
                pref_set: symbol(&library, b"hipblasLtMatmulPreferenceSetAttribute\0")?,
                pref_destroy: symbol(&library, b"hipblasLtMatmulPreferenceDestroy\0")?,
                heuristic: symbol(&library, b"hipblasLtMatmulAlgoGetHeuristic\0")?,
                matmul: symbol(&library, b"hipblasLtMatmul\0")?,
                _library: library,
            })
        }
    }
}

/// The library, opened once (`Err` says why it could not be).
fn api() -> Result<&'static Api, String> {
    static API: OnceLock<Result<Api, String>> = OnceLock::new();
    API.get_or_init(Api::open).as_ref().map_err(|e| format!("libhipblaslt: {e}"))
}

/// Whether `libhipblaslt` can be loaded on this machine (checked once).
pub fn available() -> bool {
    api().is_ok()
}

/// A hipBLASLt status as our error text, naming the call.
fn check(what: &str, status: i32) -> Result<(), String> {
    match status {
        abi::SUCCESS => Ok(()),
        s => Err(format!("{what}: hipblasStatus {s}")),
    }
}

fn hip_check(what: &str, status: hip::hipError_t) -> Result<(), String> {
    match status {
        hip::hipError_t_hipSuccess => Ok(()),
        s => Err(format!("{what}: hipError {s}")),
    }
}

fn data_type(dtype: DType) -> Option<i32> {
    match dtype {
        DType::BF16 => Some(abi::R_16BF),
        DType::F16 => Some(abi::R_16F),
        DType::F32 => Some(abi::R_32F),
        _ => None,
    }
}

/// The hipBLASLt state of one device: used only on CubeCL's device thread ([`matmul`]).
struct Lane {
    handle: Ptr,
    stream: hip::hipStream_t,
    workspace: Ptr,
    algos: HashMap<Problem, abi::Algo>,
}

// SAFETY: a lane's raw handles are used only on CubeCL's device thread, under the registry's lock.
unsafe impl Send for Lane {}

fn lanes() -> &'static Mutex<HashMap<usize, Lane>> {
    static LANES: OnceLock<Mutex<HashMap<usize, Lane>>> = OnceLock::new();
    LANES.get_or_init(Default::default)
}

/// `lhs [.., m, k] @ rhs [.., k, n] -> out [.., m, n]` through hipBLASLt, or `Err` where the
/// runtime is not HIP, the library is missing, or the operands' layout or dtypes are not ones it
/// takes.
pub(crate) fn matmul<R: burn_cubecl::CubeRuntime>(
    lhs: &CubeTensor<R>,
    rhs: &CubeTensor<R>,
    out: &CubeTensor<R>,
) -> Result<(), GemmError> {
    let shape = lhs.meta.shape();
    let rank = shape.len();
    let (m, k, n) = (shape[rank - 2], shape[rank - 1], rhs.meta.shape()[rank - 1]);
    let refuse = |reason: String| GemmError { kernel: GemmKernel::HipBlasLt, m, n, k, dtype: lhs.dtype, reason };
    let (Some(lhs), Some(rhs), Some(out)) = (
        (lhs as &dyn std::any::Any).downcast_ref::<CubeTensor<HipRuntime>>(),
        (rhs as &dyn std::any::Any).downcast_ref::<CubeTensor<HipRuntime>>(),
        (out as &dyn std::any::Any).downcast_ref::<CubeTensor<HipRuntime>>(),
    ) else {
        return Err(refuse("hipBLASLt runs on ROCm only".into()));
    };
    let api = api().map_err(refuse)?;
    product(api, lhs, rhs, out).map_err(refuse)
}

fn product(
    api: &'static Api,
    lhs: &CubeTensor<HipRuntime>,
    rhs: &CubeTensor<HipRuntime>,
    out: &CubeTensor<HipRuntime>,
) -> Result<(), String> {
    let Some(layouts) = Layouts::of(lhs, rhs, out)? else {
        return Ok(());
    };
    let (Some(input), Some(output)) = (data_type(lhs.dtype), data_type(out.dtype)) else {
        return Err(format!("dtypes {:?} -> {:?}", lhs.dtype, out.dtype));
    };
    let client = &lhs.client;
    let ordinal = lhs.device.index;
    let task = || -> Result<(), String> {
        let pointer = |t: &CubeTensor<HipRuntime>| -> Result<u64, String> {
            client
                .get_resource(t.handle.clone())
                .map(|r| r.resource().ptr as u64)
                .map_err(|e| format!("get_resource: {e:?}"))
        };
        let (lhs_ptr, rhs_ptr, out_ptr) = (pointer(lhs)?, pointer(rhs)?, pointer(out)?);
        let problem = layouts.problem([lhs_ptr, rhs_ptr, out_ptr]);
        let mut lanes = lanes().lock().unwrap_or_else(|e| e.into_inner());
        let lane = match lanes.entry(ordinal) {
            std::collections::hash_map::Entry::Occupied(lane) => lane.into_mut(),
            std::collections::hash_map::Entry::Vacant(slot) => slot.insert(Lane::new(api)?),
        };
        let descriptors = Descriptors::new(api, &problem, [input, output])?;
        let algo = lane.algo(api, &problem, &descriptors)?;
        // CubeCL's work so far (the inputs, earlier users of the output's memory) first.
        cubecl::future::block_on(client.sync()).map_err(|e| format!("sync: {e:?}"))?;
        let launched = lane.launch(api, &descriptors, &algo, [rhs_ptr, lhs_ptr, out_ptr]);
        // SAFETY: this lane's stream.
        let synced = hip_check("hipStreamSynchronize", unsafe { hip::hipStreamSynchronize(lane.stream) });
        launched.and(synced)
    };
    client.exclusive(task).map_err(|e| format!("CubeCL's device thread: {e:?}"))?
}

/// The descriptors of one product, destroyed on drop.
struct Descriptors {
    api: &'static Api,
    desc: Ptr,
    layouts: [Ptr; 3],
}

impl Drop for Descriptors {
    fn drop(&mut self) {
        // SAFETY: created by `Descriptors::new` and used only by the call that made them.
        unsafe {
            for layout in self.layouts {
                if !layout.is_null() {
                    let _ = (self.api.layout_destroy)(layout);
                }
            }
            if !self.desc.is_null() {
                let _ = (self.api.desc_destroy)(self.desc);
            }
        }
    }
}

impl Descriptors {
    fn new(api: &'static Api, problem: &Problem, [input, output]: [i32; 2]) -> Result<Self, String> {
        let mut this = Self { api, desc: std::ptr::null_mut(), layouts: [std::ptr::null_mut(); 3] };
        // SAFETY: each call writes the handle it is given; attribute values are read for their
        // size, as hipblaslt.h declares them (i32 operations, i32 batch count, i64 stride).
        unsafe {
            check("hipblasLtMatmulDescCreate", (api.desc_create)(&mut this.desc, abi::COMPUTE_32F, abi::R_32F))?;
            for (attr, transposed) in
                [(abi::DESC_TRANSA, problem.a.transposed), (abi::DESC_TRANSB, problem.b.transposed)]
            {
                let op = if transposed { abi::OP_T } else { abi::OP_N };
                check(
                    "hipblasLtMatmulDescSetAttribute",
                    (api.desc_set)(this.desc, attr, &op as *const i32 as *const c_void, 4),
                )?;
            }
            for (i, (operand, dtype)) in
                [(problem.a, input), (problem.b, input), (problem.d, output)].into_iter().enumerate()
            {
                check(
                    "hipblasLtMatrixLayoutCreate",
                    (api.layout_create)(&mut this.layouts[i], dtype, operand.rows, operand.cols, operand.ld),
                )?;
                if problem.batch > 1 {
                    let (count, stride) = (problem.batch, operand.batch_stride);
                    check(
                        "hipblasLtMatrixLayoutSetAttribute",
                        (api.layout_set)(
                            this.layouts[i],
                            abi::LAYOUT_BATCH_COUNT,
                            &count as *const i32 as *const c_void,
                            4,
                        ),
                    )?;
                    check(
                        "hipblasLtMatrixLayoutSetAttribute",
                        (api.layout_set)(
                            this.layouts[i],
                            abi::LAYOUT_STRIDED_BATCH_OFFSET,
                            &stride as *const i64 as *const c_void,
                            8,
                        ),
                    )?;
                }
            }
        }
        Ok(this)
    }
}

impl Lane {
    /// Made on CubeCL's device thread (its HIP device current), as every later run is.
    fn new(api: &'static Api) -> Result<Self, String> {
        let mut this = Self {
            handle: std::ptr::null_mut(),
            stream: std::ptr::null_mut(),
            workspace: std::ptr::null_mut(),
            algos: HashMap::new(),
        };
        // SAFETY: each call writes the handle it is given; the stream and workspace live as long
        // as the process (lanes are never dropped).
        unsafe {
            check("hipblasLtCreate", (api.create)(&mut this.handle))?;
            hip_check("hipStreamCreate", hip::hipStreamCreate(&mut this.stream))?;
            hip_check("hipMalloc", hip::hipMalloc(&mut this.workspace, WORKSPACE_BYTES))?;
        }
        Ok(this)
    }

    /// hipBLASLt's first heuristic choice for `problem` (cached).
    fn algo(&mut self, api: &'static Api, problem: &Problem, descriptors: &Descriptors) -> Result<abi::Algo, String> {
        if let Some(algo) = self.algos.get(problem) {
            return Ok(*algo);
        }
        let mut pref: Ptr = std::ptr::null_mut();
        // SAFETY: the preference is made, used and destroyed here; the result array holds the
        // one algorithm requested.
        let found = unsafe {
            check("hipblasLtMatmulPreferenceCreate", (api.pref_create)(&mut pref))?;
            let workspace = WORKSPACE_BYTES as u64;
            let mut result = [abi::Heuristic::default(); 1];
            let mut count = 0i32;
            let [a, b, d] = descriptors.layouts;
            let found = check(
                "hipblasLtMatmulPreferenceSetAttribute",
                (api.pref_set)(pref, abi::PREF_MAX_WORKSPACE_BYTES, &workspace as *const u64 as *const c_void, 8),
            )
            .and_then(|()| {
                check(
                    "hipblasLtMatmulAlgoGetHeuristic",
                    (api.heuristic)(
                        self.handle,
                        descriptors.desc,
                        a,
                        b,
                        d,
                        d,
                        pref,
                        1,
                        result.as_mut_ptr(),
                        &mut count,
                    ),
                )
            })
            .and_then(|()| match count {
                1.. if result[0].state == abi::SUCCESS => Ok(result[0].algo),
                _ => Err("hipblasLtMatmulAlgoGetHeuristic: no algorithm for this product".to_string()),
            });
            let _ = (api.pref_destroy)(pref);
            found
        }?;
        self.algos.insert(*problem, found);
        Ok(found)
    }

    /// Queues the product on this lane's stream.
    fn launch(
        &self,
        api: &'static Api,
        descriptors: &Descriptors,
        algo: &abi::Algo,
        [a, b, d]: [u64; 3],
    ) -> Result<(), String> {
        let (alpha, beta) = (1.0f32, 0.0f32);
        let [la, lb, ld] = descriptors.layouts;
        // SAFETY: the pointers are live CubeCL buffers of the sizes the layouts describe (CubeCL's
        // device thread waits in `product` until the product is done); the stream, handle and
        // workspace are this lane's.
        let status = unsafe {
            (api.matmul)(
                self.handle,
                descriptors.desc,
                &alpha as *const f32 as *const c_void,
                a as *const c_void,
                la,
                b as *const c_void,
                lb,
                &beta as *const f32 as *const c_void,
                d as *const c_void,
                ld,
                d as Ptr,
                ld,
                algo,
                self.workspace,
                WORKSPACE_BYTES,
                self.stream,
            )
        };
        check("hipblasLtMatmul", status)
    }
}
