//! Collectives over the GPUs of one host, for tensor parallelism (NCCL).
//!
//! Run eagerly, the all-reduce is CubeCL 0.10's: NCCL on each device's communication stream,
//! ordered after the compute stream's work and before what the compute stream does next, with
//! no host synchronization. Inside a step recorded for a CUDA graph ([`crate::graph::record`])
//! a collective is recorded instead, in launch order, and the graph's capture calls NCCL on its
//! own stream with the communicators of an [`NcclGroup`] (CubeCL keeps its communicators inside
//! its server, where a capture cannot name them): NCCL's kernels become nodes of the graph, and
//! every device replays its own graph.
//!
//! This module and `graph` import each other, and must: a collective asks the recorder whether
//! a capture is on and hands it a [`Recorded`] collective, and the recorder's capture runs those
//! collectives with this module's NCCL groups. Splitting either side would only hide the tie.

use burn::tensor::{Tensor, TensorPrimitive};
use burn_cubecl::{tensor::CubeTensor, BoolElement, CubeBackend, FloatElement, IntElement};
use cubecl::{
    cuda::{CudaDevice, CudaRuntime},
    server::ReduceOperation,
};
use cudarc::nccl::{result, sys};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant};

/// The CUDA backend's tensors, whatever its element types.
type Cuda<F, I, BT> = CubeBackend<CudaRuntime, F, I, BT>;

/// Why a collective could not run.
#[derive(Debug, thiserror::Error)]
pub enum CollectiveError {
    /// The tensor is on a device outside the group.
    #[error("CUDA device {device} is not one of the group's devices {group:?}")]
    NotInGroup { device: usize, group: Vec<usize> },
    /// A group of no device, or one naming a device twice.
    #[error("an NCCL group over devices {0:?}: name each device once")]
    BadGroup(Vec<usize>),
    /// NCCL's library is missing, or one of its calls failed.
    #[error("NCCL: {0}")]
    Nccl(String),
    /// The other devices did not come to capture their graphs (their recording failed, or
    /// took longer than the wait).
    #[error("the other devices did not come to capture their graphs within {0:?}")]
    Absent(Duration),
}

/// Whether NCCL's library (`libnccl.so`) can be loaded; CubeCL's all-reduce fails the device's
/// thread without it, so callers check first.
pub fn nccl_available() -> bool {
    // SAFETY: loading a library by name runs its initializers only; NCCL's have no
    // preconditions.
    unsafe { sys::is_culib_present() }
}

/// One NCCL communicator (a device's end of a group).
struct Comm(sys::ncclComm_t);

// SAFETY: an NCCL communicator may be used from any thread, one call at a time; each is used by
// the one thread that captures its device's graph, and destroyed once, on drop.
unsafe impl Send for Comm {}
unsafe impl Sync for Comm {}

/// CUDA devices of one host joined for collectives, in rank order: `devices[r]` is rank `r`.
///
/// Eager collectives go through CubeCL's communicators over the same devices; the group's own
/// NCCL communicators, made the first time a graph is captured, serve the recorded ones.
pub struct NcclGroup {
    devices: Vec<CudaDevice>,
    comms: OnceLock<Result<Vec<Comm>, String>>,
    /// Where the devices' threads meet before their first NCCL kernel of a capture.
    meeting: Mutex<Meeting>,
    arrivals: Condvar,
}

/// The devices met so far in the current meeting, and how many meetings have ended.
#[derive(Debug, Default)]
struct Meeting {
    arrived: usize,
    ended: u64,
}

impl std::fmt::Debug for NcclGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let ordinals: Vec<usize> = self.devices.iter().map(|d| d.index).collect();
        f.debug_struct("NcclGroup").field("devices", &ordinals).finish()
    }
}

impl NcclGroup {
    /// The group of `devices` (rank order), once NCCL's library is found.
    pub fn new(devices: &[CudaDevice]) -> Result<Arc<Self>, CollectiveError> {
        let ordinals: Vec<usize> = devices.iter().map(|d| d.index).collect();
        let mut distinct = ordinals.clone();
        distinct.sort_unstable();
        distinct.dedup();
        if devices.is_empty() || distinct.len() != devices.len() {
            return Err(CollectiveError::BadGroup(ordinals));
        }
        if !nccl_available() {
            return Err(CollectiveError::Nccl(
                "the library (libnccl.so) was not found; install NCCL or put its directory on LD_LIBRARY_PATH".into(),
            ));
        }
        Ok(Arc::new(Self {
            devices: devices.to_vec(),
            comms: OnceLock::new(),
            meeting: Mutex::new(Meeting::default()),
            arrivals: Condvar::new(),
        }))
    }

    /// The devices, in rank order.
    pub fn devices(&self) -> &[CudaDevice] {
        &self.devices
    }

