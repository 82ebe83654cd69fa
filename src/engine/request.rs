//! What a caller submits and what comes back: requests, events, how they finish, errors.

use crate::{vision::Picture, GenerationConfig, StopReason, Token};

use std::time::Duration;

/// One generation request: the prompt's token ids and how to continue them.
#[derive(Debug, Clone)]
pub struct Request {
    /// The prompt, already tokenized (BOS and chat template included where wanted).
    pub input: Vec<u32>,
    /// Most tokens to generate, how to choose them, extra stop tokens and stop strings (the
    /// text that could still begin one is held back from the token events until it cannot).
    /// Its `cuda_graph` stays at `Auto`: the engine's steps follow
    /// [`EngineConfig::cuda_graph`], and a request asking otherwise is refused.
    pub generation: GenerationConfig,
    /// Pictures for the runs of the image soft token in `input`, in order (an engine reading
    /// images: [`Engine::with_vision`]; [`ImageProcessor::expand`] places them in a prompt's
    /// text). A prompt with pictures is not cached for others, nor taken from the cache.
    pub images: Vec<Picture>,
}

impl Request {
    /// A request for `input` continued as `generation` says, without pictures.
    pub fn new(input: Vec<u32>, generation: GenerationConfig) -> Self {
        Self { input, generation, images: Vec::new() }
    }
}

/// What a request's stream yields.
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    /// The next generated token and the text it completes.
    Token(Token),
    /// The request is over.
    Done(Finish),
}

/// How a request ended.
#[derive(Debug, Clone, PartialEq)]
pub struct Finish {
    pub reason: StopReason,
    /// Text held back at the end (it could have begun a stop string, or was an unfinished
    /// character), to append after the last token's.
    pub text: String,
    pub prompt_tokens: usize,
    pub generated_tokens: usize,
    /// From submission to the first token (waiting included).
    pub time_to_first_token: Option<Duration>,
}
