//! A decode step recorded once and replayed as one CUDA graph.
//!
//! CubeCL 0.10 launches every kernel through its device thread at ~10 us of host time each,
//! and a decode token issues a few hundred of them. CubeCL gained CUDA-graph capture only in
//! 0.11, so the crate records its own step:
//!
//! 1. **Record.** Inside [`record`], the crate's kernel wrappers launch on a *recording
//!    runtime* (`Rec`, CUDA feature) instead of the tensor's runtime: its server stores each
//!    launch's task, cube count and argument bytes, exactly as CubeCL built them, and runs
//!    nothing. Outputs are still allocated by the real CUDA client, and the wrappers hand the
//!    handles of every array argument to the recorder (`arg`), which keeps them alive: the
//!    recorded pointers stay valid as long as the graph lives.
//! 2. **Compile.** Each recorded task is compiled by CubeCL's own CUDA compiler with the options
//!    CubeCL uses for the device, then by NVRTC (PTX cached on disk by source hash).
//! 3. **Capture.** The launches are captured on a stream of our own into one graph. On compute
//!    capability 9.0+ the kernels follow one another by programmatic dependent launch: each
//!    kernel's first statements wait for its predecessor and then release its successor, whose
//!    launch and block start-up so overlap this kernel's run (`KernelOrder` in `cuda.rs`;
//!    [`crate::KernelTuning::dependent_launch`] turns it off). A kernel may mark a later place for its wait
//!    (`comment!("burn-gemma: wait for the kernels before")`) when everything it does before
//!    the mark reads only what no kernel of a step writes: the quantized GEMV issues its first
//!    weight loads there, which then overlap the kernels before it.
//! 4. **Replay.** Per token: copy the step's values (position, token ids, sampling draws) into
//!    the small device buffers the kernels read them from, launch the graph, read the ids back.
//!
//! Values that change per token are read by the kernels from device buffers (see
//! [`crate::StepPosition`]); grid shapes depend only on a bound of the position, so one
//! recording serves every position up to that bound.
//!
//! Everything here compiles without the `cuda` feature; [`record`] then reports
//! [`GraphError::Unsupported`].

#[cfg(feature = "cuda")]
mod cuda;
#[cfg(feature = "cuda")]
mod recorder;

#[cfg(feature = "cuda")]
pub(crate) use cuda::{architecture, make_current, ptx};

use burn::tensor::{backend::Backend, Int, Tensor};
use burn_cubecl::{tensor::CubeTensor, CubeRuntime};
use cubecl::prelude::*;
use cubecl::server::Handle;
use std::cell::RefCell;

#[cfg(feature = "cuda")]
pub(crate) use recorder::Rec;

/// Why a step could not be recorded or replayed.
#[derive(Debug, thiserror::Error)]
pub enum GraphError {
    /// The backend is not CUDA (or the crate was built without the `cuda` feature).
    #[error("CUDA graphs need the CUDA backend: {0}")]
    NotCuda(String),
    /// The step cannot be replayed as a graph (an operation of the step that the recorder
    /// cannot capture, or a kernel argument it cannot replay).
    #[error("CUDA graph not available: {0}")]
    Unsupported(String),
    /// A kernel did not compile or load.
    #[error("CUDA graph: kernel `{kernel}` failed to compile: {reason}")]
    Compile { kernel: String, reason: String },
    /// A CUDA driver call failed.
    #[error("CUDA graph: {call} failed: {reason}")]
    Driver { call: &'static str, reason: String },
}

/// Whether graphs built from now on let each kernel's launch overlap its predecessor's run
/// (programmatic dependent launch, compute capability 9.0+; see the module docs). Graphs
/// already built keep theirs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DependentLaunch {
    /// Where the device has it (9.0+), stream order elsewhere; a kernel that marks where it
    /// starts reading its predecessors' results (the quantized GEMV, after issuing its first
    /// weight loads) waits there, every other kernel in its first statement.
    #[default]
    Auto,
    /// As `Auto`, but every kernel waits in its first statement (marks ignored): the mode before
    /// the marks, kept for measuring them.
    AtStart,
    /// Stream order: each kernel launched when its predecessor has finished.
    Off,
}

