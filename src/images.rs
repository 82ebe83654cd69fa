//! Pictures for the vision towers: decoded (PNG, JPEG, WebP, GIF), checked, converted to RGB,
//! resized to the tower's square and normalized as HF's `Gemma3ImageProcessor` does (bilinear
//! resampling, `x / 255`, then `(x - 0.5) / 0.5`), channel-major, with its pan-and-scan crops
//! where asked ([`PanAndScan`]); or cut into patches within a soft-token budget as HF's
//! `Gemma4ImageProcessor` does ([`PatchGrid`]).

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
    #[error("this model reads no images (load a multimodal Gemma 3 or Gemma 4 checkpoint and its vision tower)")]
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
        Self::from_image(&read_image(path)?, size)
    }

    /// Decodes and prepares an encoded picture (PNG, JPEG, WebP or GIF) for a tower of `size`
    /// pixels a side.
    pub fn from_bytes(bytes: &[u8], size: usize) -> Result<Self, ImageError> {
        Self::from_image(&decode_image(bytes)?, size)
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

/// Gemma 3's pan-and-scan (HF's `Gemma3ImageProcessor` with `do_pan_and_scan`): a picture
/// much wider than tall (or taller than wide) is also read as a few crops side by side, each
/// resized to the tower's square, so that its detail is not lost in one small square. The
/// defaults are HF's `Gemma3Processor` defaults.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PanAndScan {
    /// Smallest side a crop may have, in pixels of the original picture.
    pub min_crop_size: usize,
    /// Most crops of one picture.
    pub max_num_crops: usize,
    /// Crops are made from this ratio of the long side to the short one on.
    pub min_ratio_to_activate: f64,
}

impl Default for PanAndScan {
    fn default() -> Self {
        Self { min_crop_size: 256, max_num_crops: 4, min_ratio_to_activate: 1.2 }
    }
}

/// A rectangle of a picture: `(x, y, width, height)` in pixels.
pub type Crop = (u32, u32, u32, u32);

impl PanAndScan {
    /// Fails for a rule that cannot make crops as HF's does (fewer than 2 at most, or a ratio
    /// under 1).
    pub fn check(&self) -> Result<(), ImageError> {
        match self.max_num_crops >= 2 && self.min_ratio_to_activate.is_finite() && self.min_ratio_to_activate >= 1.0 {
            true => Ok(()),
            false => Err(ImageError::VisionMismatch(format!(
                "pan-and-scan makes 2 or more crops from a ratio of 1 or more; got {self:?}"
            ))),
        }
    }

    /// The crops of a `width` x `height` picture, left to right then top to bottom: none where
    /// the picture is not elongated enough or the crops would be smaller than
    /// [`PanAndScan::min_crop_size`]; else 2 to [`PanAndScan::max_num_crops`] of them along the
    /// long side, as many as the aspect ratio rounded (the last one cut at the picture's edge).
    pub fn crops(&self, width: u32, height: u32) -> Vec<Crop> {
        let wide = width >= height;
        let (long, short) = if wide { (width, height) } else { (height, width) };
        let ratio = f64::from(long) / f64::from(short);
        if short == 0 || ratio < self.min_ratio_to_activate {
            return Vec::new();
        }
        let ideal = (ratio + 0.5).floor() as usize;
        let fits = (f64::from(long) / self.min_crop_size.max(1) as f64).floor() as usize;
        let n = ideal.min(fits).max(2).min(self.max_num_crops);
        let (across, down) = if wide { (n, 1) } else { (1, n) };
        let crop_w = width.div_ceil(across as u32);
        let crop_h = height.div_ceil(down as u32);
        if (crop_w.min(crop_h) as usize) < self.min_crop_size {
            return Vec::new();
        }
        let mut crops = Vec::with_capacity(across * down);
        for row in 0..down as u32 {
            for col in 0..across as u32 {
                let (x, y) = (col * crop_w, row * crop_h);
                if x < width && y < height {
                    crops.push((x, y, crop_w.min(width - x), crop_h.min(height - y)));
                }
            }
        }
        crops
    }
}

