//! Where model weights come from.
//!
//! The model asks for each tensor by its Hugging Face checkpoint name with the shape its config
//! implies; a [`WeightSource`] (safetensors, GGUF, random) produces it on the device in the
//! requested dtype, or says precisely what is wrong.

use crate::{config::NormScale, ModelError};
use burn::tensor::{backend::Backend, DType, Distribution, Tensor};
use burn_gemma_kernels::{GgmlBlocks, HostQuantized, QuantFormat};

/// How weight matrices are kept on the device.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum WeightFormat {
    /// The checkpoint's own format: GGUF block types as the file stores them, which the Candle
    /// backend multiplies as they are; the GPU backends keep Q4_K, Q5_K and Q6_K as they are too
    /// (their bits rearranged for the kernels) and convert the others at load (Q8_0 and Q5_0 to
    /// Q8; Q4_0 and Q4_1 to Q4; other block types requantized to Q8); float tensors dense in
    /// the model dtype.
    #[default]
    Native,
    /// GGUF block types converted at load to the closest of this crate's formats
    /// ([`burn_gemma_kernels::GgmlBlocks::to_quantized`]: Q4_0, Q4_1 and Q4_K to Q4, others to
    /// Q8; float tensors dense): more bytes per decode token than [`WeightFormat::Native`] on a
    /// GPU (Q6_K's 6.56 bits become 8.5, Q4_K's 4.5 become 5), but batches of 3 to 64 rows
    /// multiply those formats on the matrix units without a dense copy of each matrix.
    Converted,
    /// Every matrix quantized to this format (the embedding table at least Q8); matrices
    /// whose rows do not split into 32-wide blocks stay dense in the model dtype, as GGUF
    /// files keep them.
    Quantized(QuantFormat),
    /// Every matrix that [`WeightFormat::Quantized`] would quantize rounded to this format on the
    /// host and kept dense in the model dtype: the model a quantized one computes, with plain
    /// dense products. The reference the quantized kernels are tested against (the quantization
    /// error is in both, the kernels' own error only in the quantized one).
    Dequantized(QuantFormat),
    /// Every matrix dense in the model dtype.
    Dense,
}

impl std::fmt::Display for WeightFormat {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Native => f.write_str("native"),
            Self::Converted => f.write_str("converted"),
            Self::Quantized(q) => write!(f, "{q}"),
            Self::Dequantized(q) => write!(f, "{q}-dequantized"),
            Self::Dense => f.write_str("dense"),
        }
    }
}

/// What a weight is used for; sources that store weights differently per kind (GGUF keeps Gemma
/// 1-3's RMSNorm weights with the `+1` folded in) use it to convert to the Hugging Face
/// convention, and random sources to pick neutral values.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WeightKind {
    /// A matrix multiplied with activations (projections, embeddings).
    Matrix,
    /// An RMSNorm weight, meaning what the architecture's [`NormScale`] says.
    Norm(NormScale),
    /// A multiplier whose neutral value is 1 (Gemma 4's `layer_scalar`, router scales).
    Scale,
    /// Token ids stored as integers (a Gemma 4 assistant's `token_ordering`), loaded as their
    /// exact f32 values (ids below 2^24).
    Indices,
}

/// A provider of named weights.
pub trait WeightSource<B: Backend> {
    /// Loads `name` (HF naming, e.g. `model.layers.0.self_attn.q_proj.weight`) with the HF
    /// `shape`, converted to `dtype`, on `device`. Fails with [`ModelError::MissingTensor`] or
    /// [`ModelError::ShapeMismatch`] when the checkpoint disagrees.
    fn load<const D: usize>(
        &mut self,
        name: &str,
        shape: [usize; D],
        kind: WeightKind,
        dtype: DType,
        device: &B::Device,
    ) -> Result<Tensor<B, D>, ModelError>;

    /// Loads the `[rows, cols]` matrix `name` as consecutive row blocks of at most
    /// `rows_per_chunk` rows, never holding the whole matrix on the device at once (GPU APIs
    /// cap the size of one buffer).
    fn load_row_chunks(
        &mut self,
        name: &str,
        shape: [usize; 2],
        rows_per_chunk: usize,
        dtype: DType,
        device: &B::Device,
    ) -> Result<Vec<Tensor<B, 2>>, ModelError>;

    /// The matrix `name` of checkpoint shape `shape` ([`matrix_dims`]) block-quantized to
    /// `format` on the host. The default reads the dense matrix back from the device and
    /// quantizes it.
    fn load_host_quantized(
        &mut self,
        name: &str,
        shape: &[usize],
        format: QuantFormat,
        device: &B::Device,
    ) -> Result<HostQuantized, ModelError> {
        let dense = load_flat(self, name, shape, DType::F32, device)?;
        let dims = dense.dims();
        quantize(name, &host_values(dense, name)?, dims, format)
    }

    /// The matrix `name` of checkpoint shape `shape` ([`matrix_dims`]) in the checkpoint's own
    /// GGUF block type, as stored; `Ok(None)` where it is stored as floats (the default:
    /// sources without block types).
    fn load_blocks(&mut self, _name: &str, _shape: &[usize]) -> Result<Option<GgmlBlocks>, ModelError> {
        Ok(None)
    }
}