    /// The rank of `device` in the group.
    pub fn rank(&self, device: &CudaDevice) -> Result<usize, CollectiveError> {
        self.devices.iter().position(|d| d.index == device.index).ok_or_else(|| CollectiveError::NotInGroup {
            device: device.index,
            group: self.devices.iter().map(|d| d.index).collect(),
        })
    }

    /// Rank `rank`'s communicator, every rank's made on the first call (`ncclCommInitAll`, from
    /// whichever thread asks first; the others wait for it).
    pub(crate) fn comm(&self, rank: usize) -> Result<sys::ncclComm_t, CollectiveError> {
        let comms = self.comms.get_or_init(|| {
            let ordinals: Vec<i32> = self.devices.iter().map(|d| d.index as i32).collect();
            let mut comms: Vec<sys::ncclComm_t> = vec![std::ptr::null_mut(); ordinals.len()];
            // SAFETY: `comms` has room for one communicator per device of `ordinals`.
            unsafe { result::comm_init_all(comms.as_mut_ptr(), ordinals.len() as i32, ordinals.as_ptr()) }
                .map(|_| comms.into_iter().map(Comm).collect())
                .map_err(|e| format!("ncclCommInitAll over devices {ordinals:?} failed: {:?}", e.0))
        });
        match comms {
            Ok(comms) => comms
                .get(rank)
                .map(|c| c.0)
                .ok_or_else(|| CollectiveError::Nccl(format!("no communicator of rank {rank}"))),
            Err(reason) => Err(CollectiveError::Nccl(reason.clone())),
        }
    }

    /// Waits until every device's thread has called this (once each), for at most `wait`.
    ///
    /// A device whose NCCL kernel waits for a peer keeps running, and on devices joined by
    /// peer access an allocation or a module load on the peer may wait for that kernel to
    /// end: a device must not start a collective until every other has finished what
    /// precedes its own (recording, compiling, allocating). A device that never comes (its
    /// recording failed) leaves the others with [`CollectiveError::Absent`], not in a kernel.
    pub(crate) fn meet(&self, wait: Duration) -> Result<(), CollectiveError> {
        let mut meeting = self.meeting.lock().unwrap_or_else(|e| e.into_inner());
        let current = meeting.ended;
        meeting.arrived += 1;
        if meeting.arrived == self.devices.len() {
            meeting.arrived = 0;
            meeting.ended += 1;
            self.arrivals.notify_all();
            return Ok(());
        }
        let deadline = Instant::now() + wait;
        while meeting.ended == current {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                meeting.arrived -= 1;
                return Err(CollectiveError::Absent(wait));
            }
            meeting = self.arrivals.wait_timeout(meeting, left).unwrap_or_else(|e| e.into_inner()).0;
        }
        Ok(())
    }
}

impl Drop for NcclGroup {
    fn drop(&mut self) {
        if let Some(Ok(comms)) = self.comms.get() {
            for comm in comms {
                // SAFETY: made by `ncclCommInitAll`, destroyed once; the graphs that used it hold
                // the group, so none outlives it.
                let _ = unsafe { result::comm_destroy(comm.0) };
            }
        }
    }
}

/// The collective operations the crate records into graphs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Op {
    /// In place: every rank's buffer becomes the elementwise sum of all ranks' buffers.
    AllReduceSum,
    /// Each rank's `count` elements placed at `rank * count` of every rank's output.
    AllGather,
}

/// A collective recorded for a graph: run by the capture, on its stream, in launch order.
pub(crate) struct Recorded {
    pub op: Op,
    pub input: cubecl::server::Handle,
    pub output: cubecl::server::Handle,
    /// Elements of the input.
    pub count: usize,
    pub dtype: sys::ncclDataType_t,
    pub group: Arc<NcclGroup>,
    pub rank: usize,
}

/// NCCL's name of a float dtype.
fn nccl_dtype(dtype: burn::tensor::DType) -> Option<sys::ncclDataType_t> {
    use burn::tensor::DType;
    match dtype {
        DType::F32 => Some(sys::ncclDataType_t::ncclFloat32),
        DType::F16 => Some(sys::ncclDataType_t::ncclFloat16),
        DType::BF16 => Some(sys::ncclDataType_t::ncclBfloat16),
        DType::F64 => Some(sys::ncclDataType_t::ncclFloat64),
        _ => None,
    }
}

/// Records `op` of `input` (on the group's device `rank`) into `output` for the step being
/// recorded, or marks the step unsupported where NCCL cannot take the tensor.
fn record(
    op: Op,
    input: &CubeTensor<CudaRuntime>,
    output: &CubeTensor<CudaRuntime>,
    group: &Arc<NcclGroup>,
    rank: usize,
) {
    let dtype = match (input.is_contiguous(), nccl_dtype(input.dtype)) {
        (true, Some(dtype)) => dtype,
        (false, _) => return crate::graph::unsupported(|| "a tensor-parallel collective of a strided tensor".into()),
        (true, None) => {
            return crate::graph::unsupported(|| format!("a tensor-parallel collective of {:?}", input.dtype));
        }
    };
    crate::graph::collective(Recorded {
        op,
        input: input.handle.clone(),
        output: output.handle.clone(),
        count: input.meta.num_elements(),
        dtype,
        group: group.clone(),
        rank,
    });
}