impl Pixels {
    /// The picture and its pan-and-scan crops (`rule`; none where it makes none), each
    /// prepared for a tower of `size` pixels a side.
    pub fn pan_and_scan(image: &DynamicImage, size: usize, rule: &PanAndScan) -> Result<(Self, Vec<Self>), ImageError> {
        let whole = Self::from_image(image, size)?;
        let crops = rule
            .crops(image.width(), image.height())
            .into_iter()
            .map(|(x, y, w, h)| Self::from_image(&image.crop_imm(x, y, w, h), size))
            .collect::<Result<_, _>>()?;
        Ok((whole, crops))
    }
}

/// Reads and decodes the picture at `path` ([`decode_image`]).
pub fn read_image(path: impl AsRef<Path>) -> Result<DynamicImage, ImageError> {
    let path = path.as_ref();
    let bytes = std::fs::read(path).map_err(|source| ImageError::Io { path: path.display().to_string(), source })?;
    decode_image(&bytes)
}

/// A picture's width and height, read from its header alone (nothing decoded): what a server
/// checks against its limits before decoding.
pub fn image_dimensions(bytes: &[u8]) -> Result<(u32, u32), ImageError> {
    ImageReader::new(Cursor::new(bytes))
        .with_guessed_format()
        .map_err(|e| ImageError::Decode(e.to_string()))?
        .into_dimensions()
        .map_err(|e| ImageError::Decode(e.to_string()))
}

/// Decodes an encoded picture (PNG, JPEG, WebP or GIF), refusing empty and oversized ones before
/// their pixels are allocated.
pub fn decode_image(bytes: &[u8]) -> Result<DynamicImage, ImageError> {
    if bytes.is_empty() {
        return Err(ImageError::Decode("no bytes".into()));
    }
    let reader =
        ImageReader::new(Cursor::new(bytes)).with_guessed_format().map_err(|e| ImageError::Decode(e.to_string()))?;
    if reader.format().is_none() {
        return Err(ImageError::Decode("not a PNG, JPEG, WebP or GIF picture".into()));
    }
    let (width, height) = image_dimensions(bytes)?;
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

/// How Gemma 4's image processor sizes a picture: patches of `patch_size` pixels a side, pooled
/// `pooling_kernel_size` a side into one soft token, at most `max_soft_tokens` soft tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PatchBudget {
    pub patch_size: usize,
    pub pooling_kernel_size: usize,
    pub max_soft_tokens: usize,
}

impl PatchBudget {
    /// HF 5.23's `Gemma4ImageProcessor` defaults for a tower of `patch_size` and
    /// `pooling_kernel_size`: 280 soft tokens.
    pub fn new(patch_size: usize, pooling_kernel_size: usize) -> Self {
        Self { patch_size, pooling_kernel_size, max_soft_tokens: 280 }
    }

