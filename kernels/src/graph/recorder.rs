//! The recording runtime: a CubeCL `Runtime` whose compiler is CubeCL's CUDA compiler and whose
//! server keeps what each launch is handed (task, cube count, argument bytes) instead of
//! running it. The crate's generated `launch::<R>` functions run unchanged with `R = Rec`, so
//! kernel ids, comptime arguments and the packed argument layout are CubeCL's own.

use super::GraphError;
use cubecl::bytes::Bytes;
use cubecl::cuda::{CudaCompiler, CudaDevice, CudaRuntime};
use cubecl::device::{Device, DeviceId, DeviceService, ServerUtilitiesHandle};
use cubecl::future::DynFut;
use cubecl::ir::{DeviceProperties, TargetProperties};
use cubecl::profile::ProfileDuration;
use cubecl::server::{
    Binding, ComputeServer, CopyDescriptor, CubeCount, ExecutionMode, Handle, KernelArguments, ProfileError,
    ProfilingToken, ServerCommunication, ServerError, ServerUtilities,
};
use cubecl::stream_id::StreamId;
use cubecl::zspace::{Shape, Strides};
use cubecl::{client::ComputeClient, CubeTask, Runtime};
use cubecl_runtime::{
    allocator::ContiguousMemoryLayoutPolicy,
    logging::ServerLogger,
    memory_management::{ManagedMemoryHandle, MemoryAllocationMode, MemoryUsage},
    storage::{ComputeStorage, ManagedResource, StorageHandle, StorageId},
    timestamp_profiler::TimestampProfiler,
};
use std::sync::{Arc, Mutex};

/// One recorded launch, with the handles of its buffers (in binding order), which keep the
/// memory alive.
pub(crate) struct Recorded {
    pub task: Box<dyn CubeTask<CudaCompiler>>,
    pub count: CubeCount,
    pub args: KernelArguments,
    pub mode: ExecutionMode,
    pub handles: Vec<Handle>,
}

/// What the server is handed for one launch.
type Launch = (Box<dyn CubeTask<CudaCompiler>>, CubeCount, KernelArguments, ExecutionMode);

/// What the server was handed, in launch order, per CubeCL stream (one per thread: shards of a
/// split model record their steps on threads of their own at the same time).
static LAUNCHES: Mutex<Vec<(StreamId, Vec<Launch>)>> = Mutex::new(Vec::new());

/// The launches recorded on this thread's stream, taken out of the list.
fn take_launches() -> Vec<Launch> {
    let stream = StreamId::current();
    let mut all = LAUNCHES.lock().unwrap_or_else(|e| e.into_inner());
    match all.iter().position(|(s, _)| *s == stream) {
        Some(i) => all.swap_remove(i).1,
        None => Vec::new(),
    }
}
/// The CUDA device's properties (kernels read them while they are defined).
static PROPERTIES: Mutex<Option<DeviceProperties>> = Mutex::new(None);

/// Makes the recorder describe `device` (once: the recorder describes the first device it
/// records for; the devices of a split model are of one kind) and forgets what this thread
/// recorded before.
pub(crate) fn prepare(device: &CudaDevice) {
    let mut props = PROPERTIES.lock().unwrap_or_else(|e| e.into_inner());
    if props.is_none() {
        *props = Some(CudaRuntime::client(device).properties().clone());
    }
    drop(props);
    take_launches();
}

/// The recorder's client.
pub(crate) fn client() -> ComputeClient<Rec> {
    Rec::client(&RecDevice)
}

