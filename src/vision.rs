//! Pictures in prompts: [`ImageProcessor`] prepares a picture ([`Picture`]) and places it in a
//! prompt as a model's HF processor does (host work, no weights); [`Vision`] is a model's image
//! reader (Gemma 3's SigLIP tower and projector or Gemma 4's tower and embedder) that turns the
//! pictures into the soft tokens' embeddings, for [`crate::Generator::set_vision`] and
//! [`crate::engine::Engine::with_vision`].
//!
//! | | Gemma 3 | Gemma 4 |
//! |---|---|---|
//! | picture | a square of `image_size` pixels ([`Pixels`]) | patches, aspect ratio kept within a soft-token budget ([`PatchGrid`]) |
//! | soft tokens | `mm_tokens_per_image` | `(rows / k) * (cols / k)`, `k` the pooling kernel |
//! | place in a prompt | `<start_of_image>` | `<\|image\|>` |
//! | expanded to | `\n\n<start_of_image>` soft tokens `<end_of_image>\n\n` | `<\|image>` soft tokens `<image\|>` |
//!
//! The expansions are those of HF 5.23's `Gemma3Processor` and `Gemma4Processor`. A Gemma 3
//! picture read with pan-and-scan ([`ImageProcessor::with_pan_and_scan`]) is the whole picture
//! and its crops ([`Picture::Crops`]), each its own run of soft tokens, placed as HF places them
//! ("Here is the original image ... and here are some crops to help you see better ...").

use crate::{
    images::{decode_image, read_image, ImageError, PanAndScan, PatchBudget, PatchGrid, Pixels},
    Error, Gemma3Vision, Gemma4Vision, GemmaBackend, ImageEmbeds, Tokenizer,
};
use burn::tensor::Tensor;
use image::DynamicImage;
use std::path::Path;

/// A picture prepared for one generation's tower.
#[derive(Debug, Clone, PartialEq)]
pub enum Picture {
    /// Gemma 3: resized to the tower's square and normalized.
    Square(Pixels),
    /// Gemma 4: cut into patches on a grid.
    Patches(PatchGrid),
    /// Gemma 3 with pan-and-scan: the whole picture and its crops, each resized to the tower's
    /// square ([`crate::images::PanAndScan`]).
    Crops { whole: Pixels, crops: Vec<Pixels> },
}

impl Picture {
    /// The squares the tower reads, in the order their soft tokens come in a prompt (none for a
    /// patch grid).
    fn squares(&self) -> Vec<&Pixels> {
        match self {
            Self::Square(p) => vec![p],
            Self::Crops { whole, crops } => std::iter::once(whole).chain(crops).collect(),
            Self::Patches(_) => Vec::new(),
        }
    }
}

impl From<Pixels> for Picture {
    fn from(p: Pixels) -> Self {
        Self::Square(p)
    }
}

impl From<PatchGrid> for Picture {
    fn from(p: PatchGrid) -> Self {
        Self::Patches(p)
    }
}

/// The tokens a picture takes in a prompt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ImageTokens {
    /// The soft token the picture's features replace, once for each.
    pub soft: u32,
    /// Before and after the soft tokens.
    pub begin: u32,
    pub end: u32,
}

/// How a model's processor prepares pictures and places them in a prompt: the host's part of
/// reading images, without the tower's weights ([`Vision::processor`]).
#[derive(Debug, Clone, PartialEq)]
pub enum ImageProcessor {
    /// Squares of `image_size` pixels, `soft_tokens` each; with pan-and-scan where set.
    Gemma3 { image_size: usize, soft_tokens: usize, tokens: ImageTokens, pan_and_scan: Option<PanAndScan> },
    /// Patch grids within `budget`, at most `positions` patches a side.
    Gemma4 { budget: PatchBudget, positions: usize, tokens: ImageTokens },
}

impl ImageProcessor {
    /// This Gemma 3 processor reading pictures with pan-and-scan (`Some`) or without; a Gemma 4
    /// processor refuses it (its pictures keep their aspect ratio in a patch grid).
    pub fn with_pan_and_scan(self, rule: Option<PanAndScan>) -> Result<Self, ImageError> {
        match self {
            Self::Gemma3 { image_size, soft_tokens, tokens, .. } => {
                rule.as_ref().map_or(Ok(()), PanAndScan::check)?;
                Ok(Self::Gemma3 { image_size, soft_tokens, tokens, pan_and_scan: rule })
            }
            Self::Gemma4 { .. } if rule.is_some() => Err(ImageError::VisionMismatch(
                "pan-and-scan is Gemma 3's: Gemma 4 keeps a picture's aspect ratio in its patch grid".into(),
            )),
            gemma4 => Ok(gemma4),
        }
    }

