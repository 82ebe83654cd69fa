//! The token embedding table, which is also the tied lm_head (HF's
//! `Gemma3TextScaledWordEmbedding` and `lm_head`).

use crate::{
    projection::{upload, BlockRequest, WeightSettings},
    weights::{row_chunks, WeightSource},
    GemmaConfig, ModelError,
};
use burn::{
    module::Module,
    tensor::{DType, Int, Tensor},
};
use burn_gemma_kernels::{GemmaBackend, GgmlBlocks, HostMatrix, Matrix, QuantFormat};

/// The embedding scale `sqrt(width)`, rounded to the activation dtype as the reference
/// implementation does.
pub(crate) fn embed_scale(width: usize, dtype: DType) -> f64 {
    let scale = (width as f64).sqrt();
    match dtype {
        DType::BF16 => half::bf16::from_f64(scale).to_f64(),
        DType::F16 => half::f16::from_f64(scale).to_f64(),
        _ => scale as f32 as f64,
    }
}

/// The `[vocab, hidden]` embedding table, also the tied lm_head, in row blocks of at most
/// [`burn_gemma_kernels::ReservedMemory::max_buffer_bytes`] (GPU APIs cap the size of one buffer); quantized at least to Q8 (the
/// table feeds both ends of the model), or dense.
#[derive(Module, Debug)]
pub struct Embedding<B: GemmaBackend> {
    pub blocks: Vec<Matrix<B>>,
}

impl<B: GemmaBackend> Embedding<B> {
    const NAME: &'static str = "model.embed_tokens.weight";

    pub(crate) fn load(
        source: &mut impl WeightSource<B>,
        c: &GemmaConfig,
        settings: WeightSettings,
        device: &B::Device,
    ) -> Result<Self, ModelError> {
        Self::load_table(source, Self::NAME, [c.vocab_size, c.hidden_size], settings, device)
    }

    /// The `[rows, cols]` table `name` in row blocks, quantized at least to Q8 where `settings`
    /// asks for blocks.
    pub(crate) fn load_table(
        source: &mut impl WeightSource<B>,
        name: &str,
        shape: [usize; 2],
        settings: WeightSettings,
        device: &B::Device,
    ) -> Result<Self, ModelError> {
        let requantize = |blocks: GgmlBlocks| {
            blocks.to_format(QuantFormat::Q8).map_err(|source| ModelError::Quantize { name: name.to_string(), source })
        };
        let host: Option<HostMatrix<B>> = match settings.table_blocks(shape[1]) {
            None => None,
            Some(BlockRequest::Format(format)) => {
                Some(settings.keep(source.load_host_quantized(name, &shape, format, device)?, device))
            }
            Some(BlockRequest::Native) => match source.load_blocks(name, &shape)? {
                None => None,
                // 4 bits are not enough for a table that feeds both ends of the model: Q8.
                Some(blocks) if blocks.closest_format() == QuantFormat::Q4 => {
                    Some(HostMatrix::Quantized(requantize(blocks)?))
                }
                Some(blocks) => Some(settings.native(blocks, name)?),
            },
        };
        let max_bytes = B::max_buffer_bytes(device);
        let rows_per_chunk = |row_bytes: usize| (max_bytes / row_bytes.max(1)).max(1);
        let blocks = match host {
            Some(HostMatrix::Quantized(host)) => row_chunks(host.rows, rows_per_chunk(host.cols))
                .map(|r| upload(HostMatrix::Quantized(host.rows_slice(r)), name, device))
                .collect::<Result<_, _>>()?,
            Some(HostMatrix::Ggml(host)) => {
                let [rows, _] = host.shape();
                row_chunks(rows, rows_per_chunk(host.bytes().len() / rows.max(1)))
                    .map(|r| upload(HostMatrix::Ggml(host.rows_slice(r)), name, device))
                    .collect::<Result<_, _>>()?
            }
            // Rounded to a block format and kept dense (`WeightFormat::Dequantized`).
            Some(HostMatrix::Dense(table)) => {
                let [rows, cols] = table.dims();
                row_chunks(rows, rows_per_chunk(cols * settings.dtype.size()))
                    .map(|r| upload(HostMatrix::Dense(table.clone().slice([r, 0..cols])), name, device))
                    .collect::<Result<_, _>>()?
            }
            None => {
                let rows_per_chunk = rows_per_chunk(shape[1] * settings.dtype.size());
                let blocks = source.load_row_chunks(name, shape, rows_per_chunk, settings.dtype, device)?;
                blocks.into_iter().map(|b| upload(HostMatrix::Dense(b), name, device)).collect::<Result<_, _>>()?
            }
        };
        Ok(Self { blocks })
    }

    /// `table[ids] * scale` in `dtype`: `[batch, seq]` -> `[batch, seq, hidden]`.
    pub(crate) fn embed(&self, ids: Tensor<B, 2, Int>, scale: f64, dtype: DType) -> Tensor<B, 3> {
        B::embed(&self.blocks, ids, scale, dtype)
    }

    /// `hidden [n, hidden] @ table^T -> [n, vocab]`, one product per row block.
    pub(crate) fn project(&self, hidden: Tensor<B, 2>) -> Tensor<B, 2> {
        burn_gemma_kernels::matrix::project_table(hidden, &self.blocks)
    }

    /// Bytes on the device.
    pub fn device_bytes(&self) -> usize {
        self.blocks.iter().map(Matrix::device_bytes).sum()
    }
}
