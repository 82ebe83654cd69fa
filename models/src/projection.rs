//! Bias-free linear projections as checkpoints store them (`weight` `[out, in]`), loaded as
//! dense or block-quantized [`Matrix`]es.

use crate::{
    weights::{load_flat, WeightFormat, WeightSource},
    ModelError,
};
use burn::{
    module::Module,
    tensor::{DType, Tensor, TensorData},
};
use burn_gemma_kernels::{
    quant::BLOCK, Epilogue, GemmaBackend, GgmlBlocks, HostMatrix, HostQuantized, Matrix, QuantFormat,
};

/// How the model's weights are loaded: the activation/dense dtype and the matrix format.
#[derive(Debug, Clone, Copy)]
pub struct WeightSettings {
    pub dtype: DType,
    pub format: WeightFormat,
}

impl WeightSettings {
    /// The block format a matrix of `cols` columns is read in, `None` for dense: rows that do
    /// not split into [`BLOCK`]-wide blocks stay dense (as in GGUF files).
    fn blocks(&self, cols: usize) -> Option<BlockRequest> {
        if !cols.is_multiple_of(BLOCK) {
            return None;
        }
        match self.format {
            WeightFormat::Native | WeightFormat::Converted => Some(BlockRequest::Native),
            WeightFormat::Quantized(q) | WeightFormat::Dequantized(q) => Some(BlockRequest::Format(q)),
            WeightFormat::Dense => None,
        }
    }

    /// The block format of an embedding table of `cols` columns: at least Q8 (the main table
    /// feeds both ends of the model).
    pub(crate) fn table_blocks(&self, cols: usize) -> Option<BlockRequest> {
        self.blocks(cols).map(|request| match request {
            BlockRequest::Native => BlockRequest::Native,
            BlockRequest::Format(_) => BlockRequest::Format(QuantFormat::Q8),
        })
    }
}

impl WeightSettings {
    /// A matrix quantized on the host as this format keeps it: quantized, or for
    /// [`WeightFormat::Dequantized`] its dequantized values dense in the model dtype.
    pub(crate) fn keep<B: GemmaBackend>(&self, host: HostQuantized, device: &B::Device) -> HostMatrix<B> {
        match self.format {
            WeightFormat::Dequantized(_) => {
                let shape = [host.rows, host.cols];
                let values = TensorData::new(host.dequantize(), shape);
                HostMatrix::Dense(Tensor::<B, 2>::from_data(values, (device, DType::F32)).cast(self.dtype))
            }
            _ => HostMatrix::Quantized(host),
        }
    }
}

impl WeightSettings {
    /// A checkpoint's own blocks as this format keeps them: as they are, or for
    /// [`WeightFormat::Converted`] in the closest of this crate's formats.
    pub(crate) fn native<B: GemmaBackend>(&self, blocks: GgmlBlocks, name: &str) -> Result<HostMatrix<B>, ModelError> {
        match self.format {
            WeightFormat::Converted => blocks
                .to_quantized()
                .map(HostMatrix::Quantized)
                .map_err(|source| ModelError::Quantize { name: name.to_string(), source }),
            _ => Ok(HostMatrix::Ggml(blocks)),
        }
    }
}

/// A block format asked of a [`WeightSource`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum BlockRequest {
    /// The checkpoint's own block type, where it has one ([`WeightSource::load_blocks`]).
    Native,
    /// This format ([`WeightSource::load_host_quantized`]).
    Format(QuantFormat),
}

/// Reads one `[out, in]` matrix (or a layer's experts, `[experts, out, in]`, as one matrix of
/// `experts * out` rows, see [`matrix_dims`]) in the format `settings` asks for.
pub(crate) fn load_matrix<B: GemmaBackend>(
    source: &mut impl WeightSource<B>,
    name: &str,
    shape: &[usize],
    settings: WeightSettings,
    device: &B::Device,
) -> Result<HostMatrix<B>, ModelError> {
    let cols = shape.last().copied().unwrap_or(0);
    match settings.blocks(cols) {
        Some(BlockRequest::Format(format)) => {
            return Ok(settings.keep(source.load_host_quantized(name, shape, format, device)?, device));
        }
        Some(BlockRequest::Native) => {
            if let Some(blocks) = source.load_blocks(name, shape)? {
                return settings.native(blocks, name);
            }
        }
        None => {}
    }
    Ok(HostMatrix::Dense(load_flat(source, name, shape, settings.dtype, device)?))
}