impl std::str::FromStr for DependentLaunch {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "auto" => Ok(Self::Auto),
            "at-start" => Ok(Self::AtStart),
            "off" => Ok(Self::Off),
            other => Err(format!("unknown dependent-launch mode `{other}` (expected auto, at-start or off)")),
        }
    }
}

/// What one recording session collects on this thread.
#[derive(Default)]
pub(crate) struct Session {
    /// Handles of the array arguments of the launch being built, in argument order.
    pending: Vec<Handle>,
    /// The handles of every recorded launch, in launch order.
    launches: Vec<Vec<Handle>>,
    /// Why the step cannot be recorded, where an operation said so.
    unsupported: Option<String>,
    /// Collectives (tensor parallelism), each after the launches counted beside it.
    #[cfg(feature = "cuda")]
    collectives: Vec<(usize, crate::collective::Recorded)>,
}

thread_local! {
    static SESSION: RefCell<Option<Session>> = const { RefCell::new(None) };
}

/// Whether a step is being recorded on this thread.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) fn recording() -> bool {
    SESSION.with(|s| s.borrow().is_some())
}

/// Marks the step being recorded as not replayable (no-op outside a recording): for operations
/// that read device values back to the host, depend on per-token host values, or launch work
/// the recorder does not see (Burn's own tensor operations: casts, concatenations, matmuls).
pub fn unsupported(reason: impl FnOnce() -> String) {
    SESSION.with(|s| {
        if let Some(session) = s.borrow_mut().as_mut() {
            session.unsupported.get_or_insert_with(reason);
        }
    });
}

/// An array argument built from `t`'s handle for a launch on runtime `L` (the tensor's own, or
/// the recorder). While recording, the handle is kept for the recorded launch.
pub(crate) fn arg<L: Runtime, R: CubeRuntime>(t: &CubeTensor<R>) -> ArrayArg<L> {
    keep(&t.handle);
    // SAFETY: the length is the tensor's element count, as `CubeTensor::into_array_arg` gives.
    unsafe { ArrayArg::from_raw_parts(t.handle.clone(), t.meta.num_elements()) }
}

/// While recording, keeps `handle` for the launch being built (no-op otherwise).
fn keep(handle: &Handle) {
    SESSION.with(|s| {
        if let Some(session) = s.borrow_mut().as_mut() {
            session.pending.push(handle.clone());
        }
    });
}

/// A tensor argument (shape and strides passed with it) built from `t`'s handle for runtime
/// `L`; kept like [`arg`] while recording.
pub(crate) fn tensor_arg<L: Runtime, R: CubeRuntime>(t: &CubeTensor<R>) -> TensorArg<L> {
    keep(&t.handle);
    // SAFETY: the tensor's own shape and strides.
    unsafe { TensorArg::from_raw_parts(t.handle.clone(), t.meta.strides().clone(), t.meta.shape().clone()) }
}

/// Closes the argument list of a recorded launch.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) fn launched() {
    SESSION.with(|s| {
        if let Some(session) = s.borrow_mut().as_mut() {
            let handles = std::mem::take(&mut session.pending);
            session.launches.push(handles);
        }
    });
}

/// Records a collective after the launches recorded so far (see [`crate::collective`]).
#[cfg(feature = "cuda")]
pub(crate) fn collective(recorded: crate::collective::Recorded) {
    SESSION.with(|s| {
        if let Some(session) = s.borrow_mut().as_mut() {
            let at = session.launches.len();
            session.collectives.push((at, recorded));
        }
    });
}

