//! Compiling recorded launches (CubeCL's CUDA compiler, then NVRTC), capturing them into one
//! CUDA graph on a stream of our own, and replaying it.

use super::{recorder::Recorded, GraphError};
use burn_cubecl::tensor::CubeTensor;
use cubecl::cuda::{CudaCompiler, CudaDevice, CudaRuntime};
use cubecl::server::{CubeCount, Handle};
use cubecl::Runtime;
use cubecl_cpp::shared::{CompilationOptions, CppSupportedFeatures};
use cudarc::driver::{result, sys};
use std::collections::HashMap;
use std::ffi::{c_void, CStr, CString};
use std::path::PathBuf;

fn driver(call: &'static str) -> impl FnOnce(cudarc::driver::DriverError) -> GraphError {
    move |e| GraphError::Driver { call, reason: format!("{e:?}") }
}

/// The device's context made current on this thread (CubeCL uses the primary context).
pub(crate) fn make_current(ordinal: usize) -> Result<(), GraphError> {
    result::init().map_err(driver("cuInit"))?;
    let device = result::device::get(ordinal as i32).map_err(driver("cuDeviceGet"))?;
    // SAFETY: `device` is a valid device handle; the primary context is retained once per call
    // (released with the process, as CubeCL does).
    unsafe {
        let ctx = result::primary_ctx::retain(device).map_err(driver("cuDevicePrimaryCtxRetain"))?;
        result::ctx::set_current(ctx).map_err(driver("cuCtxSetCurrent"))
    }
}

/// The device's compute capability as `major * 10 + minor`.
pub(crate) fn architecture(ordinal: usize) -> Result<u32, GraphError> {
    use sys::CUdevice_attribute::*;
    let device = result::device::get(ordinal as i32).map_err(driver("cuDeviceGet"))?;
    // SAFETY: read-only attribute queries of a valid device.
    unsafe {
        let major = result::device::get_attribute(device, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)
            .map_err(driver("cuDeviceGetAttribute"))?;
        let minor = result::device::get_attribute(device, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)
            .map_err(driver("cuDeviceGetAttribute"))?;
        Ok((major * 10 + minor) as u32)
    }
}

/// The options CubeCL's CUDA runtime compiles with on a device of `arch` (cubecl-cuda 0.10
/// `runtime.rs`; its own copy is private), so that the graph runs the same code as eager.
pub(super) fn compilation_options(arch: u32) -> CompilationOptions {
    CompilationOptions {
        warp_size: 32,
        supports_features: CppSupportedFeatures {
            fast_math: true,
            grid_constants: arch >= 70,
            fast_tanh: arch >= 75 && sys::CUDA_VERSION >= 12080,
            clusters: arch >= 90,
            elect_sync: arch >= 90,
        },
    }
}

/// A stable 64-bit hash (FNV-1a) of the NVRTC input, naming its PTX in the disk cache.
fn fnv1a(parts: &[&[u8]]) -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    for part in parts {
        for &b in *part {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
        h ^= 0xff;
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h
}

/// Where compiled PTX is kept between runs: `$BURN_GEMMA_PTX_CACHE`, else
/// `$XDG_CACHE_HOME/burn-gemma/ptx`, else `~/.cache/burn-gemma/ptx`.
fn ptx_cache_dir() -> Option<PathBuf> {
    if let Some(dir) = std::env::var_os("BURN_GEMMA_PTX_CACHE") {
        return Some(PathBuf::from(dir));
    }
    let base = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))?;
    Some(base.join("burn-gemma").join("ptx"))
}