/// The `[rows, cols]` matrix of a checkpoint tensor of shape `shape`: a matrix as it is, or a
/// layer's experts (`[experts, rows, cols]`) as one matrix of `experts * rows` rows, expert `e`
/// at rows `e * rows..`. `None` for other ranks.
pub fn matrix_dims(shape: &[usize]) -> Option<[usize; 2]> {
    match *shape {
        [rows, cols] => Some([rows, cols]),
        [experts, rows, cols] => Some([experts * rows, cols]),
        _ => None,
    }
}

/// The tensor `name` of checkpoint shape `shape` as its `[rows, cols]` matrix ([`matrix_dims`])
/// in `dtype`, dense on the device.
pub(crate) fn load_flat<B: Backend, S: WeightSource<B> + ?Sized>(
    source: &mut S,
    name: &str,
    shape: &[usize],
    dtype: DType,
    device: &B::Device,
) -> Result<Tensor<B, 2>, ModelError> {
    match *shape {
        [rows, cols] => source.load(name, [rows, cols], WeightKind::Matrix, dtype, device),
        [experts, rows, cols] => Ok(source
            .load(name, [experts, rows, cols], WeightKind::Matrix, dtype, device)?
            .reshape([experts * rows, cols])),
        _ => Err(ModelError::InvalidInput(format!("`{name}`: a matrix of shape {shape:?} is neither 2-D nor 3-D"))),
    }
}

/// The values of a device tensor on the host as f32, naming the tensor on failure.
pub(crate) fn host_values<B: Backend, const D: usize>(t: Tensor<B, D>, name: &str) -> Result<Vec<f32>, ModelError> {
    t.into_data().convert::<f32>().into_vec::<f32>().map_err(|e| ModelError::Source(format!("{name}: {e:?}").into()))
}

/// Quantizes host values, naming the tensor in the error.
pub fn quantize(
    name: &str,
    values: &[f32],
    [rows, cols]: [usize; 2],
    format: QuantFormat,
) -> Result<HostQuantized, ModelError> {
    HostQuantized::quantize(values, rows, cols, format)
        .map_err(|source| ModelError::Quantize { name: name.to_string(), source })
}

/// Row ranges of `rows` rows cut into blocks of at most `per_chunk` rows.
pub fn row_chunks(rows: usize, per_chunk: usize) -> impl Iterator<Item = std::ops::Range<usize>> {
    let per_chunk = per_chunk.max(1);
    (0..rows.div_ceil(per_chunk)).map(move |i| i * per_chunk..((i + 1) * per_chunk).min(rows))
}

/// Random weights from a seed (normal, std 0.02; norms and scales neutral), generated on the device: the
/// exact shapes of a config without any file, for tests and synthetic benchmarks.
#[derive(Debug, Clone)]
pub struct RandomWeights {
    state: u64,
}

/// Held while a [`RandomWeights`] matrix seeds the backend's generator and draws from it.
static DRAW: std::sync::Mutex<()> = std::sync::Mutex::new(());

impl RandomWeights {
    /// A source whose tensors are a pure function of `seed` and the request order.
    pub fn new(seed: u64) -> Self {
        Self { state: seed }
    }

    fn next_seed(&mut self) -> u64 {
        // SplitMix64 step.
        self.state = self.state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
}

impl<B: Backend> WeightSource<B> for RandomWeights {
    fn load<const D: usize>(
        &mut self,
        _name: &str,
        shape: [usize; D],
        kind: WeightKind,
        dtype: DType,
        device: &B::Device,
    ) -> Result<Tensor<B, D>, ModelError> {
        let seed = self.next_seed();
        Ok(match kind {
            WeightKind::Norm(NormScale::OnePlusWeight) => Tensor::zeros(shape, (device, DType::F32)),
            WeightKind::Norm(NormScale::Weight) | WeightKind::Scale => Tensor::ones(shape, (device, DType::F32)),
            WeightKind::Matrix => {
                // The backend's generator is one per process: seeding and drawing under one
                // lock keep the draw a function of `seed` while other threads draw too.
                let _draw = DRAW.lock().unwrap_or_else(|e| e.into_inner());
                B::seed(device, seed);
                Tensor::<B, D>::random(shape, Distribution::Normal(0.0, 0.02), device).cast(dtype)
            }
            WeightKind::Indices => {
                // A permutation of `0..n` (Fisher-Yates, drawn from the seed).
                let n = shape.iter().product::<usize>();
                let mut ids: Vec<f32> = (0..n).map(|i| i as f32).collect();
                let mut draws = RandomWeights::new(seed);
                for i in (1..n).rev() {
                    ids.swap(i, (draws.next_seed() % (i as u64 + 1)) as usize);
                }
                Tensor::from_data(burn::tensor::TensorData::new(ids, shape), device)
            }
        })
    }

    fn load_row_chunks(
        &mut self,
        name: &str,
        [rows, cols]: [usize; 2],
        rows_per_chunk: usize,
        dtype: DType,
        device: &B::Device,
    ) -> Result<Vec<Tensor<B, 2>>, ModelError> {
        row_chunks(rows, rows_per_chunk)
            .map(|r| WeightSource::<B>::load(self, name, [r.len(), cols], WeightKind::Matrix, dtype, device))
            .collect()
    }
}