/// Launches a `#[cube(launch)]` kernel on the runtime `R` in scope, or hands it to the recorder
/// while a step is being recorded on this thread (CUDA only). Array arguments must be built
/// with [`arg`] inside the invocation, so that the recorder sees their handles in order.
/// (`@via` names the generated launch function: `launch` here, `launch_unchecked` for
/// [`launch_unchecked!`].)
macro_rules! launch {
    (@via $launch:ident, $kernel:ident ($client:expr, $($arg:expr),* $(,)?)) => {{
        #[cfg(feature = "cuda")]
        {
            if let Some(recorder) = $crate::graph::recorder_for::<R>() {
                $kernel::$launch::<$crate::graph::Rec>(&recorder, $($arg),*);
                $crate::graph::launched();
            } else {
                $kernel::$launch::<R>($client, $($arg),*);
            }
        }
        #[cfg(not(feature = "cuda"))]
        {
            $kernel::$launch::<R>($client, $($arg),*);
        }
    }};
    ($kernel:ident ($client:expr, $($arg:expr),* $(,)?)) => {
        $crate::graph::launch!(@via launch, $kernel($client, $($arg),*))
    };
}
pub(crate) use launch;

/// [`launch!`] for a kernel declared `#[cube(launch_unchecked)]`: its array accesses are not
/// bounds-checked, so the calling launcher must keep every index in range by construction (and
/// says how beside the call).
macro_rules! launch_unchecked {
    ($kernel:ident ($client:expr, $($arg:expr),* $(,)?)) => {
        // SAFETY: the kernel's indices stay in range by construction (see the launcher).
        unsafe { $crate::graph::launch!(@via launch_unchecked, $kernel($client, $($arg),*)) }
    };
}
pub(crate) use launch_unchecked;

/// The recorder's client when a step is being recorded and `R` is the CUDA runtime.
#[cfg(feature = "cuda")]
pub(crate) fn recorder_for<R: CubeRuntime>() -> Option<ComputeClient<Rec>> {
    use std::any::TypeId;
    if TypeId::of::<R>() != TypeId::of::<cubecl::cuda::CudaRuntime>() || !recording() {
        return None;
    }
    Some(recorder::client())
}

/// A step recorded by [`record`], ready to be compiled into a [`StepGraph`].
pub struct Recording {
    #[cfg(feature = "cuda")]
    launches: Vec<recorder::Recorded>,
    /// Collectives, each after the launches counted beside it.
    #[cfg(feature = "cuda")]
    collectives: Vec<(usize, crate::collective::Recorded)>,
    #[cfg(feature = "cuda")]
    device: cubecl::cuda::CudaDevice,
}

impl Recording {
    /// Kernel launches recorded.
    pub fn launches(&self) -> usize {
        #[cfg(feature = "cuda")]
        {
            self.launches.len()
        }
        #[cfg(not(feature = "cuda"))]
        {
            0
        }
    }
}

/// CUDA devices the driver reports, 0 where the driver library is not installed or does not
/// initialize. Touches only the driver (not CubeCL's runtime, which panics without a device).
#[cfg(feature = "cuda")]
pub fn cuda_device_count() -> usize {
    // SAFETY: `is_culib_present` only tries to load the driver library.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return 0;
    }
    if cudarc::driver::result::init().is_err() {
        return 0;
    }
    cudarc::driver::result::device::get_count().map_or(0, |n| usize::try_from(n).unwrap_or(0))
}

/// Whether steps on `device` of backend `B` can be recorded at all (the CUDA backend, built
/// with the `cuda` feature): [`GraphError::NotCuda`] otherwise. A step can still fail to record.
pub fn available<B: Backend>(device: &B::Device) -> Result<(), GraphError> {
    #[cfg(feature = "cuda")]
    if (device as &dyn std::any::Any).is::<cubecl::cuda::CudaDevice>() {
        return Ok(());
    }
    Err(GraphError::NotCuda(format!("the {} backend is not CUDA", B::name(device))))
}