/// NVRTC over `source` (as cubecl-cuda's `compile_kernel`), or the cached PTX of an earlier
/// run. Returns the PTX (NUL-terminated) and whether it came from the cache.
pub(crate) fn ptx(source: &str, arch: u32, name: &str) -> Result<(Vec<u8>, bool), GraphError> {
    let arch_option =
        if arch >= 90 { format!("--gpu-architecture=sm_{arch}a") } else { format!("--gpu-architecture=sm_{arch}") };
    let include = format!("--include-path={}", cubecl::cuda::install::include_path().display());
    let cccl_path = cubecl::cuda::install::cccl_include_path();
    let cccl = format!("--include-path={}", cccl_path.display());
    let mut options = vec![arch_option.as_str(), include.as_str(), "-lineinfo"];
    if cccl_path.exists() {
        options.push(cccl.as_str());
    }
    let version = sys::CUDA_VERSION.to_string();
    let mut key: Vec<&[u8]> = vec![source.as_bytes(), version.as_bytes()];
    key.extend(options.iter().map(|o| o.as_bytes()));
    let cached = ptx_cache_dir().map(|dir| dir.join(format!("{:016x}.ptx", fnv1a(&key))));
    if let Some(bytes) = cached.as_ref().and_then(|path| std::fs::read(path).ok()) {
        if bytes.last() == Some(&0) {
            return Ok((bytes, true));
        }
    }
    let compile_error = |reason: String| GraphError::Compile { kernel: name.to_string(), reason };
    let source = CString::new(source).map_err(|e| compile_error(e.to_string()))?;
    // SAFETY: NVRTC calls on a program created here and destroyed before returning.
    let ptx = unsafe {
        let program = cudarc::nvrtc::result::create_program(source.as_c_str(), None)
            .map_err(|e| compile_error(format!("{e:?}")))?;
        if cudarc::nvrtc::result::compile_program(program, &options).is_err() {
            let log = cudarc::nvrtc::result::get_program_log(program).map_err(|e| compile_error(format!("{e:?}")))?;
            let log = CStr::from_ptr(log.as_ptr()).to_string_lossy().into_owned();
            let _ = cudarc::nvrtc::result::destroy_program(program);
            return Err(compile_error(log));
        }
        let ptx = cudarc::nvrtc::result::get_ptx(program).map_err(|e| compile_error(format!("{e:?}")))?;
        let _ = cudarc::nvrtc::result::destroy_program(program);
        ptx
    };
    let mut bytes: Vec<u8> = ptx.iter().map(|&c| c as u8).collect();
    if bytes.last() != Some(&0) {
        bytes.push(0);
    }
    if let Some(path) = cached {
        // Best effort: a cache that cannot be written only costs the next run a compile.
        if let Some(dir) = path.parent() {
            let _ = std::fs::create_dir_all(dir);
        }
        // One name per writer: the shards of a split model compile the same kernels at once.
        static WRITES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let write = WRITES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let tmp = path.with_extension(format!("tmp{}-{write}", std::process::id()));
        if std::fs::write(&tmp, &bytes).is_ok() {
            let _ = std::fs::rename(&tmp, &path);
        }
    }
    Ok((bytes, false))
}

/// The PTX instructions placed at the start of every kernel of a graph on compute capability
/// 9.0+ (programmatic dependent launch): wait until the kernels before have finished and their
/// writes are visible, then let the next kernel's launch begin. The next kernel's blocks are
/// then scheduled while this one runs (once all of this one's blocks have started), so that its
/// launch and block start-up overlap this kernel's tail instead of following its end.
///
/// Waiting first keeps every kernel's reads and writes after its predecessors', as in plain
/// stream order, whatever the kernel does (the wait is the first statement of its body).
const DEPENDENT_LAUNCH_PROLOGUE: &str =
    "\nasm volatile(\"griddepcontrol.wait;\" ::: \"memory\");\nasm volatile(\"griddepcontrol.launch_dependents;\");\n";

/// What a kernel that marks its own wait ([`WAIT_MARKER`]) starts with instead.
const LAUNCH_DEPENDENTS: &str = "\nasm volatile(\"griddepcontrol.launch_dependents;\");\n";

/// The wait that replaces [`WAIT_MARKER`].
const WAIT: &str = "asm volatile(\"griddepcontrol.wait;\" ::: \"memory\");\n";