/// The sum of `x` over the group's devices (each of which must call this with a tensor of the
/// same shape and dtype, in the same order of collective calls), in place where `x` owns its
/// memory. Run eagerly, the first call on a group creates CubeCL's communicator, which waits
/// until every device has made its first call: one host thread per device, or calls on every
/// device before waiting for any result. Inside a recorded step it is recorded instead.
pub fn all_reduce_sum<F, I, BT, const D: usize>(
    x: Tensor<Cuda<F, I, BT>, D>,
    group: &Arc<NcclGroup>,
) -> Result<Tensor<Cuda<F, I, BT>, D>, CollectiveError>
where
    F: FloatElement,
    I: IntElement,
    BT: BoolElement,
{
    let t: CubeTensor<CudaRuntime> = x.into_primitive().tensor();
    let rank = group.rank(&t.device)?;
    if crate::graph::recording() {
        // In place: the recorder keeps the step's handles, so `can_mut` says nothing here; the
        // tensor was handed over, and what the graph reads after this reads the sum.
        record(Op::AllReduceSum, &t, &t, group, rank);
        return Ok(Tensor::from_primitive(TensorPrimitive::Float(t)));
    }
    // NCCL writes the sum over the input: a buffer of our own, contiguous.
    let t = if t.handle.can_mut() && t.is_contiguous() { t } else { t.copy() };
    let ids = group.devices.iter().map(cubecl::device::Device::to_id).collect();
    let mut client = t.client.clone();
    client.all_reduce(t.handle.clone(), t.handle.clone(), t.dtype.into(), ids, ReduceOperation::Sum);
    client.sync_collective();
    Ok(Tensor::from_primitive(TensorPrimitive::Float(t)))
}

/// Every device's `x` (`[rows, cols]`, the same shape on each) stacked in rank order:
/// `[world * rows, cols]`, rank `r`'s rows at `r * rows`. Called like [`all_reduce_sum`].
/// Inside a recorded step it is NCCL's all-gather; eagerly, each device places its rows among
/// zeros and the sum is taken (adding zeros is exact).
pub fn all_gather<F, I, BT>(
    x: Tensor<Cuda<F, I, BT>, 2>,
    group: &Arc<NcclGroup>,
) -> Result<Tensor<Cuda<F, I, BT>, 2>, CollectiveError>
where
    F: FloatElement,
    I: IntElement,
    BT: BoolElement,
{
    let [rows, cols] = x.dims();
    let world = group.devices.len();
    let rank = group.rank(&x.device())?;
    if crate::graph::recording() {
        let t: CubeTensor<CudaRuntime> = x.into_primitive().tensor();
        let out = crate::cube::empty(&t, [world * rows, cols], t.dtype);
        record(Op::AllGather, &t, &out, group, rank);
        return Ok(Tensor::from_primitive(TensorPrimitive::Float(out)));
    }
    let (dtype, device) = (x.dtype(), x.device());
    let placed = Tensor::<Cuda<F, I, BT>, 2>::zeros([world * rows, cols], (&device, dtype))
        .slice_assign([rank * rows..(rank + 1) * rows, 0..cols], x);
    all_reduce_sum(placed, group)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A group of two devices that never touches them (no NCCL call is made).
    fn pair() -> NcclGroup {
        NcclGroup {
            devices: vec![CudaDevice::new(0), CudaDevice::new(1)],
            comms: OnceLock::new(),
            meeting: Mutex::new(Meeting::default()),
            arrivals: Condvar::new(),
        }
    }

    /// Two threads meet, whichever comes first; one alone is told the other is absent and
    /// leaves no arrival behind, so the next meeting of both still works.
    #[test]
    fn devices_meet_or_hear_who_is_absent() {
        let group = pair();
        for round in 0..3 {
            std::thread::scope(|s| {
                let late = s.spawn(|| {
                    std::thread::sleep(Duration::from_millis(10 * round));
                    group.meet(Duration::from_secs(5))
                });
                assert!(group.meet(Duration::from_secs(5)).is_ok(), "round {round}");
                assert!(late.join().expect("joins").is_ok(), "round {round}");
            });
        }
        assert!(matches!(group.meet(Duration::from_millis(20)), Err(CollectiveError::Absent(_))));
        std::thread::scope(|s| {
            let other = s.spawn(|| group.meet(Duration::from_secs(5)));
            assert!(group.meet(Duration::from_secs(5)).is_ok());
            assert!(other.join().expect("joins").is_ok());
        });
        assert_eq!(group.rank(&CudaDevice::new(1)).expect("rank"), 1);
        assert!(matches!(group.rank(&CudaDevice::new(2)), Err(CollectiveError::NotInGroup { device: 2, .. })));
    }
}
