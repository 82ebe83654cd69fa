//! Images in. Gemma 3: HF's `Gemma3Model.get_image_features`, the SigLIP tower and the
//! multimodal projector, giving each image `mm_tokens_per_image` embeddings in the text model's
//! width. The text model places them at the image's soft tokens ([`crate::ImageEmbeds`]), whose
//! positions attend to each other both ways. Gemma 4 ([`gemma4`]): its own tower and embedder,
//! an image's soft tokens as many as its pooled patch grid has cells.

pub mod config;
pub mod gemma4;
pub mod gemma4_config;
pub mod projector;
pub mod siglip;

pub use config::{Gemma3VisionConfig, SiglipConfig};
pub use gemma4::{Gemma4Patches, Gemma4Vision};
pub use gemma4_config::{Gemma4ImageConfig, Gemma4VisionConfig};
pub use projector::Gemma3MultiModalProjector;
pub use siglip::SiglipVisionModel;

use crate::{projection::WeightSettings, weights::WeightSource, ModelError, ModelOptions};
use burn::{module::Module, tensor::Tensor};
use burn_gemma_kernels::GemmaBackend;

/// Gemma 3's vision tower and projector.
#[derive(Module, Debug)]
pub struct Gemma3Vision<B: GemmaBackend> {
    pub vision_tower: SiglipVisionModel<B>,
    pub multi_modal_projector: Gemma3MultiModalProjector<B>,
    #[module(skip)]
    pub config: Gemma3VisionConfig,
}

impl<B: GemmaBackend> Gemma3Vision<B> {
    /// Loads `model.vision_tower.*` and `model.multi_modal_projector.*` (transformers 5.x names;
    /// the checkpoint loader also finds 4.x's `vision_tower.vision_model.*` and
    /// `multi_modal_projector.*`).
    pub fn load(
        config: Gemma3VisionConfig,
        source: &mut impl WeightSource<B>,
        options: &ModelOptions,
        device: &B::Device,
    ) -> Result<Self, ModelError> {
        config.validate()?;
        let settings = WeightSettings { dtype: options.dtype, format: options.weights };
        Ok(Self {
            vision_tower: SiglipVisionModel::load(source, "model.vision_tower", &config.vision, settings, device)?,
            multi_modal_projector: Gemma3MultiModalProjector::load(
                source,
                "model.multi_modal_projector",
                &config,
                options.dtype,
                device,
            )?,
            config,
        })
    }

    /// The config.
    pub fn config(&self) -> &Gemma3VisionConfig {
        &self.config
    }

    /// # Shapes
    /// - `pixels`: `[images, 3, image_size, image_size]`, normalized as the image processor does
    /// - returns `[images, mm_tokens_per_image, text_hidden]`
    pub fn image_features(&self, pixels: Tensor<B, 4>) -> Result<Tensor<B, 3>, ModelError> {
        let [_, channels, height, width] = pixels.dims();
        let size = self.config.vision.image_size;
        if channels != 3 || height != size || width != size {
            return Err(ModelError::InvalidInput(format!(
                "images of [3, {size}, {size}] pixels go into this tower, got [{channels}, {height}, {width}]"
            )));
        }
        Ok(self.multi_modal_projector.forward(self.vision_tower.forward(pixels)?))
    }
}