/// The line cubecl-cpp 0.10 writes for a kernel's `comment!("burn-gemma: wait for the kernels
/// before")`: a kernel whose statements before it read only what no kernel of a step writes (the
/// weights) marks with it where the wait goes, so that those reads (the first step of a GEMV's
/// weight loads) overlap the kernels before it. The `memory` clobber of the wait keeps the
/// compiler from moving reads across it.
const WAIT_MARKER: &str = "// burn-gemma: wait for the kernels before\n";

/// `source` with the dependent-launch instructions in the body of kernel `entry`: at the marked
/// place ([`WAIT_MARKER`], once) when the kernel marks one, else [`DEPENDENT_LAUNCH_PROLOGUE`] as
/// its first statement. `None` where the source does not have the shape cubecl-cpp 0.10 gives it
/// (`entry (` after `__launch_bounds__(..)`, the parameters, then `\n) {`), or marks the wait
/// more than once.
fn with_dependent_launch(source: &str, entry: &str, order: KernelOrder) -> Option<String> {
    let name = format!("{entry} (");
    let signature = source
        .match_indices(&name)
        .map(|(at, _)| at)
        .find(|&at| source[..at].chars().next_back().is_some_and(|c| !(c.is_alphanumeric() || c == '_')))?;
    let body = signature + source[signature..].find("\n) {")? + "\n) ".len();
    let (head, rest) = (&source[..=body], &source[body + 1..]);
    let mut out = String::with_capacity(source.len() + DEPENDENT_LAUNCH_PROLOGUE.len());
    out.push_str(head);
    let marks = match order {
        KernelOrder::OverlappedAtStart => 0,
        _ => rest.match_indices(WAIT_MARKER).count(),
    };
    match marks {
        0 => {
            out.push_str(DEPENDENT_LAUNCH_PROLOGUE);
            out.push_str(rest);
        }
        1 => {
            out.push_str(LAUNCH_DEPENDENTS);
            out.push_str(&rest.replacen(WAIT_MARKER, WAIT, 1));
        }
        _ => return None,
    }
    Some(out)
}

/// How the kernels of a replayed graph follow one another.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum KernelOrder {
    /// Each kernel is launched when its predecessor has finished (stream order).
    Serial,
    /// Programmatic dependent launch (compute capability 9.0+): each kernel after the first is
    /// launched while its predecessor runs and waits for it where it marks the wait
    /// ([`WAIT_MARKER`]), else in its first statement ([`DEPENDENT_LAUNCH_PROLOGUE`]).
    Overlapped,
    /// As `Overlapped`, every kernel waiting in its first statement.
    OverlappedAtStart,
}

impl KernelOrder {
    /// The overlapped orders where the device has programmatic dependent launch and `mode`
    /// asks for one.
    pub(crate) fn for_architecture(arch: u32, mode: super::DependentLaunch) -> Self {
        use super::DependentLaunch;
        match mode {
            DependentLaunch::Auto if arch >= 90 => Self::Overlapped,
            DependentLaunch::AtStart if arch >= 90 => Self::OverlappedAtStart,
            _ => Self::Serial,
        }
    }
}

/// A loaded kernel.
#[derive(Clone, Copy)]
struct Function {
    func: sys::CUfunction,
    block: (u32, u32, u32),
    shared: u32,
}

/// Compiles, loads and configures one recorded task.
fn load(
    launch: &Recorded,
    options: &CompilationOptions,
    arch: u32,
    order: KernelOrder,
) -> Result<(Function, bool), GraphError> {
    let name = launch.task.name().to_string();
    let compile_error = |reason: String| GraphError::Compile { kernel: name.clone(), reason };
    let compiled = launch
        .task
        .compile(&mut CudaCompiler::default(), options, launch.mode, launch.task.address_type())
        .map_err(|e| compile_error(format!("{e:?}")))?;
    let shared = compiled.repr.as_ref().map_or(0, |r| r.shared_memory_size());
    let source = match order {
        KernelOrder::Serial => compiled.source.clone(),
        KernelOrder::Overlapped | KernelOrder::OverlappedAtStart => {
            with_dependent_launch(&compiled.source, &compiled.entrypoint_name, order)
                .ok_or_else(|| compile_error("no kernel body found to place the dependency wait in".into()))?
        }
    };
    let (ptx, cached) = ptx(&source, arch, &name)?;
    let entry = CString::new(compiled.entrypoint_name.clone()).map_err(|e| compile_error(e.to_string()))?;
    // SAFETY: `ptx` is NUL-terminated PTX; the module stays loaded for the process (graphs
    // replay its function).
    let func = unsafe {
        let module = result::module::load_data(ptx.as_ptr() as *const c_void).map_err(driver("cuModuleLoadData"))?;
        let func = result::module::get_function(module, entry).map_err(driver("cuModuleGetFunction"))?;
        result::function::set_function_attribute(
            func,
            sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            shared as i32,
        )
        .map_err(driver("cuFuncSetAttribute"))?;
        func
    };
    let dim = compiled.cube_dim;
    Ok((Function { func, block: (dim.x, dim.y, dim.z), shared: shared as u32 }, cached))
}