    /// Prepares a decoded picture.
    pub fn prepare(&self, image: &DynamicImage) -> Result<Picture, ImageError> {
        match self {
            Self::Gemma3 { image_size, pan_and_scan: None, .. } => Ok(Pixels::from_image(image, *image_size)?.into()),
            Self::Gemma3 { image_size, pan_and_scan: Some(rule), .. } => {
                let (whole, crops) = Pixels::pan_and_scan(image, *image_size, rule)?;
                Ok(match crops.is_empty() {
                    true => whole.into(),
                    false => Picture::Crops { whole, crops },
                })
            }
            Self::Gemma4 { budget, .. } => Ok(PatchGrid::from_image(image, *budget)?.into()),
        }
    }

    /// Reads and prepares the picture at `path` (PNG, JPEG, WebP or GIF).
    pub fn read(&self, path: impl AsRef<Path>) -> Result<Picture, ImageError> {
        self.prepare(&read_image(path)?)
    }

    /// Decodes and prepares an encoded picture (PNG, JPEG, WebP or GIF).
    pub fn decode(&self, bytes: &[u8]) -> Result<Picture, ImageError> {
        self.prepare(&decode_image(bytes)?)
    }

    /// Where a prompt places a picture before expansion (`<start_of_image>` for Gemma 3,
    /// `<|image|>` for Gemma 4).
    pub fn placeholder(&self) -> &'static str {
        match self {
            Self::Gemma3 { .. } => "<start_of_image>",
            Self::Gemma4 { .. } => "<|image|>",
        }
    }

    /// The tokens a picture takes in a prompt.
    pub fn tokens(&self) -> ImageTokens {
        match self {
            Self::Gemma3 { tokens, .. } | Self::Gemma4 { tokens, .. } => *tokens,
        }
    }

    /// The marker tokens' names in the vocabulary (begin, soft, end).
    fn token_names(&self) -> [&'static str; 3] {
        match self {
            Self::Gemma3 { .. } => ["<start_of_image>", "<image_soft_token>", "<end_of_image>"],
            Self::Gemma4 { .. } => ["<|image>", "<|image|>", "<image|>"],
        }
    }

    /// How many soft tokens `picture` takes (a picture with crops: all of its runs together),
    /// or why this model cannot read it.
    pub fn soft_tokens(&self, picture: &Picture) -> Result<usize, ImageError> {
        Ok(self.runs(picture)?.iter().sum())
    }

    /// The runs of soft tokens `picture` takes in a prompt, in order (one, or one for the whole
    /// picture and one for each of its crops), or why this model cannot read it.
    pub fn runs(&self, picture: &Picture) -> Result<Vec<usize>, ImageError> {
        match (self, picture) {
            (Self::Gemma3 { image_size, soft_tokens, .. }, Picture::Square(_) | Picture::Crops { .. }) => {
                let size = *image_size;
                let squares = picture.squares();
                if let Some(p) = squares.iter().find(|p| p.size != size || p.values.len() != 3 * size * size) {
                    return Err(ImageError::VisionMismatch(format!(
                        "pictures for this tower are prepared at {size} pixels a side, got one at {} ({} values)",
                        p.size,
                        p.values.len()
                    )));
                }
                Ok(vec![*soft_tokens; squares.len()])
            }
            (Self::Gemma4 { budget, positions, .. }, Picture::Patches(p)) => {
                let (size, k) = (budget.patch_size, budget.pooling_kernel_size);
                let fits = p.patch_size == size && p.values.len() == p.rows * p.cols * 3 * size * size;
                if !fits || p.rows == 0 || !p.rows.is_multiple_of(k) || !p.cols.is_multiple_of(k) {
                    return Err(ImageError::VisionMismatch(format!(
                        "this tower reads patches of {size} pixels on grids whose sides are multiples of {k}; got a \
                         {} x {} grid of {}-pixel patches ({} values)",
                        p.rows,
                        p.cols,
                        p.patch_size,
                        p.values.len()
                    )));
                }
                if p.rows.max(p.cols) > *positions {
                    return Err(ImageError::VisionMismatch(format!(
                        "a {} x {} patch grid is past the {positions} positions of the tower's table (a smaller \
                         soft-token budget sizes pictures within it)",
                        p.rows, p.cols
                    )));
                }
                Ok(vec![(p.rows / k) * (p.cols / k)])
            }
            (Self::Gemma3 { .. }, Picture::Patches(_)) => Err(ImageError::VisionMismatch(
                "Gemma 3's tower reads square pictures (images::Pixels), not patch grids".into(),
            )),
            (Self::Gemma4 { .. }, Picture::Square(_) | Picture::Crops { .. }) => Err(ImageError::VisionMismatch(
                "Gemma 4's tower reads patch grids (images::PatchGrid), not square pictures".into(),
            )),
        }
    }

    /// `text` with its places ([`ImageProcessor::placeholder`], or one for each picture first
    /// where it has none) expanded into the model's image sequences, each as long as its
    /// picture's soft tokens; `tokenizer` must have the marker tokens at the model's ids.
    pub fn expand(&self, text: &str, pictures: &[Picture], tokenizer: &Tokenizer) -> Result<String, ImageError> {
        let names = self.token_names();
        let tokens = self.tokens();
        for (name, id) in names.iter().zip([tokens.begin, tokens.soft, tokens.end]) {
            if tokenizer.token_id(name) != Some(id) {
                return Err(ImageError::VisionMismatch(format!("the tokenizer has no {name} token of id {id}")));
            }
        }
        let place = self.placeholder();
        let places = text.matches(place).count();
        let text = match places {
            0 => place.repeat(pictures.len()) + text,
            _ if places == pictures.len() => text.to_string(),
            _ => return Err(ImageError::Count { images: pictures.len(), places }),
        };
        let [begin, soft, end] = names;
        let mut pieces = text.split(place);
        let mut out = pieces.next().unwrap_or_default().to_string();
        for (piece, picture) in pieces.zip(pictures) {
            let sequences: Vec<String> = self
                .runs(picture)?
                .into_iter()
                .map(|n| {
                    let run = soft.repeat(n);
                    match self {
                        Self::Gemma3 { .. } => format!("\n\n{begin}{run}{end}\n\n"),
                        Self::Gemma4 { .. } => format!("{begin}{run}{end}"),
                    }
                })
                .collect();
            match sequences.split_first() {
                // HF's `Gemma3Processor.replace_image_token` for a picture with crops.
                Some((whole, crops)) if !crops.is_empty() => out.push_str(&format!(
                    "Here is the original image {whole} and here are some crops to help you see better {}",
                    crops.join(" ")
                )),
                _ => out.push_str(&sequences.concat()),
            }
            out.push_str(piece);
        }
        Ok(out)
    }

    /// Where each run of soft tokens starts in `ids`: one run of the soft token for each
    /// picture (for each square of a picture with crops: the whole, then each crop), in order,
    /// each as long as its square's or grid's soft tokens.
    pub fn places(&self, ids: &[u32], pictures: &[Picture]) -> Result<Vec<usize>, ImageError> {
        let token = self.tokens().soft;
        let starts: Vec<usize> =
            (0..ids.len()).filter(|&i| ids[i] == token && (i == 0 || ids[i - 1] != token)).collect();
        let mut runs = Vec::new();
        for picture in pictures {
            runs.extend(self.runs(picture)?);
        }
        if starts.len() != runs.len() {
            return Err(match runs.len() == pictures.len() {
                true => ImageError::Count { images: pictures.len(), places: starts.len() },
                false => ImageError::VisionMismatch(format!(
                    "{} pictures with their crops take {} runs of soft tokens; the prompt has {}",
                    pictures.len(),
                    runs.len(),
                    starts.len()
                )),
            });
        }
        for (&start, &soft) in starts.iter().zip(&runs) {
            let run = ids[start..].iter().take_while(|&&t| t == token).count();
            if run != soft {
                return Err(ImageError::VisionMismatch(format!(
                    "the picture at {start} takes {soft} soft tokens; the prompt has a run of {run} there"
                )));
            }
        }
        Ok(starts)
    }
}

