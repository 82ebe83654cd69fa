//! The collectives between CUDA devices of one host: NCCL, through CubeCL 0.10's all-reduce
//! when run eagerly (the comm stream of each device, ordered after and before its compute
//! stream's work without the host waiting), and recorded into each device's decode graph
//! otherwise (see `burn_gemma_kernels::collective`).

use super::{AllReduce, AllReduces, ShardedModel};
use crate::{backends::Cuda, Checkpoint, Error, LoadOptions};
use burn::{backend::cuda::CudaDevice, tensor::Tensor};
use burn_gemma_kernels::collective::{self, CollectiveError, NcclGroup};
use burn_gemma_model::ModelError;
use std::sync::Arc;

/// One device's handle on the NCCL collectives among a group of devices (the same group, in
/// the same order, on every shard).
#[derive(Debug, Clone)]
pub struct NcclAllReduce {
    group: Arc<NcclGroup>,
}

impl NcclAllReduce {
    /// Handles for `devices` (rank order), one per device, once NCCL's library is found.
    pub fn group(devices: &[CudaDevice]) -> Result<AllReduces<Cuda>, Error> {
        let group = NcclGroup::new(devices).map_err(refused)?;
        let handle = Self { group };
        Ok(devices.iter().map(|_| Arc::new(handle.clone()) as Arc<dyn AllReduce<Cuda>>).collect())
    }
}

fn refused(e: CollectiveError) -> ModelError {
    ModelError::TensorParallel(e.to_string())
}

impl AllReduce<Cuda> for NcclAllReduce {
    fn all_reduce(&self, x: Tensor<Cuda, 2>) -> Result<Tensor<Cuda, 2>, ModelError> {
        collective::all_reduce_sum(x, &self.group).map_err(refused)
    }

    fn all_gather(&self, x: Tensor<Cuda, 2>) -> Result<Tensor<Cuda, 2>, ModelError> {
        collective::all_gather(x, &self.group).map_err(refused)
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