/// Launches `node` on `stream` (being captured); `overlapped` marks its dependency on the
/// previous launch as programmatic (see [`KernelOrder::Overlapped`]).
///
/// # Safety
/// `params` holds one pointer per kernel parameter, each to a live value of its type.
unsafe fn launch(
    node: &Node,
    stream: sys::CUstream,
    params: &mut [*mut c_void],
    overlapped: bool,
) -> Result<(), cudarc::driver::DriverError> {
    let f = node.function;
    if !overlapped {
        return result::launch_kernel(f.func, node.grid, f.block, f.shared, stream, params);
    }
    // SAFETY: an all-zero attribute is a valid value of this plain C union and struct.
    let mut attribute: sys::CUlaunchAttribute = unsafe { std::mem::zeroed() };
    attribute.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
    attribute.value.programmaticStreamSerializationAllowed = 1;
    let config = sys::CUlaunchConfig {
        gridDimX: node.grid.0,
        gridDimY: node.grid.1,
        gridDimZ: node.grid.2,
        blockDimX: f.block.0,
        blockDimY: f.block.1,
        blockDimZ: f.block.2,
        sharedMemBytes: f.shared,
        hStream: stream,
        attrs: &mut attribute,
        numAttrs: 1,
    };
    // SAFETY: the function is loaded, `config` and `attribute` outlive the call, and `params`
    // is as the caller guarantees.
    unsafe { sys::cuLaunchKernelEx(&config, f.func, params.as_mut_ptr(), std::ptr::null_mut()).result() }
}

/// The device pointer of `handle` (its offset included).
fn pointer(client: &cubecl::client::ComputeClient<CudaRuntime>, handle: &Handle) -> Result<u64, GraphError> {
    let resource = client
        .get_resource(handle.clone())
        .map_err(|e| GraphError::Driver { call: "get_resource", reason: format!("{e:?}") })?;
    Ok(resource.resource().ptr)
}

/// One tensor's memory, for host copies around a replay.
pub(crate) struct Buffer {
    ptr: u64,
    _handle: Handle,
}

impl Buffer {
    pub(crate) fn new(t: &CubeTensor<CudaRuntime>) -> Result<Self, GraphError> {
        Ok(Self { ptr: pointer(&t.client, &t.handle)?, _handle: t.handle.clone() })
    }
}

/// One launch as the graph replays it.
struct Node {
    function: Function,
    grid: (u32, u32, u32),
    /// One device pointer per buffer, in binding order.
    pointers: Vec<u64>,
    /// CubeCL's packed scalars and lengths (`info_st`, a grid constant).
    info: Vec<u64>,
    has_info: bool,
}

/// Distinct kernels of a graph: compiled by NVRTC, or loaded from the PTX cache.
#[derive(Debug, Clone, Copy, Default)]
pub struct Kernels {
    pub compiled: usize,
    pub cached: usize,
}

