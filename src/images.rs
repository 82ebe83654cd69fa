//! Pictures for the vision towers: decoded (PNG, JPEG, WebP, GIF), checked, converted to RGB,
//! resized to the tower's square and normalized as HF's `Gemma3ImageProcessor` does (bilinear
//! resampling, `x / 255`, then `(x - 0.5) / 0.5`), channel-major. Pan-and-scan crops are not
//! made.

use burn::tensor::{backend::Backend, Tensor, TensorData};
use image::{imageops::FilterType, DynamicImage, ImageReader, Limits};
use std::{io::Cursor, path::Path};

/// The largest side a picture may have.
pub const MAX_SIDE: u32 = 16_384;

/// What is wrong with a picture.
#[derive(Debug, thiserror::Error)]
pub enum ImageError {
    #[error("{path}: {source}")]
    Io { path: String, source: std::io::Error },
    /// Not a picture in a format read here, or a damaged one.
    #[error("cannot decode the image: {0}")]
    Decode(String),
    /// A picture of no pixels.
    #[error("the image is empty ({width}x{height})")]
    Empty { width: u32, height: u32 },
    /// Larger than [`MAX_SIDE`] on a side.
    #[error("the image is {width}x{height}; the largest side read is {MAX_SIDE}")]
    TooLarge { width: u32, height: u32 },
    /// An image count that does not match the prompt's image places.
    #[error("{images} images for {places} places in the prompt")]
    Count { images: usize, places: usize },
    /// A vision tower that does not fit the model or tokenizer, or pictures that do not fit it.
    #[error("{0}")]
    VisionMismatch(String),
    /// Images given to a model that reads none.
    #[error("this model reads no images (load a multimodal Gemma 3 checkpoint and its vision tower)")]
    NoVision,
}

/// A picture ready for a vision tower: `[3, size, size]` values in `[-1, 1]`, channel-major.
#[derive(Debug, Clone, PartialEq)]
pub struct Pixels {
    pub size: usize,
    pub values: Vec<f32>,
}

impl Pixels {
    /// Reads and prepares the picture at `path` for a tower of `size` pixels a side.
    pub fn from_path(path: impl AsRef<Path>, size: usize) -> Result<Self, ImageError> {
        let path = path.as_ref();
        let bytes =
            std::fs::read(path).map_err(|source| ImageError::Io { path: path.display().to_string(), source })?;
        Self::from_bytes(&bytes, size)
    }

    /// Decodes and prepares an encoded picture (PNG, JPEG, WebP or GIF) for a tower of `size`
    /// pixels a side.
    pub fn from_bytes(bytes: &[u8], size: usize) -> Result<Self, ImageError> {
        Self::from_image(&decode(bytes)?, size)
    }

    /// Prepares a decoded picture.
    pub fn from_image(image: &DynamicImage, size: usize) -> Result<Self, ImageError> {
        let (width, height) = (image.width(), image.height());
        if width == 0 || height == 0 {
            return Err(ImageError::Empty { width, height });
        }
        let side =
            u32::try_from(size).map_err(|_| ImageError::TooLarge { width: MAX_SIDE + 1, height: MAX_SIDE + 1 })?;
        let rgb = image.to_rgb8();
        let resized = image::imageops::resize(&rgb, side, side, FilterType::Triangle);
        let plane = size * size;
        let mut values = vec![0.0f32; 3 * plane];
        for (i, pixel) in resized.pixels().enumerate() {
            for c in 0..3 {
                values[c * plane + i] = (f32::from(pixel.0[c]) / 255.0 - 0.5) / 0.5;
            }
        }
        Ok(Self { size, values })
    }

    /// `[1, 3, size, size]` on `device`.
    pub fn to_tensor<B: Backend>(&self, device: &B::Device) -> Tensor<B, 4> {
        Tensor::from_data(TensorData::new(self.values.clone(), [1, 3, self.size, self.size]), device)
    }
}

/// Decodes a picture, refusing empty and oversized ones before their pixels are allocated.
fn decode(bytes: &[u8]) -> Result<DynamicImage, ImageError> {
    if bytes.is_empty() {
        return Err(ImageError::Decode("no bytes".into()));
    }
    let reader =
        ImageReader::new(Cursor::new(bytes)).with_guessed_format().map_err(|e| ImageError::Decode(e.to_string()))?;
    if reader.format().is_none() {
        return Err(ImageError::Decode("not a PNG, JPEG, WebP or GIF picture".into()));
    }
    let (width, height) = ImageReader::new(Cursor::new(bytes))
        .with_guessed_format()
        .map_err(|e| ImageError::Decode(e.to_string()))?
        .into_dimensions()
        .map_err(|e| ImageError::Decode(e.to_string()))?;
    if width == 0 || height == 0 {
        return Err(ImageError::Empty { width, height });
    }
    if width > MAX_SIDE || height > MAX_SIDE {
        return Err(ImageError::TooLarge { width, height });
    }
    let mut reader = reader;
    let mut limits = Limits::default();
    limits.max_image_width = Some(MAX_SIDE);
    limits.max_image_height = Some(MAX_SIDE);
    limits.max_alloc = Some(4 * u64::from(MAX_SIDE) * u64::from(MAX_SIDE));
    reader.limits(limits);
    reader.decode().map_err(|e| ImageError::Decode(e.to_string()))
}
