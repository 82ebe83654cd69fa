//! What a caller submits and what comes back: requests, events, how they finish, errors.

use crate::{chat::ChatMessage, vision::Picture, GenerationConfig, StopReason, Token};

use std::time::Duration;

/// What a request continues: token ids, text or a conversation.
#[derive(Debug, Clone, PartialEq)]
pub enum Prompt {
    /// Already tokenized (`<bos>` and the chat template included where wanted).
    Ids(Vec<u32>),
    /// Text, tokenized by the engine with `<bos>` first.
    Text(String),
    /// A conversation, laid out in the model's chat template ([`crate::chat::ChatTemplate::render`]) with the
    /// model's turn opened, then tokenized with `<bos>` first.
    Chat(Vec<ChatMessage>),
}

/// One generation request: the prompt and how to continue it.
///
/// ```
/// use burn_gemma::{chat::ChatMessage, engine::Request, GenerationConfig};
/// let generation = GenerationConfig { max_new_tokens: 32, ..Default::default() };
/// let request = Request::chat(vec![ChatMessage::user("Name three rivers.")], generation);
/// # let _ = request;
/// ```
#[derive(Debug, Clone)]
pub struct Request {
    pub prompt: Prompt,
    /// Most tokens to generate, how to choose them, extra stop tokens and stop strings (the
    /// text that could still begin one is held back from the token events until it cannot).
    /// Its `cuda_graph` stays at `Auto`: the engine's steps follow
    /// [`super::EngineConfig::cuda_graph`], and a request asking otherwise is refused.
    pub generation: GenerationConfig,
    /// Pictures for the prompt, in order (an engine reading images: [`super::Engine::with_vision`]). A
    /// text or chat prompt marks each picture's place with [`crate::ImageProcessor::placeholder`]; token
    /// ids hold its soft tokens already ([`crate::ImageProcessor::expand`]). A prompt with pictures is
    /// not cached for others, nor taken from the cache.
    pub images: Vec<Picture>,
}

impl Request {
    /// A request for token ids continued as `generation` says, without pictures.
    pub fn new(ids: Vec<u32>, generation: GenerationConfig) -> Self {
        Self { prompt: Prompt::Ids(ids), generation, images: Vec::new() }
    }

    /// A request for text (`<bos>` is put first), without pictures.
    pub fn text(text: impl Into<String>, generation: GenerationConfig) -> Self {
        Self { prompt: Prompt::Text(text.into()), generation, images: Vec::new() }
    }

    /// A request for the model's reply to a conversation, without pictures.
    pub fn chat(messages: Vec<ChatMessage>, generation: GenerationConfig) -> Self {
        Self { prompt: Prompt::Chat(messages), generation, images: Vec::new() }
    }
}

/// A request as the worker takes it: its prompt's token ids.
#[derive(Debug, Clone)]
pub(crate) struct Tokenized {
    pub(crate) input: Vec<u32>,
    pub(crate) generation: GenerationConfig,
    pub(crate) images: Vec<Picture>,
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