/// A captured decode step.
pub(crate) struct Graph {
    ordinal: usize,
    stream: sys::CUstream,
    exec: sys::CUgraphExec,
    /// Events around the graph launch: the GPU time of a replay.
    events: (sys::CUevent, sys::CUevent),
    pub(crate) kernels: Kernels,
    /// The last replay: host time until the wait began, and GPU time of the graph.
    pub(crate) last: super::ReplayTimes,
    /// Every buffer the graph reads or writes, kept alive.
    _handles: Vec<Handle>,
    /// The NCCL groups whose communicators its collectives use, kept alive (dropped after the
    /// graph is destroyed).
    _groups: Vec<std::sync::Arc<crate::collective::NcclGroup>>,
}

/// How long a device that recorded collectives waits for the others before capturing: their
/// recordings compile the same kernels at the same time (NVRTC, tens of seconds on a cold PTX
/// cache).
const MEETING_WAIT: std::time::Duration = std::time::Duration::from_secs(180);

/// A recorded collective as the capture runs it.
struct CollectiveCall {
    op: crate::collective::Op,
    input: u64,
    output: u64,
    count: usize,
    dtype: cudarc::nccl::sys::ncclDataType_t,
    comm: cudarc::nccl::sys::ncclComm_t,
}

impl CollectiveCall {
    /// Issues the collective on `stream` (being captured: NCCL records its kernels).
    ///
    /// # Safety
    /// The pointers belong to live buffers of the recorded tensors (an all-gather's output
    /// allocated for every rank's input), and `comm` is the stream's device's communicator.
    unsafe fn issue(&self, stream: sys::CUstream) -> Result<(), GraphError> {
        use crate::collective::Op;
        use cudarc::nccl::{result as nccl, sys::ncclRedOp_t};
        let stream = stream as cudarc::nccl::sys::cudaStream_t;
        // SAFETY: as the caller guarantees.
        let issued = unsafe {
            match self.op {
                Op::AllReduceSum => nccl::all_reduce(
                    self.input as *const c_void,
                    self.output as *mut c_void,
                    self.count,
                    self.dtype,
                    ncclRedOp_t::ncclSum,
                    self.comm,
                    stream,
                ),
                Op::AllGather => nccl::all_gather(
                    self.input as *const c_void,
                    self.output as *mut c_void,
                    self.count,
                    self.dtype,
                    self.comm,
                    stream,
                ),
            }
        };
        issued
            .map(|_| ())
            .map_err(|e| GraphError::Driver { call: "NCCL collective (capture)", reason: format!("{:?}", e.0) })
    }
}

// SAFETY: the raw CUDA handles are only used through `&mut self` or on drop.
unsafe impl Send for Graph {}

