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
//! The expansions are those of HF 5.23's `Gemma3Processor` and `Gemma4Processor`.

use crate::{
    images::{ImageError, PatchBudget, PatchGrid, Pixels},
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
    /// Squares of `image_size` pixels, `soft_tokens` each.
    Gemma3 { image_size: usize, soft_tokens: usize, tokens: ImageTokens },
    /// Patch grids within `budget`, at most `positions` patches a side.
    Gemma4 { budget: PatchBudget, positions: usize, tokens: ImageTokens },
}

impl ImageProcessor {
    /// Prepares a decoded picture.
    pub fn prepare(&self, image: &DynamicImage) -> Result<Picture, ImageError> {
        match self {
            Self::Gemma3 { image_size, .. } => Ok(Pixels::from_image(image, *image_size)?.into()),
            Self::Gemma4 { budget, .. } => Ok(PatchGrid::from_image(image, *budget)?.into()),
        }
    }

    /// Reads and prepares the picture at `path` (PNG, JPEG, WebP or GIF).
    pub fn read(&self, path: impl AsRef<Path>) -> Result<Picture, ImageError> {
        match self {
            Self::Gemma3 { image_size, .. } => Ok(Pixels::from_path(path, *image_size)?.into()),
            Self::Gemma4 { budget, .. } => Ok(PatchGrid::from_path(path, *budget)?.into()),
        }
    }

    /// Decodes and prepares an encoded picture (PNG, JPEG, WebP or GIF).
    pub fn decode(&self, bytes: &[u8]) -> Result<Picture, ImageError> {
        match self {
            Self::Gemma3 { image_size, .. } => Ok(Pixels::from_bytes(bytes, *image_size)?.into()),
            Self::Gemma4 { budget, .. } => Ok(PatchGrid::from_bytes(bytes, *budget)?.into()),
        }
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

    /// How many soft tokens `picture` takes, or why this model cannot read it.
    pub fn soft_tokens(&self, picture: &Picture) -> Result<usize, ImageError> {
        match (self, picture) {
            (Self::Gemma3 { image_size, soft_tokens, .. }, Picture::Square(p)) => {
                let size = *image_size;
                if p.size != size || p.values.len() != 3 * size * size {
                    return Err(ImageError::VisionMismatch(format!(
                        "pictures for this tower are prepared at {size} pixels a side, got one at {} ({} values)",
                        p.size,
                        p.values.len()
                    )));
                }
                Ok(*soft_tokens)
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
                Ok((p.rows / k) * (p.cols / k))
            }
            (Self::Gemma3 { .. }, Picture::Patches(_)) => Err(ImageError::VisionMismatch(
                "Gemma 3's tower reads square pictures (images::Pixels), not patch grids".into(),
            )),
            (Self::Gemma4 { .. }, Picture::Square(_)) => Err(ImageError::VisionMismatch(
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
            let run = soft.repeat(self.soft_tokens(picture)?);
            match self {
                Self::Gemma3 { .. } => out.push_str(&format!("\n\n{begin}{run}{end}\n\n")),
                Self::Gemma4 { .. } => out.push_str(&format!("{begin}{run}{end}")),
            }
            out.push_str(piece);
        }
        Ok(out)
    }

    /// Where each picture's soft tokens start in `ids`: one run of the soft token for each
    /// picture, in order, each as long as its picture's soft tokens.
    pub fn places(&self, ids: &[u32], pictures: &[Picture]) -> Result<Vec<usize>, ImageError> {
        let token = self.tokens().soft;
        let starts: Vec<usize> =
            (0..ids.len()).filter(|&i| ids[i] == token && (i == 0 || ids[i - 1] != token)).collect();
        if starts.len() != pictures.len() {
            return Err(ImageError::Count { images: pictures.len(), places: starts.len() });
        }
        for (&start, picture) in starts.iter().zip(pictures) {
            let run = ids[start..].iter().take_while(|&&t| t == token).count();
            let soft = self.soft_tokens(picture)?;
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
    /// ([`ImageProcessor::places`]), for [`crate::Gemma::forward_hidden_with_images`].
    pub fn embeds(&self, ids: &[u32], pictures: &[Picture], device: &B::Device) -> Result<Vec<ImageEmbeds<B>>, Error> {
        let starts = self.processor().places(ids, pictures)?;
        let features = self.checked_features(pictures, device)?;
        Ok(starts.into_iter().zip(features).map(|(start, features)| ImageEmbeds { start, features }).collect())
    }

    /// The soft tokens of each picture (`[soft_tokens, text_hidden]`).
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
                // One batch for every picture: they are all the tower's square.
                let squares = pictures.iter().filter_map(|p| match p {
                    Picture::Square(p) => Some(p.to_tensor::<B>(device)),
                    Picture::Patches(_) => None,
                });
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
                    Picture::Square(_) => None,
                })
                .collect::<Result<_, _>>()?,
        };
        Ok(features)
    }
}
