//! Sums over the GPUs of one host, for tensor parallelism: CubeCL 0.10's NCCL all-reduce
//! (CUDA), which runs on each device's communication stream ordered after the compute stream's
//! work and before what the compute stream does next, with no host synchronization.

use burn::tensor::{Tensor, TensorPrimitive};
use burn_cubecl::{tensor::CubeTensor, BoolElement, CubeBackend, FloatElement, IntElement};
use cubecl::{cuda::CudaRuntime, server::ReduceOperation};

/// The CUDA backend's tensors, whatever its element types.
type Cuda<F, I, BT> = CubeBackend<CudaRuntime, F, I, BT>;

/// Whether NCCL's library (`libnccl.so`) can be loaded; CubeCL's all-reduce fails the device's
/// thread without it, so callers check first.
pub fn nccl_available() -> bool {
    // SAFETY: loading a library by name runs its initializers only; NCCL's have no
    // preconditions.
    unsafe { cudarc::nccl::sys::is_culib_present() }
}

/// The sum of `x` over `devices` (each of which must call this with a tensor of the same shape
/// and dtype, in the same order of collective calls), in place where `x` owns its memory.
/// The first call on a set of devices creates their NCCL communicator, which waits until every
/// device has made its first call: one host thread per device, or calls on every device before
/// waiting for any result.
pub fn all_reduce_sum<F, I, BT, const D: usize>(
    x: Tensor<Cuda<F, I, BT>, D>,
    devices: &[cubecl::cuda::CudaDevice],
) -> Tensor<Cuda<F, I, BT>, D>
where
    F: FloatElement,
    I: IntElement,
    BT: BoolElement,
{
    if crate::graph::recording() {
        // The recording is not replayable anyway; the other devices are not recording with it.
        crate::graph::unsupported(|| "a tensor-parallel all-reduce (NCCL) inside a recorded step".into());
        return x;
    }
    let t: CubeTensor<CudaRuntime> = x.into_primitive().tensor();
    // NCCL writes the sum over the input: a buffer of our own, contiguous.
    let t = if t.handle.can_mut() && t.is_contiguous() { t } else { t.copy() };
    let ids = devices.iter().map(cubecl::device::Device::to_id).collect();
    let mut client = t.client.clone();
    client.all_reduce(t.handle.clone(), t.handle.clone(), t.dtype.into(), ids, ReduceOperation::Sum);
    client.sync_collective();
    Tensor::from_primitive(TensorPrimitive::Float(t))
}