impl Graph {
    pub(crate) fn new(
        launches: Vec<Recorded>,
        collectives: Vec<(usize, crate::collective::Recorded)>,
        device: &CudaDevice,
        dependent: super::DependentLaunch,
    ) -> Result<Self, GraphError> {
        let ordinal = device.index;
        let client = CudaRuntime::client(device);
        let nccl = |e: crate::collective::CollectiveError| GraphError::Driver { call: "NCCL", reason: e.to_string() };
        // Communicators first (made on the first capture, which may switch this thread's device).
        let mut calls: Vec<(usize, CollectiveCall)> = Vec::with_capacity(collectives.len());
        let mut groups = Vec::new();
        let mut handles = Vec::new();
        for (at, c) in collectives {
            let call = CollectiveCall {
                op: c.op,
                input: pointer(&client, &c.input)?,
                output: pointer(&client, &c.output)?,
                count: c.count,
                dtype: c.dtype,
                comm: c.group.comm(c.rank).map_err(nccl)?,
            };
            calls.push((at, call));
            if !groups.iter().any(|g| std::sync::Arc::ptr_eq(g, &c.group)) {
                groups.push(c.group.clone());
            }
            handles.extend([c.input, c.output]);
        }
        // Eager work (prefill, cache writes) happens on CubeCL's streams: finish it first.
        cubecl::future::block_on(client.sync())
            .map_err(|e| GraphError::Driver { call: "sync", reason: format!("{e:?}") })?;
        make_current(ordinal)?;
        let arch = architecture(ordinal)?;
        let options = compilation_options(arch);
        let order = KernelOrder::for_architecture(arch, dependent);
        if !options.supports_features.grid_constants {
            return Err(GraphError::Unsupported(format!("compute capability {arch} has no grid constants")));
        }
        let mut loaded: HashMap<String, Function> = HashMap::new();
        let mut nodes = Vec::with_capacity(launches.len());
        let mut kernels = Kernels::default();
        for launch in launches {
            let name = launch.task.name().to_string();
            if !launch.args.tensor_maps.is_empty() {
                return Err(GraphError::Unsupported(format!("kernel `{name}` uses tensor maps")));
            }
            let info = &launch.args.info;
            if info.dynamic_metadata_offset < info.data.len() {
                return Err(GraphError::Unsupported(format!("kernel `{name}` carries dynamic metadata")));
            }
            let grid = match launch.count {
                CubeCount::Static(x, y, z) => (x, y, z),
                CubeCount::Dynamic(_) => {
                    return Err(GraphError::Unsupported(format!("kernel `{name}` has a dynamic cube count")));
                }
            };
            let mut key = format!("{:?}", launch.task.id());
            key.push_str(&format!("{:?}", launch.mode));
            let function = match loaded.get(&key) {
                Some(f) => *f,
                None => {
                    let (f, from_cache) = load(&launch, &options, arch, order)?;
                    if from_cache {
                        kernels.cached += 1;
                    } else {
                        kernels.compiled += 1;
                    }
                    loaded.insert(key, f);
                    f
                }
            };
            let pointers = launch.handles.iter().map(|h| pointer(&client, h)).collect::<Result<Vec<_>, _>>()?;
            let has_info = !info.data.is_empty();
            nodes.push(Node { function, grid, pointers, info: info.data.clone(), has_info });
            handles.extend(launch.handles);
        }
        // SAFETY: every function is loaded, every pointer belongs to a live handle kept in
        // `handles`, and the parameter arrays outlive each launch call (CUDA copies them).
        let (stream, exec) = unsafe {
            let stream =
                result::stream::create(result::stream::StreamKind::NonBlocking).map_err(driver("cuStreamCreate"))?;
            // No device starts an NCCL kernel before every device is done allocating and
            // loading modules (see `NcclGroup::meet`).
            for group in &groups {
                if let Err(e) = group.meet(MEETING_WAIT) {
                    let _ = result::stream::destroy(stream);
                    return Err(nccl(e));
                }
            }
            // NCCL connects a communicator's peers on a collective's first call (allocating and
            // copying on the calling thread, which a capture forbids): each kind of collective
            // runs once before the capture, on every device alike (the recordings agree), over
            // buffers the graph rewrites before it reads them.
            let mut seen: Vec<(crate::collective::Op, usize)> = Vec::new();
            for (_, call) in &calls {
                if !seen.contains(&(call.op, call.count)) {
                    seen.push((call.op, call.count));
                    if let Err(e) = call.issue(stream) {
                        let _ = result::stream::destroy(stream);
                        return Err(e);
                    }
                }
            }
            result::stream::synchronize(stream).map_err(driver("cuStreamSynchronize"))?;
            // With collectives, NCCL's own calls on this thread during the capture are allowed.
            let mode = if calls.is_empty() {
                sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL
            } else {
                sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED
            };
            result::stream::begin_capture(stream, mode).map_err(driver("cuStreamBeginCapture"))?;
            let mut failed = None;
            let mut pending = calls.iter().peekable();
            for (i, node) in nodes.iter_mut().enumerate() {
                // The collectives recorded before this launch; the kernel after one follows it in
                // plain stream order (NCCL's kernels do not release their successors early).
                let mut after_collective = false;
                while let Some((_, call)) = pending.next_if(|(at, _)| *at <= i) {
                    if let Err(e) = call.issue(stream) {
                        failed = Some(e);
                        break;
                    }
                    after_collective = true;
                }
                if failed.is_some() {
                    break;
                }
                let mut params: Vec<*mut c_void> =
                    node.pointers.iter_mut().map(|p| p as *mut u64 as *mut c_void).collect();
                if node.has_info {
                    params.push(node.info.as_mut_ptr() as *mut c_void);
                }
                // The first kernel follows the host's copies into the step's buffers: plain order.
                let overlapped = order == KernelOrder::Overlapped && i > 0 && !after_collective;
                if let Err(e) = launch(node, stream, &mut params, overlapped) {
                    failed = Some(driver("cuLaunchKernel (capture)")(e));
                    break;
                }
            }
            if failed.is_none() {
                for (_, call) in pending {
                    if let Err(e) = call.issue(stream) {
                        failed = Some(e);
                        break;
                    }
                }
            }
            let graph = result::stream::end_capture(stream).map_err(driver("cuStreamEndCapture"))?;
            if let Some(e) = failed {
                let _ = result::graph::destroy(graph);
                return Err(e);
            }
            let exec = result::graph::instantiate(graph, sys::CUgraphInstantiate_flags(0))
                .map_err(driver("cuGraphInstantiate"))?;
            let _ = result::graph::destroy(graph);
            result::graph::upload(exec, stream).map_err(driver("cuGraphUpload"))?;
            result::stream::synchronize(stream).map_err(driver("cuStreamSynchronize"))?;
            (stream, exec)
        };
        let flags = sys::CUevent_flags::CU_EVENT_DEFAULT;
        let events = (
            result::event::create(flags).map_err(driver("cuEventCreate"))?,
            result::event::create(flags).map_err(driver("cuEventCreate"))?,
        );
        Ok(Self {
            ordinal,
            stream,
            exec,
            events,
            kernels,
            last: Default::default(),
            _handles: handles,
            _groups: groups,
        })
    }

