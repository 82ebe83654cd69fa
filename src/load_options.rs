//! [`LoadOptions`]: how [`crate::Checkpoint::load`] puts a model on a device.

use crate::{GemmaBackend, KvFormat, WeightFormat};
use burn::tensor::DType;
use burn_gemma_kernels::{KernelTuning, PreferredBlocks};
use burn_gemma_model::ModelOptions;

/// How far loading has come: tensors read of the checkpoint's total.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LoadProgress {
    pub loaded: usize,
    pub total: usize,
}

/// The device, dtype, weight format, KV-cache format, kernel tuning and progress callback of a
/// load, each with a default:
///
/// - device: the backend's default device;
/// - dtype: the backend's preferred activation dtype (bf16 on CUDA, f32 elsewhere);
/// - weights: the backend's [`GemmaBackend::preferred_blocks`]: the checkpoint's own format
///   ([`WeightFormat::Native`]) on Candle, GGUF blocks converted to Q8/Q4
///   ([`WeightFormat::Converted`]) on the GPU backends, dense on the plain CPU reference
///   (NdArray);
/// - KV cache: dense in the activation dtype;
/// - tuning: [`KernelTuning::DEFAULT`];
/// - progress: none.
///
/// ```no_run
/// use burn_gemma::{backends::NdArray, Checkpoint, KvFormat, LoadOptions, QuantFormat, WeightFormat};
///
/// # fn main() -> Result<(), burn_gemma::Error> {
/// let checkpoint = Checkpoint::open("gemma-3-270m-q4_k_m.gguf")?;
/// let options = LoadOptions::<NdArray>::new()
///     .weights(WeightFormat::Quantized(QuantFormat::Q8))
///     .kv_cache(KvFormat::Int8)
///     .progress(|p| eprint!("\r{}/{} tensors", p.loaded, p.total));
/// let loaded = checkpoint.load(options)?;
/// # Ok(()) }
/// ```
pub struct LoadOptions<B: GemmaBackend> {
    device: B::Device,
    dtype: Option<DType>,
    weights: Option<WeightFormat>,
    kv_cache: Option<KvFormat>,
    tuning: KernelTuning,
    progress: Option<ProgressFn>,
}

/// A load's progress callback.
pub(crate) type ProgressFn = Box<dyn FnMut(LoadProgress) + Send>;

impl<B: GemmaBackend> Default for LoadOptions<B> {
    fn default() -> Self {
        Self {
            device: Default::default(),
            dtype: None,
            weights: None,
            kv_cache: None,
            tuning: KernelTuning::DEFAULT,
            progress: None,
        }
    }
}

impl<B: GemmaBackend> std::fmt::Debug for LoadOptions<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LoadOptions")
            .field("device", &self.device)
            .field("dtype", &self.dtype)
            .field("weights", &self.weights)
            .field("kv_cache", &self.kv_cache)
            .field("tuning", &self.tuning)
            .field("progress", &self.progress.is_some())
            .finish()
    }
}

impl<B: GemmaBackend> LoadOptions<B> {
    /// Every option at its default.
    pub fn new() -> Self {
        Self::default()
    }

    /// The device to load onto.
    pub fn device(mut self, device: B::Device) -> Self {
        self.device = device;
        self
    }

    /// The activation dtype (and that of dense weights): f32, f16 or bf16.
    pub fn dtype(mut self, dtype: DType) -> Self {
        self.dtype = Some(dtype);
        self
    }

    /// How weight matrices are kept on the device.
    pub fn weights(mut self, weights: WeightFormat) -> Self {
        self.weights = Some(weights);
        self
    }

    /// How the KV cache stores keys and values.
    pub fn kv_cache(mut self, kv_cache: KvFormat) -> Self {
        self.kv_cache = Some(kv_cache);
        self
    }

    /// How the GPU kernels are chosen and launched ([`KernelTuning::DEFAULT`]: the measured
    /// fastest). The text model's passes run with it ([`crate::Gemma::set_tuning`] changes it
    /// later). Vision towers and the speculative assistant always run with the default.
    pub fn tuning(mut self, tuning: KernelTuning) -> Self {
        self.tuning = tuning;
        self
    }

    /// Called after each tensor is read.
    pub fn progress(mut self, progress: impl FnMut(LoadProgress) + Send + 'static) -> Self {
        self.progress = Some(Box::new(progress));
        self
    }

    /// The device the model goes to.
    pub fn device_ref(&self) -> &B::Device {
        &self.device
    }

    /// The model options these resolve to on backend `B`.
    pub fn model_options(&self) -> ModelOptions {
        let dtype = self.dtype.unwrap_or_else(|| B::preferred_dtype(&self.device));
        let weights = self.weights.unwrap_or(match B::preferred_blocks() {
            PreferredBlocks::Native => WeightFormat::Native,
            PreferredBlocks::Converted => WeightFormat::Converted,
            PreferredBlocks::Dense => WeightFormat::Dense,
        });
        ModelOptions { dtype, weights, kv_cache: self.kv_cache }
    }

    /// Splits off the device, the tuning and the progress callback.
    pub(crate) fn into_parts(self) -> LoadParts<B> {
        let options = self.model_options();
        LoadParts { options, device: self.device, tuning: self.tuning, progress: self.progress }
    }
}

/// [`LoadOptions`] taken apart for a loader.
pub(crate) struct LoadParts<B: GemmaBackend> {
    pub(crate) options: ModelOptions,
    pub(crate) device: B::Device,
    pub(crate) tuning: KernelTuning,
    pub(crate) progress: Option<ProgressFn>,
}