/// A model's image reader.
#[derive(Debug, Clone)]
pub enum Vision<B: GemmaBackend> {
    /// Gemma 3's SigLIP tower and projector ([`crate::Checkpoint::load_vision`],
    /// [`crate::MmprojCheckpoint::load`]).
    Gemma3(Gemma3Vision<B>),
    /// Gemma 4's tower and embedder ([`crate::Checkpoint::load_gemma4_vision`]) and the soft-token
    /// budget pictures are sized within.
    Gemma4 { tower: Gemma4Vision<B>, budget: PatchBudget },
}

impl<B: GemmaBackend> From<Gemma3Vision<B>> for Vision<B> {
    fn from(tower: Gemma3Vision<B>) -> Self {
        Self::Gemma3(tower)
    }
}

impl<B: GemmaBackend> From<Gemma4Vision<B>> for Vision<B> {
    /// With HF's default budget (280 soft tokens a picture).
    fn from(tower: Gemma4Vision<B>) -> Self {
        let c = &tower.config().vision;
        let budget = PatchBudget::new(c.patch_size, c.pooling_kernel_size);
        Self::Gemma4 { tower, budget }
    }
}

impl<B: GemmaBackend> Vision<B> {
    /// Its processor: how pictures are prepared and placed.
    pub fn processor(&self) -> ImageProcessor {
        match self {
            Self::Gemma3(tower) => {
                let c = tower.config();
                ImageProcessor::Gemma3 {
                    image_size: c.vision.image_size,
                    soft_tokens: c.mm_tokens_per_image,
                    tokens: ImageTokens { soft: c.image_token_index, begin: c.boi_token_index, end: c.eoi_token_index },
                    pan_and_scan: None,
                }
            }
            Self::Gemma4 { tower, budget } => {
                let c = tower.config();
                ImageProcessor::Gemma4 {
                    budget: *budget,
                    positions: c.vision.position_embedding_size,
                    tokens: ImageTokens { soft: c.image_token_id, begin: c.boi_token_id, end: c.eoi_token_id },
                }
            }
        }
    }