    pub(crate) fn replay(
        &mut self,
        writes: &[(&Buffer, &[u8])],
        read: Option<(&Buffer, &mut [u8])>,
    ) -> Result<(), GraphError> {
        let start = std::time::Instant::now();
        make_current(self.ordinal)?;
        // SAFETY: the buffers are live device allocations at least as large as the host slices
        // (checked by the caller); the stream, graph and events belong to this context.
        unsafe {
            for (buffer, bytes) in writes {
                result::memcpy_htod_async(buffer.ptr, bytes, self.stream).map_err(driver("cuMemcpyHtoDAsync"))?;
            }
            result::event::record(self.events.0, self.stream).map_err(driver("cuEventRecord"))?;
            result::graph::launch(self.exec, self.stream).map_err(driver("cuGraphLaunch"))?;
            result::event::record(self.events.1, self.stream).map_err(driver("cuEventRecord"))?;
            // (A copy into pageable memory waits for the graph: the issue time ends here.)
            let issue = start.elapsed();
            if let Some((buffer, out)) = read {
                result::memcpy_dtoh_async(out, buffer.ptr, self.stream).map_err(driver("cuMemcpyDtoHAsync"))?;
            }
            result::stream::synchronize(self.stream).map_err(driver("cuStreamSynchronize"))?;
            let gpu_ms = result::event::elapsed(self.events.0, self.events.1).map_err(driver("cuEventElapsedTime"))?;
            self.last = super::ReplayTimes { issue, gpu: std::time::Duration::from_secs_f64(f64::from(gpu_ms) / 1e3) };
            Ok(())
        }
    }
}

