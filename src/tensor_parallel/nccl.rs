//! The all-reduce between CUDA devices of one host: NCCL, through CubeCL 0.10's collective
//! operations (the comm stream of each device, ordered after and before its compute stream's
//! work without the host waiting).

use super::{AllReduce, AllReduces, ShardedModel};
use crate::{backends::Cuda, Checkpoint, Error, LoadOptions};
use burn::{backend::cuda::CudaDevice, tensor::Tensor};
use burn_gemma_model::ModelError;
use std::sync::Arc;

/// One device's handle on an NCCL all-reduce among `devices` (the same list, in the same order,
/// on every shard).
#[derive(Debug, Clone)]
pub struct NcclAllReduce {
    devices: Vec<CudaDevice>,
}

impl NcclAllReduce {
    /// Handles for `devices`, one per device, once NCCL's library is found.
    pub fn group(devices: &[CudaDevice]) -> Result<AllReduces<Cuda>, Error> {
        if !burn_gemma_kernels::collective::nccl_available() {
            return Err(ModelError::TensorParallel(
                "NCCL's library (libnccl.so) was not found; install NCCL or put its directory on LD_LIBRARY_PATH"
                    .into(),
            )
            .into());
        }
        let mut ordinals: Vec<usize> = devices.iter().map(|d| d.index).collect();
        ordinals.sort_unstable();
        ordinals.dedup();
        if ordinals.len() != devices.len() {
            return Err(ModelError::TensorParallel(format!("a device is named twice among {ordinals:?}")).into());
        }
        let handle = Self { devices: devices.to_vec() };
        Ok(devices.iter().map(|_| Arc::new(handle.clone()) as Arc<dyn AllReduce<Cuda>>).collect())
    }
}

impl AllReduce<Cuda> for NcclAllReduce {
    fn all_reduce(&self, x: Tensor<Cuda, 2>) -> Result<Tensor<Cuda, 2>, ModelError> {
        Ok(burn_gemma_kernels::collective::all_reduce_sum(x, &self.devices))
    }
}

impl ShardedModel<Cuda> {
    /// [`ShardedModel::load`] over `devices` joined by NCCL.
    pub fn load_nccl(
        checkpoint: &Checkpoint,
        devices: &[CudaDevice],
        options: impl Fn(&CudaDevice) -> LoadOptions<Cuda> + Sync,
    ) -> Result<Self, Error> {
        let reduces = if devices.len() > 1 { NcclAllReduce::group(devices)? } else { Vec::new() };
        Self::load(checkpoint, devices, options, reduces)
    }
}