    /// The size a `height` x `width` picture is resized to (HF's
    /// `get_aspect_ratio_preserving_size`): the largest of the same aspect ratio within the
    /// budget whose sides are multiples of `pooling_kernel_size * patch_size`; a side that would
    /// round to nothing takes one multiple, and the other its aspect ratio's (at most the
    /// budget's longest side).
    pub fn target_size(&self, height: usize, width: usize) -> Result<(usize, usize), ImageError> {
        let (p, k) = (self.patch_size, self.pooling_kernel_size);
        let sizes = [(p, 1 << 10), (k, 1 << 6), (self.max_soft_tokens, 1 << 16)];
        if sizes.iter().any(|&(v, most)| v == 0 || v > most) {
            return Err(ImageError::VisionMismatch(format!(
                "a patch budget out of range ({self:?}: patches of 1 to 1,024 pixels, pooled 1 to 64 a side, 1 to \
                 65,536 soft tokens)"
            )));
        }
        if height == 0 || width == 0 {
            return Err(ImageError::Empty { width: width as u32, height: height as u32 });
        }
        let max_patches = self.max_soft_tokens * k * k;
        let target_px = (max_patches * p * p) as f64;
        let factor = (target_px / (height * width) as f64).sqrt();
        let side = k * p;
        let mut target_height = (factor * height as f64 / side as f64).floor() as usize * side;
        let mut target_width = (factor * width as f64 / side as f64).floor() as usize * side;
        let longest = (max_patches / (k * k)) * side;
        match (target_height, target_width) {
            (0, 0) => return Err(ImageError::VisionMismatch(format!("{width}x{height} resizes to nothing"))),
            (0, _) => {
                target_height = side;
                target_width = (width / height * side).min(longest);
            }
            (_, 0) => {
                target_width = side;
                target_height = (height / width * side).min(longest);
            }
            _ => {}
        }
        if (target_height * target_width) as f64 > target_px {
            return Err(ImageError::VisionMismatch(format!(
                "{width}x{height} resizes to {target_width}x{target_height}, past {max_patches} patches of {p}x{p}"
            )));
        }
        Ok((target_height, target_width))
    }
}

/// A picture ready for Gemma 4's vision tower ([`burn_gemma_model::Gemma4Vision`]): resized as
/// [`PatchBudget::target_size`] says (bicubic), `x / 255`, cut into `rows x cols` patches of
/// `patch_size` pixels a side; `values` is `[rows * cols, patch_size^2 * 3]` (each patch's pixels
/// row by row, a pixel's channels together), as HF's `Gemma4ImageProcessor` lays them out.
#[derive(Debug, Clone, PartialEq)]
pub struct PatchGrid {
    pub rows: usize,
    pub cols: usize,
    pub patch_size: usize,
    pub values: Vec<f32>,
}

impl PatchGrid {
    /// Reads and prepares the picture at `path`.
    pub fn from_path(path: impl AsRef<Path>, budget: PatchBudget) -> Result<Self, ImageError> {
        Self::from_image(&read_image(path)?, budget)
    }

    /// Decodes and prepares an encoded picture (PNG, JPEG, WebP or GIF).
    pub fn from_bytes(bytes: &[u8], budget: PatchBudget) -> Result<Self, ImageError> {
        Self::from_image(&decode_image(bytes)?, budget)
    }

    /// Prepares a decoded picture.
    pub fn from_image(image: &DynamicImage, budget: PatchBudget) -> Result<Self, ImageError> {
        let (width, height) = (image.width() as usize, image.height() as usize);
        let (target_height, target_width) = budget.target_size(height, width)?;
        let rgb = image.to_rgb8();
        let resized = bicubic_8bit(rgb.as_raw(), (width, height), (target_width, target_height));
        let p = budget.patch_size;
        let (rows, cols) = (target_height / p, target_width / p);
        let mut values = Vec::with_capacity(rows * cols * p * p * 3);
        for row in 0..rows {
            for col in 0..cols {
                for y in 0..p {
                    let at = ((row * p + y) * target_width + col * p) * 3;
                    values.extend(resized[at..at + p * 3].iter().map(|&c| f32::from(c) / 255.0));
                }
            }
        }
        Ok(Self { rows, cols, patch_size: p, values })
    }

    /// The patches on `device`, as the tower takes them.
    pub fn to_patches<B: burn_gemma_kernels::GemmaBackend>(
        &self,
        device: &B::Device,
    ) -> burn_gemma_model::Gemma4Patches<B> {
        let width = self.patch_size * self.patch_size * 3;
        let values = Tensor::from_data(TensorData::new(self.values.clone(), [self.rows * self.cols, width]), device);
        burn_gemma_model::Gemma4Patches { values, rows: self.rows, cols: self.cols }
    }
}

/// Bits of the fixed-point resampling weights (PIL's 8-bit resampler: 32 bits less the 8 of a
/// value and two of headroom).
const WEIGHT_BITS: u32 = 22;