impl Drop for Graph {
    fn drop(&mut self) {
        // SAFETY: the graph and stream were created by `new` and are not used after this.
        unsafe {
            let _ = result::stream::synchronize(self.stream);
            let _ = result::graph::exec_destroy(self.exec);
            let _ = result::event::destroy(self.events.0);
            let _ = result::event::destroy(self.events.1);
            let _ = result::stream::destroy(self.stream);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ptx_cache_key_is_stable_and_separates_parts() {
        assert_eq!(fnv1a(&[b"abc"]), fnv1a(&[b"abc"]));
        assert_ne!(fnv1a(&[b"ab", b"c"]), fnv1a(&[b"a", b"bc"]));
        assert_ne!(fnv1a(&[b"abc"]), fnv1a(&[b"abd"]));
    }

    #[test]
    fn dependency_wait_opens_the_kernel_body() {
        // As cubecl-cpp 0.10 writes a kernel (`shared/kernel.rs`, `cuda/dialect.rs`).
        let source = "struct info_st { uint x; };\n__device__ void not_gemv_f32 () {}\n\n\
                      extern \"C\" __global__ void __launch_bounds__(256)gemv_f32 (\n\
                      float* x_0,\nconst __grid_constant__ info_st info\n) {\nuint a = threadIdx.x;\n}\n";
        let placed = with_dependent_launch(source, "gemv_f32", KernelOrder::Overlapped).expect("kernel body");
        let body = placed.find("\n) {").expect("body") + 4;
        assert!(placed[body..].starts_with(DEPENDENT_LAUNCH_PROLOGUE), "{placed}");
        assert!(placed[body + DEPENDENT_LAUNCH_PROLOGUE.len()..].starts_with("\nuint a = threadIdx.x;"));
        assert_eq!(placed.len(), source.len() + DEPENDENT_LAUNCH_PROLOGUE.len());
        // Neither the struct's braces nor a function whose name ends in the kernel's are taken.
        assert!(placed.starts_with("struct info_st { uint x; };\n__device__ void not_gemv_f32 () {}\n"));
        assert!(with_dependent_launch(source, "other_kernel", KernelOrder::Overlapped).is_none());
        use super::super::DependentLaunch;
        assert_eq!(KernelOrder::for_architecture(90, DependentLaunch::Auto), KernelOrder::Overlapped);
        assert_eq!(KernelOrder::for_architecture(90, DependentLaunch::Off), KernelOrder::Serial);
        assert_eq!(KernelOrder::for_architecture(89, DependentLaunch::Auto), KernelOrder::Serial);
        assert_eq!(KernelOrder::for_architecture(90, DependentLaunch::AtStart), KernelOrder::OverlappedAtStart);
        assert_eq!(KernelOrder::for_architecture(89, DependentLaunch::AtStart), KernelOrder::Serial);
    }

    #[test]
    fn a_marked_wait_goes_where_the_kernel_marks_it() {
        let source = "extern \"C\" __global__ void __launch_bounds__(256)qgemv (\nfloat* x_0\n) {\n\
                      uint w = codes[threadIdx.x];\n// burn-gemma: wait for the kernels before\nfloat a = x_0[0];\n}\n";
        let placed = with_dependent_launch(source, "qgemv", KernelOrder::Overlapped).expect("kernel body");
        let body = placed.find("\n) {").expect("body") + 4;
        // The successor's launch is released first; the wait sits between the weight load
        // and the first read of an activation, and nothing else moves.
        assert!(placed[body..].starts_with(LAUNCH_DEPENDENTS), "{placed}");
        let load = placed.find("uint w = codes").expect("load");
        let wait = placed.find(WAIT).expect("wait");
        let read = placed.find("float a = x_0").expect("read");
        assert!(load < wait && wait < read, "{placed}");
        assert!(!placed.contains(WAIT_MARKER));
        assert_eq!(placed.matches("griddepcontrol.wait").count(), 1);
        // Two marks are refused: the kernel would wait where its reads may already have run.
        let twice = source.replace("float a", "// burn-gemma: wait for the kernels before\nfloat a");
        assert!(with_dependent_launch(&twice, "qgemv", KernelOrder::Overlapped).is_none());
        // At the start, marks ignored (the comment stays a comment).
        let start = with_dependent_launch(source, "qgemv", KernelOrder::OverlappedAtStart).expect("kernel body");
        assert!(start[body..].starts_with(DEPENDENT_LAUNCH_PROLOGUE), "{start}");
        assert!(start.contains(WAIT_MARKER));
    }

    #[test]
    fn options_follow_the_architecture() {
        let hopper = compilation_options(90);
        assert!(hopper.supports_features.grid_constants && hopper.supports_features.clusters);
        let volta = compilation_options(70);
        assert!(volta.supports_features.grid_constants && !volta.supports_features.fast_tanh);
        assert!(!compilation_options(61).supports_features.grid_constants);
    }
}