/// [`GemmaBackend::upload_matrix`], naming `name` on failure.
pub(crate) fn upload<B: GemmaBackend>(
    matrix: HostMatrix<B>,
    name: &str,
    device: &B::Device,
) -> Result<Matrix<B>, ModelError> {
    B::upload_matrix(matrix, device).map_err(|source| ModelError::Upload { name: name.to_string(), source })
}

/// Uploads row blocks read in order, joining neighbours stored alike (same block format and
/// width, or both dense) into one matrix; `name` names them in errors.
pub(crate) fn upload_joined<B: GemmaBackend>(
    blocks: Vec<HostMatrix<B>>,
    name: &str,
    device: &B::Device,
) -> Result<Vec<Matrix<B>>, ModelError> {
    enum Group<B: GemmaBackend> {
        Host(HostQuantized),
        Ggml(GgmlBlocks),
        Dense(Vec<Tensor<B, 2>>),
    }
    let mut groups: Vec<Group<B>> = Vec::new();
    for block in blocks {
        match (groups.last_mut(), block) {
            (Some(Group::Host(last)), HostMatrix::Quantized(next)) => {
                if let Err(next) = last.append_rows(next) {
                    groups.push(Group::Host(next));
                }
            }
            (Some(Group::Ggml(last)), HostMatrix::Ggml(next)) => {
                if let Err(next) = last.append_rows(next) {
                    groups.push(Group::Ggml(next));
                }
            }
            (Some(Group::Dense(rows)), HostMatrix::Dense(next)) => rows.push(next),
            (_, HostMatrix::Quantized(next)) => groups.push(Group::Host(next)),
            (_, HostMatrix::Ggml(next)) => groups.push(Group::Ggml(next)),
            (_, HostMatrix::Dense(next)) => groups.push(Group::Dense(vec![next])),
        }
    }
    groups
        .into_iter()
        .map(|group| match group {
            Group::Host(host) => upload(HostMatrix::Quantized(host), name, device),
            Group::Ggml(blocks) => upload(HostMatrix::Ggml(blocks), name, device),
            Group::Dense(rows) => upload(HostMatrix::Dense(Tensor::cat(rows, 0)), name, device),
        })
        .collect()
}

/// One or more checkpoint projections that read the same input (q|k|v, gate|up), their outputs
/// side by side, as one matrix: matrices stored alike are joined row-wise, and blocks stored
/// differently are kept as a [`Matrix::Stacked`], so that every projection is one product.
#[derive(Module, Debug)]
pub struct Projection<B: GemmaBackend> {
    /// `[out, in]`: the checkpoint matrices' rows, in order.
    pub weight: Matrix<B>,
}

impl<B: GemmaBackend> Projection<B> {
    /// Loads the checkpoint matrices `{name}.weight` (`[out, inp]` each, in the order given) as
    /// one projection whose output is theirs side by side.
    pub(crate) fn load(
        source: &mut impl WeightSource<B>,
        names: &[(&str, usize)],
        inp: usize,
        settings: WeightSettings,
        device: &B::Device,
    ) -> Result<Self, ModelError> {
        let blocks = names
            .iter()
            .map(|&(name, out)| load_matrix(source, &format!("{name}.weight"), &[out, inp], settings, device))
            .collect::<Result<Vec<_>, _>>()?;
        let joined: Vec<&str> = names.iter().map(|&(name, _)| name).collect();
        Self::joined(blocks, &joined.join(" | "), device)
    }

    /// The projection of matrices already read, in order (`name` names them in errors).
    pub(crate) fn joined(blocks: Vec<HostMatrix<B>>, name: &str, device: &B::Device) -> Result<Self, ModelError> {
        Ok(Self { weight: Matrix::stacked(upload_joined(blocks, name, device)?) })
    }

    /// `[batch, seq, in]` -> `[batch, seq, out]`.
    pub fn forward(&self, x: Tensor<B, 3>) -> Tensor<B, 3> {
        let [batch, seq, inp] = x.dims();
        let x = x.reshape([batch * seq, inp]);
        let out = B::project(x, &self.weight, Epilogue::Identity);
        let width = out.dims()[1];
        out.reshape([batch, seq, width])
    }

    /// Bytes on the device.
    pub fn device_bytes(&self) -> usize {
        self.weight.device_bytes()
    }
}