/// Runs `f` with the crate's kernel launches recorded instead of run, on the CUDA device
/// `device` of backend `B`. Outputs are allocated but hold nothing until the graph replays.
///
/// Fails with [`GraphError::Unsupported`] when `B` is not the CUDA backend, when an operation
/// of `f` said it cannot be recorded, or when `f` launched nothing.
pub fn record<B: Backend, T>(device: &B::Device, f: impl FnOnce() -> T) -> Result<(T, Recording), GraphError> {
    #[cfg(feature = "cuda")]
    {
        let Some(cuda) = (device as &dyn std::any::Any).downcast_ref::<cubecl::cuda::CudaDevice>() else {
            return Err(GraphError::NotCuda(format!("the {} backend is not CUDA", B::name(device))));
        };
        recorder::prepare(cuda);
        let previous = SESSION.with(|s| s.borrow_mut().replace(Session::default()));
        if previous.is_some() {
            return Err(GraphError::Unsupported("a step is already being recorded on this thread".into()));
        }
        let out = f();
        let session = SESSION.with(|s| s.borrow_mut().take()).unwrap_or_default();
        let launches = recorder::take(session.launches)?;
        if let Some(reason) = session.unsupported {
            return Err(GraphError::Unsupported(reason));
        }
        if launches.is_empty() {
            return Err(GraphError::Unsupported("the step launched no kernel of this crate".into()));
        }
        Ok((out, Recording { launches, collectives: session.collectives, device: cuda.clone() }))
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = f;
        Err(GraphError::NotCuda(format!(
            "the {} backend is not CUDA (built without the `cuda` feature)",
            B::name(device)
        )))
    }
}

/// A device buffer the host writes before a replay or reads after it: one tensor's memory.
pub struct StepBuffer {
    #[cfg(feature = "cuda")]
    inner: cuda::Buffer,
    bytes: usize,
}

impl StepBuffer {
    /// The memory of an int tensor of the CUDA backend (kept alive by the buffer).
    pub fn int<B: Backend, const D: usize>(t: &Tensor<B, D, Int>) -> Result<Self, GraphError> {
        let bytes = t.shape().num_elements() * t.dtype().size();
        let primitive = t.clone().into_primitive();
        Self::from_any(&primitive as &dyn std::any::Any, bytes)
    }

    /// The memory of a float tensor of the CUDA backend (kept alive by the buffer).
    pub fn float<B: Backend, const D: usize>(t: &Tensor<B, D>) -> Result<Self, GraphError> {
        let bytes = t.shape().num_elements() * t.dtype().size();
        let primitive = t.clone().into_primitive().tensor();
        Self::from_any(&primitive as &dyn std::any::Any, bytes)
    }

    fn from_any(primitive: &dyn std::any::Any, bytes: usize) -> Result<Self, GraphError> {
        #[cfg(feature = "cuda")]
        {
            let Some(t) = primitive.downcast_ref::<CubeTensor<cubecl::cuda::CudaRuntime>>() else {
                return Err(GraphError::NotCuda("the tensor is not on the CUDA backend".into()));
            };
            Ok(Self { inner: cuda::Buffer::new(t)?, bytes })
        }
        #[cfg(not(feature = "cuda"))]
        {
            let _ = (primitive, bytes);
            Err(GraphError::NotCuda("built without the `cuda` feature".into()))
        }
    }

    /// Size in bytes.
    pub fn bytes(&self) -> usize {
        self.bytes
    }
}

/// A recorded step, compiled and captured: replayed with [`StepGraph::replay`].
pub struct StepGraph {
    #[cfg(feature = "cuda")]
    inner: cuda::Graph,
    launches: usize,
}

/// Where the time of one replay went.
#[derive(Debug, Clone, Copy, Default)]
pub struct ReplayTimes {
    /// Host time spent issuing it (copies in, graph launch), before waiting.
    pub issue: std::time::Duration,
    /// GPU time of the graph itself (CUDA events around the launch).
    pub gpu: std::time::Duration,
}

/// What the host does around one replay.
pub struct Replay<'a> {
    /// Buffers written (host bytes copied in, in order) before the graph runs.
    pub writes: &'a [(&'a StepBuffer, &'a [u8])],
    /// The buffer read back after the graph ran, and where its bytes go (or none: the replay
    /// still waits for the graph, so that eager work can read what it wrote).
    pub read: Option<(&'a StepBuffer, &'a mut [u8])>,
}