/// Keys' cubic with `a = -0.5` (PIL's `BICUBIC`), support 2.
fn cubic(x: f64) -> f64 {
    let a = -0.5;
    let x = x.abs();
    if x < 1.0 {
        ((a + 2.0) * x - (a + 3.0)) * x * x + 1.0
    } else if x < 2.0 {
        (((x - 5.0) * x + 8.0) * x - 4.0) * a
    } else {
        0.0
    }
}

/// For each of `out` positions along an axis of `size` inputs: the first input it reads and its
/// fixed-point weights (the kernel widened by the scale when shrinking, normalized over the
/// inputs inside the picture).
fn axis_weights(size: usize, out: usize) -> Vec<(usize, Vec<i64>)> {
    let scale = size as f64 / out as f64;
    let widen = scale.max(1.0);
    let support = 2.0 * widen;
    (0..out)
        .map(|o| {
            let center = (o as f64 + 0.5) * scale;
            let first = ((center - support + 0.5).trunc().max(0.0)) as usize;
            let last = ((center + support + 0.5).trunc() as usize).min(size);
            let weights: Vec<f64> = (first..last).map(|i| cubic((i as f64 - center + 0.5) / widen)).collect();
            let total: f64 = weights.iter().sum();
            let one = f64::from(1u32 << WEIGHT_BITS);
            let fixed = weights
                .iter()
                .map(|w| {
                    let w = if total != 0.0 { w / total } else { *w };
                    // Rounded half away from zero, as PIL does.
                    (w * one + if w < 0.0 { -0.5 } else { 0.5 }).trunc() as i64
                })
                .collect();
            (first, fixed)
        })
        .collect()
}

/// One pass over interleaved RGB rows: `lines` lines of `len` pixels, `stride` bytes between
/// consecutive pixels of a line and `pitch` between lines, resampled along the line.
fn resample_pass(
    src: &[u8],
    (lines, len): (usize, usize),
    (stride, pitch): (usize, usize),
    weights: &[(usize, Vec<i64>)],
    (out_stride, out_pitch): (usize, usize),
    out: &mut [u8],
) {
    let half = 1i64 << (WEIGHT_BITS - 1);
    for line in 0..lines {
        for (o, (first, w)) in weights.iter().enumerate() {
            for c in 0..3 {
                let mut sum = half;
                for (j, &k) in w.iter().enumerate() {
                    debug_assert!(first + j < len);
                    sum += i64::from(src[line * pitch + (first + j) * stride + c]) * k;
                }
                out[line * out_pitch + o * out_stride + c] = (sum >> WEIGHT_BITS).clamp(0, 255) as u8;
            }
        }
    }
}

/// `rgb` (`width x height` interleaved RGB) resized to `to` as PIL's `Image.resize(...,
/// BICUBIC)` does: a horizontal pass then a vertical one, each rounding to 8 bits, with
/// fixed-point weights. Written here rather than taken from the `image` crate, whose f32
/// Catmull-Rom resampling came out up to 17 levels from PIL's when enlarging the fixture's
/// 37x23 picture, while HF's Gemma 4 processor is PIL's (checked equal to 6e-8).
fn bicubic_8bit(rgb: &[u8], (width, height): (usize, usize), (to_width, to_height): (usize, usize)) -> Vec<u8> {
    if (width, height) == (to_width, to_height) {
        return rgb.to_vec();
    }
    // Horizontal pass: every line of the picture to the new width.
    let mut wide = vec![0u8; to_width * height * 3];
    if to_width == width {
        wide.copy_from_slice(rgb);
    } else {
        let weights = axis_weights(width, to_width);
        resample_pass(rgb, (height, width), (3, width * 3), &weights, (3, to_width * 3), &mut wide);
    }
    if to_height == height {
        return wide;
    }
    // Vertical pass: every column of the new width to the new height.
    let mut out = vec![0u8; to_width * to_height * 3];
    let weights = axis_weights(height, to_height);
    resample_pass(&wide, (to_width, height), (to_width * 3, 3), &weights, (to_width * 3, 3), &mut out);
    out
}