    /// Reads and prepares the picture at `path` for this tower ([`ImageProcessor::read`]).
    pub fn read(&self, path: impl AsRef<Path>) -> Result<Picture, ImageError> {
        self.processor().read(path)
    }

    /// Decodes and prepares an encoded picture for this tower ([`ImageProcessor::decode`]).
    pub fn decode(&self, bytes: &[u8]) -> Result<Picture, ImageError> {
        self.processor().decode(bytes)
    }

    /// How many soft tokens `picture` takes ([`ImageProcessor::soft_tokens`]).
    pub fn soft_tokens(&self, picture: &Picture) -> Result<usize, ImageError> {
        self.processor().soft_tokens(picture)
    }

    /// The width of the features (the text model's hidden size).
    pub fn text_hidden_size(&self) -> usize {
        match self {
            Self::Gemma3(tower) => tower.config().text_hidden_size,
            Self::Gemma4 { tower, .. } => tower.config().text_hidden_size,
        }
    }

    /// Fails unless the tower projects to `hidden` and marks images with tokens below `vocab`.
    pub(crate) fn check_fits(&self, hidden: usize, vocab: usize) -> Result<(), ImageError> {
        let tokens = self.processor().tokens();
        let widest = tokens.soft.max(tokens.begin).max(tokens.end);
        if self.text_hidden_size() != hidden || widest as usize >= vocab {
            return Err(ImageError::VisionMismatch(format!(
                "the vision tower projects to {} and marks images with tokens up to {widest}; the model is \
                 {hidden} wide with {vocab} tokens",
                self.text_hidden_size()
            )));
        }
        Ok(())
    }

    /// The embeddings of `pictures` placed at their runs of soft tokens in `ids`
    /// ([`ImageProcessor::places`]: a picture with crops has a run for each square), for
    /// [`crate::Gemma::forward_hidden_with_images`].
    pub fn embeds(&self, ids: &[u32], pictures: &[Picture], device: &B::Device) -> Result<Vec<ImageEmbeds<B>>, Error> {
        let starts = self.processor().places(ids, pictures)?;
        let features = self.checked_features(pictures, device)?;
        Ok(starts.into_iter().zip(features).map(|(start, features)| ImageEmbeds { start, features }).collect())
    }

    /// The soft tokens of each run (`[soft_tokens, text_hidden]`): one for each picture, and for
    /// a picture with crops one for the whole picture then one for each crop.
    pub fn features(&self, pictures: &[Picture], device: &B::Device) -> Result<Vec<Tensor<B, 2>>, Error> {
        let processor = self.processor();
        for picture in pictures {
            processor.soft_tokens(picture)?;
        }
        self.checked_features(pictures, device)
    }

    /// [`Vision::features`] of pictures [`ImageProcessor::soft_tokens`] accepted.
    fn checked_features(&self, pictures: &[Picture], device: &B::Device) -> Result<Vec<Tensor<B, 2>>, Error> {
        if pictures.is_empty() {
            return Ok(Vec::new());
        }
        let features: Vec<Tensor<B, 2>> = match self {
            Self::Gemma3(tower) => {
                // One batch for every square: they are all the tower's size.
                let squares = pictures.iter().flat_map(Picture::squares).map(|p| p.to_tensor::<B>(device));
                let features = tower.image_features(Tensor::cat(squares.collect(), 0))?;
                let [n, tokens, width] = features.dims();
                (0..n)
                    .map(|i| features.clone().slice([i..i + 1, 0..tokens, 0..width]).reshape([tokens, width]))
                    .collect()
            }
            // One picture at a time: their grids differ.
            Self::Gemma4 { tower, .. } => pictures
                .iter()
                .filter_map(|p| match p {
                    Picture::Patches(grid) => Some(tower.image_features(&grid.to_patches::<B>(device))),
                    Picture::Square(_) | Picture::Crops { .. } => None,
                })
                .collect::<Result<_, _>>()?,
        };
        Ok(features)
    }
}