/// The launches recorded since [`prepare`], each given its handles (`groups`, in launch order).
pub(crate) fn take(groups: Vec<Vec<Handle>>) -> Result<Vec<Recorded>, GraphError> {
    if !groups.is_empty() {
        client().flush().map_err(|e| GraphError::Unsupported(format!("recorder flush: {e:?}")))?;
    }
    let launches = take_launches();
    if launches.len() != groups.len() {
        return Err(GraphError::Unsupported(format!(
            "{} launches recorded but {} argument lists seen",
            launches.len(),
            groups.len()
        )));
    }
    launches
        .into_iter()
        .zip(groups)
        .map(|((task, count, args, mode), handles)| {
            if args.buffers.len() != handles.len() {
                return Err(GraphError::Unsupported(format!(
                    "kernel `{}` binds {} buffers but {} handles were seen",
                    task.name(),
                    args.buffers.len(),
                    handles.len()
                )));
            }
            Ok(Recorded { task, count, args, mode, handles })
        })
        .collect()
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct RecDevice;

impl Device for RecDevice {
    fn from_id(_: DeviceId) -> Self {
        Self
    }
    fn to_id(&self) -> DeviceId {
        DeviceId { type_id: 0x6d6d, index_id: 0 }
    }
}

#[derive(Debug)]
pub struct RecServer {
    utilities: Arc<ServerUtilities<Self>>,
    timestamps: TimestampProfiler,
}

impl ServerCommunication for RecServer {
    const SERVER_COMM_ENABLED: bool = false;
}

impl DeviceService for RecServer {
    fn init(_: DeviceId) -> Self {
        let props = PROPERTIES.lock().unwrap_or_else(|e| e.into_inner()).clone().unwrap_or_else(|| {
            // `client()` is only reached from `record`, which calls `prepare` first.
            unreachable!("the recorder's properties are set before its client")
        });
        let utilities =
            ServerUtilities::new(props, Arc::new(ServerLogger::default()), (), ContiguousMemoryLayoutPolicy::new(512));
        Self { utilities: Arc::new(utilities), timestamps: TimestampProfiler::default() }
    }
    fn utilities(&self) -> ServerUtilitiesHandle {
        ComputeServer::utilities(self) as ServerUtilitiesHandle
    }
}

fn no_memory() -> ServerError {
    ServerError::Generic {
        reason: "the CUDA-graph recorder holds no memory".into(),
        backtrace: cubecl::backtrace::BackTrace::capture(),
    }
}

impl ComputeServer for RecServer {
    type Kernel = Box<dyn CubeTask<CudaCompiler>>;
    type Storage = NoStorage;
    type MemoryLayoutPolicy = ContiguousMemoryLayoutPolicy;
    type Info = ();

    fn initialize_memory(&mut self, _: ManagedMemoryHandle, _: u64, _: StreamId) {}
    fn logger(&self) -> Arc<ServerLogger> {
        self.utilities.logger.clone()
    }
    fn utilities(&self) -> Arc<ServerUtilities<Self>> {
        self.utilities.clone()
    }
    fn read(&mut self, _: Vec<CopyDescriptor>, _: StreamId) -> DynFut<Result<Vec<Bytes>, ServerError>> {
        Box::pin(async { Err(no_memory()) })
    }
    fn write(&mut self, _: Vec<(CopyDescriptor, Bytes)>, _: StreamId) {}
    fn sync(&mut self, _: StreamId) -> DynFut<Result<(), ServerError>> {
        Box::pin(async { Ok(()) })
    }
    fn get_resource(&mut self, _: Binding, _: StreamId) -> Result<ManagedResource<()>, ServerError> {
        Err(no_memory())
    }
    unsafe fn launch(
        &mut self,
        task: Self::Kernel,
        count: CubeCount,
        args: KernelArguments,
        mode: ExecutionMode,
        stream: StreamId,
    ) {
        let mut all = LAUNCHES.lock().unwrap_or_else(|e| e.into_inner());
        match all.iter_mut().find(|(s, _)| *s == stream) {
            Some((_, launches)) => launches.push((task, count, args, mode)),
            None => all.push((stream, vec![(task, count, args, mode)])),
        }
    }
    fn flush(&mut self, _: StreamId) -> Result<(), ServerError> {
        Ok(())
    }
    fn memory_usage(&mut self, _: StreamId) -> Result<MemoryUsage, ServerError> {
        Err(no_memory())
    }
    fn memory_cleanup(&mut self, _: StreamId) {}
    fn start_profile(&mut self, _: StreamId) -> Result<ProfilingToken, ServerError> {
        Ok(self.timestamps.start())
    }
    fn end_profile(&mut self, _: StreamId, token: ProfilingToken) -> Result<ProfileDuration, ProfileError> {
        self.timestamps.stop(token)
    }
    fn allocation_mode(&mut self, _: MemoryAllocationMode, _: StreamId) {}
}

/// The recorder allocates nothing: outputs come from the real CUDA client.
pub struct NoStorage;

impl ComputeStorage for NoStorage {
    type Resource = ();
    fn alignment(&self) -> usize {
        512
    }
    fn get(&mut self, _: &StorageHandle) {}
    fn alloc(&mut self, size: u64) -> Result<StorageHandle, cubecl::server::IoError> {
        Err(cubecl::server::IoError::BufferTooBig { size, backtrace: cubecl::backtrace::BackTrace::capture() })
    }
    fn dealloc(&mut self, _: StorageId) {}
    fn flush(&mut self) {}
}

/// The recording runtime.
#[derive(Debug, Clone)]
pub struct Rec;

impl Runtime for Rec {
    type Compiler = CudaCompiler;
    type Server = RecServer;
    type Device = RecDevice;
    fn client(device: &RecDevice) -> ComputeClient<Self> {
        ComputeClient::load(device)
    }
    fn name(_: &ComputeClient<Self>) -> &'static str {
        "cuda-graph-recorder"
    }
    fn require_array_lengths() -> bool {
        CudaRuntime::require_array_lengths()
    }
    fn max_cube_count() -> (u32, u32, u32) {
        CudaRuntime::max_cube_count()
    }
    fn can_read_tensor(shape: &Shape, strides: &Strides) -> bool {
        CudaRuntime::can_read_tensor(shape, strides)
    }
    fn target_properties() -> TargetProperties {
        CudaRuntime::target_properties()
    }
    fn enumerate_devices(_: u16, _: &()) -> Vec<DeviceId> {
        vec![RecDevice.to_id()]
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use cubecl::ir::features::{Features, Plane};
    use cubecl::ir::{ElemType, FloatKind, HardwareProperties, MemoryDeviceProperties, StorageType};
    use cubecl::prelude::{ArrayArg, CubeDim};
    use cubecl::profile::TimingMethod;

    /// An sm_90-class device as CubeCL's CUDA runtime describes one (no GPU needed).
    fn hopper_like() -> DeviceProperties {
        let hardware = HardwareProperties {
            load_width: 128,
            plane_size_min: 32,
            plane_size_max: 32,
            max_bindings: 1024,
            max_shared_memory_size: 232_448,
            max_cube_count: (i32::MAX as u32, 65_535, 65_535),
            max_units_per_cube: 1024,
            max_cube_dim: (1024, 1024, 64),
            num_streaming_multiprocessors: Some(132),
            num_tensor_cores: Some(4),
            min_tensor_cores_dim: Some(8),
            num_cpu_cores: None,
            max_vector_size: usize::MAX,
        };
        let memory = MemoryDeviceProperties { max_page_size: 1 << 34, alignment: 512 };
        let mut props = DeviceProperties::new(Features::default(), memory, hardware, TimingMethod::System);
        cubecl_cpp::register_supported_types(&mut props);
        props.features.plane.insert(Plane::Ops);
        props
    }

    fn bf16() -> StorageType {
        StorageType::Scalar(ElemType::Float(FloatKind::BF16))
    }

    fn f32() -> StorageType {
        StorageType::Scalar(ElemType::Float(FloatKind::F32))
    }

    /// The crate's RMSNorm over rows of `n` launched on the recorder: `handles` (input, weight,
    /// output) as its arrays, `cubes` cubes, the element types `[input, weight]`.
    fn rms_norm_on_recorder(handles: &[Handle], n: usize, cubes: u32, dim: CubeDim, types: [StorageType; 2]) {
        // SAFETY: lengths within the handles' sizes; nothing runs.
        let array = |h: &Handle| unsafe { ArrayArg::<Rec>::from_raw_parts(h.clone(), n) };
        crate::rms_norm::kernel::rms_norm_kernel::launch::<Rec>(
            &client(),
            CubeCount::Static(cubes, 1, 1),
            dim,
            1,
            array(&handles[0]),
            array(&handles[1]),
            array(&handles[2]),
            n as u32,
            1e-6f32,
            5usize,
            true,
            types,
        );
    }

    /// The crate's RMSNorm launched on the recorder with raw handles: one launch captured with
    /// its three buffers in argument order, its scalars in the packed argument words, and CUDA
    /// source that CubeCL's compiler produces from the task.
    #[test]
    fn records_a_launch_without_a_gpu() {
        PROPERTIES.lock().unwrap_or_else(|e| e.into_inner()).get_or_insert_with(hopper_like);
        take_launches();
        let stream = StreamId::current();
        let n = 1152usize;
        let handles = vec![
            Handle::new(stream, 2 * n as u64),
            Handle::new(stream, 4 * n as u64),
            Handle::new(stream, 2 * n as u64),
        ];
        rms_norm_on_recorder(&handles, n, 3, CubeDim::new_1d(256), [bf16(), f32()]);
        let recorded = take(vec![handles]).expect("one launch with three buffers");
        assert_eq!(recorded.len(), 1);
        let launch = &recorded[0];
        assert!(matches!(launch.count, CubeCount::Static(3, 1, 1)));
        assert_eq!(launch.args.buffers.len(), 3);
        assert_eq!(launch.handles.iter().map(Handle::size).collect::<Vec<_>>(), vec![2304, 4608, 2304]);
        // The scalars (n as u32, eps as f32) sit in the packed words, each group padded to 8 bytes.
        let words = &launch.args.info.data;
        let bytes: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
        let has = |needle: [u8; 4]| bytes.windows(4).any(|w| w == needle);
        assert!(has((n as u32).to_le_bytes()), "n in {words:x?}");
        assert!(has(1e-6f32.to_le_bytes()), "eps in {words:x?}");
        let compiled = launch
            .task
            .compile(
                &mut CudaCompiler::default(),
                &super::super::cuda::compilation_options(90),
                launch.mode,
                launch.task.address_type(),
            )
            .expect("CUDA source");
        assert!(compiled.source.contains(&compiled.entrypoint_name), "{}", compiled.source);
        assert!(compiled.source.contains("__nv_bfloat16"), "bf16 input: {}", compiled.source);
        assert_eq!(compiled.cube_dim, CubeDim::new_1d(256));
        // Argument lists and launches must pair up (an argument built without `arg` would
        // leave a launch without its handles).
        assert!(take(vec![vec![]]).is_err(), "a list without a launch");
    }

    /// Threads recording at once (the shards of a split model) each take their own launches.
    #[test]
    fn threads_record_their_own_launches() {
        PROPERTIES.lock().unwrap_or_else(|e| e.into_inner()).get_or_insert_with(hopper_like);
        let counts: Vec<Vec<u32>> = std::thread::scope(|s| {
            let threads: Vec<_> = (1..=3u32)
                .map(|cubes| {
                    s.spawn(move || {
                        take_launches();
                        let stream = StreamId::current();
                        let n = 64usize;
                        let mut groups = Vec::new();
                        for _ in 0..20 {
                            let handles: Vec<Handle> = (0..3).map(|_| Handle::new(stream, 4 * n as u64)).collect();
                            rms_norm_on_recorder(&handles, n, cubes, CubeDim::new_1d(64), [f32(), f32()]);
                            groups.push(handles);
                        }
                        let recorded = take(groups).expect("this thread's launches");
                        recorded
                            .iter()
                            .map(|r| match r.count {
                                CubeCount::Static(x, _, _) => x,
                                CubeCount::Dynamic(_) => 0,
                            })
                            .collect::<Vec<u32>>()
                    })
                })
                .collect();
            threads.into_iter().map(|t| t.join().expect("joins")).collect()
        });
        for (i, counts) in counts.iter().enumerate() {
            assert_eq!(counts, &vec![i as u32 + 1; 20], "thread {i}");
        }
    }
}