impl StepGraph {
    /// Compiles every recorded kernel (NVRTC, PTX cached on disk), resolves the device pointers
    /// of its arguments and captures the launches into one CUDA graph. The CubeCL stream of
    /// the device is synchronized first, so that the graph sees what eager work wrote. `launch`
    /// says whether its launches overlap ([`crate::KernelTuning::dependent_launch`]).
    pub fn new(recording: Recording, launch: DependentLaunch) -> Result<Self, GraphError> {
        #[cfg(feature = "cuda")]
        {
            let launches = recording.launches.len();
            let inner = cuda::Graph::new(recording.launches, recording.collectives, &recording.device, launch)?;
            Ok(Self { inner, launches })
        }
        #[cfg(not(feature = "cuda"))]
        {
            let _ = (recording, launch);
            Err(GraphError::NotCuda("built without the `cuda` feature".into()))
        }
    }

    /// Kernel launches per replay.
    pub fn launches(&self) -> usize {
        self.launches
    }

    /// Distinct kernels `(compiled by NVRTC, loaded from the PTX cache)`.
    pub fn kernels(&self) -> (usize, usize) {
        #[cfg(feature = "cuda")]
        {
            (self.inner.kernels.compiled, self.inner.kernels.cached)
        }
        #[cfg(not(feature = "cuda"))]
        {
            (0, 0)
        }
    }

    /// The times of the last [`StepGraph::replay`].
    pub fn last_replay(&self) -> ReplayTimes {
        #[cfg(feature = "cuda")]
        {
            self.inner.last
        }
        #[cfg(not(feature = "cuda"))]
        {
            ReplayTimes::default()
        }
    }

    /// Writes the step's values, launches the graph, reads the result back and waits for it.
    pub fn replay(&mut self, replay: Replay<'_>) -> Result<(), GraphError> {
        for (buffer, bytes) in replay.writes {
            if bytes.len() > buffer.bytes {
                return Err(GraphError::Unsupported(format!(
                    "{} bytes written into a step buffer of {}",
                    bytes.len(),
                    buffer.bytes
                )));
            }
        }
        if let Some((buffer, out)) = &replay.read {
            if out.len() > buffer.bytes {
                return Err(GraphError::Unsupported(format!(
                    "{} bytes read from a step buffer of {}",
                    out.len(),
                    buffer.bytes
                )));
            }
        }
        #[cfg(feature = "cuda")]
        {
            let writes: Vec<_> = replay.writes.iter().map(|(b, bytes)| (&b.inner, *bytes)).collect();
            self.inner.replay(&writes, replay.read.map(|(buffer, out)| (&buffer.inner, out)))
        }
        #[cfg(not(feature = "cuda"))]
        {
            Err(GraphError::NotCuda("built without the `cuda` feature".into()))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Outside a recording, `arg` keeps nothing and `launched` records nothing.
    #[test]
    fn no_session_no_state() {
        assert!(!recording());
        launched();
        unsupported(|| "ignored".into());
        assert!(!recording());
        SESSION.with(|s| assert!(s.borrow().is_none()));
    }

    /// The argument bookkeeping groups handles per launch, in order.
    #[test]
    fn session_groups_handles_per_launch() {
        use cubecl::server::Handle;
        use cubecl::stream_id::StreamId;
        SESSION.with(|s| *s.borrow_mut() = Some(Session::default()));
        let stream = StreamId::current();
        let handles: Vec<Handle> = (0..3).map(|i| Handle::new(stream, 16 * (i + 1))).collect();
        SESSION.with(|s| s.borrow_mut().as_mut().map(|s| s.pending.extend(handles[..2].iter().cloned())));
        launched();
        SESSION.with(|s| s.borrow_mut().as_mut().map(|s| s.pending.push(handles[2].clone())));
        launched();
        unsupported(|| "first".into());
        unsupported(|| "second".into());
        let session = SESSION.with(|s| s.borrow_mut().take()).expect("session");
        let sizes: Vec<Vec<u64>> = session.launches.iter().map(|l| l.iter().map(Handle::size).collect()).collect();
        assert_eq!(sizes, vec![vec![16, 32], vec![48]]);
        assert_eq!(session.unsupported.as_deref(), Some("first"));
    }
}
