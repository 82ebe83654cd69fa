//! The OpenAI-compatible request and response bodies, their checks, and a chat's conversation.

use crate::{
    chat::{ChatMessage, Role},
    sampling::SamplingConfig,
    vision::{ImageProcessor, Picture},
    Error, GenerationConfig, SamplingError,
};
use axum::http::StatusCode;
use serde::{Deserialize, Serialize};

/// An error as OpenAI's API reports one: `{"error": {"message", "type", "param", "code"}}`.
#[derive(Debug, Clone, PartialEq)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    /// The request field at fault, where one is.
    pub param: Option<String>,
    /// A machine-readable code, where OpenAI gives one (`invalid_api_key`, `context_length_exceeded`).
    pub code: Option<&'static str>,
}

impl ApiError {
    /// An error of `status` naming no field.
    pub fn new(status: StatusCode, message: impl Into<String>) -> Self {
        Self { status, message: message.into(), param: None, code: None }
    }

    /// A 400 naming the field `param`.
    pub fn invalid(param: &'static str, message: impl Into<String>) -> Self {
        Self::invalid_owned(param.to_string(), message)
    }

    /// A 400 naming the field `param`.
    pub fn invalid_owned(param: String, message: impl Into<String>) -> Self {
        Self { param: Some(param), ..Self::new(StatusCode::BAD_REQUEST, message) }
    }

    /// A 400 about the body as a whole.
    pub fn invalid_body(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, message)
    }

    pub fn with_code(self, code: &'static str) -> Self {
        Self { code: Some(code), ..self }
    }

    /// The error's JSON body.
    pub fn body(&self) -> serde_json::Value {
        let kind = match self.status {
            StatusCode::TOO_MANY_REQUESTS => "rate_limit_exceeded",
            StatusCode::SERVICE_UNAVAILABLE => "service_unavailable",
            s if s.is_server_error() => "server_error",
            StatusCode::NOT_FOUND => "not_found_error",
            StatusCode::UNAUTHORIZED => "authentication_error",
            _ => "invalid_request_error",
        };
        serde_json::json!({
            "error": { "message": self.message, "type": kind, "param": self.param, "code": self.code }
        })
    }
}

impl axum::response::IntoResponse for ApiError {
    fn into_response(self) -> axum::response::Response {
        (self.status, axum::Json(self.body())).into_response()
    }
}

/// `stop`: one string or a list of them.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum Stop {
    One(String),
    Many(Vec<String>),
}

/// The body of `POST /v1/completions` (`prompt`) and `POST /v1/chat/completions` (`messages`):
/// one struct, so that an error in any field names its path.
#[derive(Debug, Clone, Deserialize)]
pub struct RequestBody {
    /// Not checked: one model is served.
    pub model: Option<String>,
    /// Completions: the prompt text.
    pub prompt: Option<String>,
    /// Chat: the conversation.
    pub messages: Option<Vec<Message>>,
    #[serde(default)]
    pub stream: bool,
    pub max_tokens: Option<usize>,
    /// OpenAI's newer name for `max_tokens` (chat).
    pub max_completion_tokens: Option<usize>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    /// Not OpenAI's, as llama.cpp and vLLM take it.
    pub top_k: Option<usize>,
    pub min_p: Option<f32>,
    pub seed: Option<u64>,
    pub stop: Option<Stop>,
    pub n: Option<usize>,
    pub frequency_penalty: Option<f32>,
    pub presence_penalty: Option<f32>,
    /// Streams: whether a last chunk carries the usage (OpenAI's `include_usage`).
    pub stream_options: Option<StreamOptions>,
}

/// `stream_options`.
#[derive(Debug, Clone, Copy, Deserialize)]
pub struct StreamOptions {
    #[serde(default)]
    pub include_usage: bool,
}

/// Most stop strings a request may give (OpenAI's limit).
pub const MAX_STOPS: usize = 4;

/// Most choices (`n`) a request may ask for: each is a request of the engine, with seed
/// `seed + index`.
pub const MAX_CHOICES: usize = 8;

impl RequestBody {
    /// Choices asked for (`n`, default 1).
    pub fn choices(&self) -> usize {
        self.n.unwrap_or(1)
    }

    /// The `max_tokens` asked for (`max_completion_tokens` first), if any.
    pub fn max_tokens_asked(&self) -> Option<usize> {
        self.max_completion_tokens.or(self.max_tokens)
    }

    /// The field the token budget came in.
    pub fn max_tokens_field(&self) -> &'static str {
        match self.max_completion_tokens {
            Some(_) => "max_completion_tokens",
            None => "max_tokens",
        }
    }

    /// The generation settings, checked, stop strings of at most `max_stop_bytes` included;
    /// `default_max_tokens` where the request gives none (the server later fits it to the room
    /// its prompt leaves: [`fit_max_tokens`]).
    pub fn generation(&self, default_max_tokens: usize, max_stop_bytes: usize) -> Result<GenerationConfig, ApiError> {
        if let Some(n) = self.n.filter(|n| !(1..=MAX_CHOICES).contains(n)) {
            return Err(ApiError::invalid("n", format!("n = {n}: from 1 to {MAX_CHOICES} choices per request")));
        }
        for (param, value) in
            [("frequency_penalty", self.frequency_penalty), ("presence_penalty", self.presence_penalty)]
        {
            if value.is_some_and(|v| v != 0.0) {
                return Err(ApiError::invalid(param, format!("{param} is not supported; leave it out or 0")));
            }
        }
        let max_new_tokens = self.max_tokens_asked().unwrap_or(default_max_tokens);
        if max_new_tokens == 0 {
            let field = self.max_tokens_field();
            return Err(ApiError::invalid(field, format!("{field} must be at least 1")));
        }
        let temperature = self.temperature.unwrap_or(1.0);
        // OpenAI's range; the library takes any temperature from 0.
        if temperature > 2.0 {
            return Err(sampling_error(&SamplingError::Temperature(temperature)));
        }
        let sampling = SamplingConfig {
            temperature,
            top_k: self.top_k,
            top_p: self.top_p,
            min_p: self.min_p,
            seed: self.seed.unwrap_or_else(rand_seed),
            ..SamplingConfig::default()
        };
        sampling.validate().map_err(|e| match e {
            Error::Sampling(e) => sampling_error(&e),
            other => ApiError::invalid("temperature", other.to_string()),
        })?;
        let stops = match &self.stop {
            None => Vec::new(),
            Some(Stop::One(s)) => vec![s.clone()],
            Some(Stop::Many(v)) => v.clone(),
        };
        if stops.len() > MAX_STOPS {
            return Err(ApiError::invalid("stop", format!("{} stop strings; at most {MAX_STOPS}", stops.len())));
        }
        if stops.iter().any(String::is_empty) {
            return Err(ApiError::invalid("stop", "a stop string is empty"));
        }
        if let Some(long) = stops.iter().find(|s| s.len() > max_stop_bytes) {
            let message = format!("a stop string of {} bytes; at most {max_stop_bytes}", long.len());
            return Err(ApiError::invalid("stop", message));
        }
        // A top-p of 1 and a min-p of 0 keep every token: no filter.
        let sampling = SamplingConfig {
            top_p: sampling.top_p.filter(|&p| p < 1.0),
            min_p: sampling.min_p.filter(|&p| p > 0.0),
            ..sampling
        };
        Ok(GenerationConfig { max_new_tokens, sampling, stop_strings: stops, ..GenerationConfig::default() })
    }
}

/// The tokens a request may generate after its `prompt_tokens` in sequences of `positions`:
/// what it `asked` for, which must fit (a 400 naming `max_tokens` otherwise, as OpenAI's and
/// vLLM's servers answer), or `default` cut to the room left.
/// `input` names the field the prompt came in.
pub fn fit_max_tokens(
    asked: Option<(usize, &'static str)>,
    default: usize,
    prompt_tokens: usize,
    positions: usize,
    input: &'static str,
) -> Result<usize, ApiError> {
    let room = positions.saturating_sub(prompt_tokens);
    if room == 0 {
        let message = format!(
            "the prompt's {prompt_tokens} tokens fill the {positions} positions a request holds: no room is left \
             to generate (exceeds the model's context)"
        );
        return Err(ApiError::invalid(input, message).with_code("context_length_exceeded"));
    }
    match asked {
        Some((asked, field)) if asked > room => {
            let message = format!(
                "{field} = {asked}, but a request holds {positions} positions and the prompt takes \
                 {prompt_tokens}: at most {room} can be generated"
            );
            Err(ApiError::invalid(field, message).with_code("context_length_exceeded"))
        }
        Some((asked, _)) => Ok(asked),
        None => Ok(default.min(room)),
    }
}

/// The request field and message for a sampling value the library refuses, in OpenAI's names.
pub fn sampling_error(e: &SamplingError) -> ApiError {
    match *e {
        SamplingError::Temperature(t) => ApiError::invalid("temperature", format!("temperature {t} is outside [0, 2]")),
        SamplingError::TopK => ApiError::invalid("top_k", "top_k must be at least 1"),
        SamplingError::TopP(p) => ApiError::invalid("top_p", format!("top_p {p} is outside (0, 1]")),
        SamplingError::MinP(p) => ApiError::invalid("min_p", format!("min_p {p} is outside [0, 1]")),
        SamplingError::RepeatPenalty(r) => {
            ApiError::invalid("repeat_penalty", format!("repeat penalty {r} is not > 0"))
        }
    }
}

/// A seed for a request that gives none: the clock's nanoseconds, so that two such requests
/// sample differently.
fn rand_seed() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64)
}

/// One message of a chat.
#[derive(Debug, Clone, Deserialize)]
pub struct Message {
    pub role: String,
    pub content: Content,
}

impl Message {
    /// Bytes of its text parts, and its pictures: counted before anything is decoded.
    pub fn size(&self) -> (usize, usize) {
        match &self.content {
            Content::Text(text) => (text.len(), 0),
            Content::Parts(parts) => parts.iter().fold((0, 0), |(bytes, pictures), part| match part {
                ContentPart::Text { text } => (bytes.saturating_add(text.len()), pictures),
                ContentPart::ImageUrl { .. } => (bytes, pictures.saturating_add(1)),
            }),
        }
    }
}

/// A message's content: a string, or OpenAI's content parts.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum Content {
    Text(String),
    Parts(Vec<ContentPart>),
}

impl From<&str> for Content {
    fn from(text: &str) -> Self {
        Self::Text(text.into())
    }
}

/// One part of a message's content.
#[derive(Debug, Clone, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ContentPart {
    Text {
        text: String,
    },
    /// A picture: a `data:` URL (`data:image/png;base64,...`; the server fetches nothing).
    ImageUrl {
        image_url: ImageUrl,
    },
}

#[derive(Debug, Clone, Deserialize)]
pub struct ImageUrl {
    pub url: String,
}

impl Content {
    /// Whether it has a picture.
    pub fn has_images(&self) -> bool {
        matches!(self, Self::Parts(parts) if parts.iter().any(|p| matches!(p, ContentPart::ImageUrl { .. })))
    }
}

/// A chat's messages and their pictures, in the order of their places in the text
/// ([`ImageProcessor::placeholder`]).
#[derive(Debug, Clone)]
pub struct Conversation {
    pub messages: Vec<ChatMessage>,
    pub pictures: Vec<Picture>,
}

/// The bytes of a `data:` URL's base64 payload.
fn data_url_bytes(url: &str) -> Result<Vec<u8>, String> {
    use base64::Engine as _;
    let Some(rest) = url.strip_prefix("data:") else {
        let shown: String = url.chars().take(40).collect();
        return Err(format!(
            "{shown:?} is not a data URL: pictures come inline (data:image/png;base64,...); the server fetches nothing"
        ));
    };
    let Some((meta, data)) = rest.split_once(',') else { return Err("a data URL without a comma".into()) };
    if !meta.ends_with(";base64") {
        return Err(format!("a data URL of {meta:?}, not base64 (data:image/...;base64,...)"));
    }
    base64::engine::general_purpose::STANDARD.decode(data.trim()).map_err(|e| format!("its base64 is bad: {e}"))
}

/// The text of message `i`'s content, each picture's place in it ([`ImageProcessor::placeholder`])
/// and the picture in `pictures`; pictures only where `images` reads them and `pictures_here`
/// allows them.
fn content_text(
    i: usize,
    content: &Content,
    images: Option<(&ImageProcessor, u64)>,
    pictures_here: bool,
    pictures: &mut Vec<Picture>,
) -> Result<String, ApiError> {
    let parts = match content {
        Content::Text(text) => return Ok(text.clone()),
        Content::Parts(parts) => parts,
    };
    let mut text = String::new();
    for (j, part) in parts.iter().enumerate() {
        match part {
            ContentPart::Text { text: t } => text.push_str(t),
            ContentPart::ImageUrl { image_url } => {
                let at = format!("messages[{i}].content[{j}].image_url");
                let Some((processor, max_pixels)) = images.filter(|_| pictures_here) else {
                    let why = match images {
                        None => "this model reads no images (serve a multimodal checkpoint)",
                        Some(_) => "pictures go in user messages",
                    };
                    return Err(ApiError::invalid("messages", format!("{at}: {why}")));
                };
                let bytes =
                    data_url_bytes(&image_url.url).map_err(|e| ApiError::invalid("messages", format!("{at}: {e}")))?;
                // Its size from the header, before any pixel is decoded.
                let (width, height) = crate::images::image_dimensions(&bytes)
                    .map_err(|e| ApiError::invalid("messages", format!("{at}: {e}")))?;
                if u64::from(width) * u64::from(height) > max_pixels {
                    let message = format!("{at}: a picture of {width}x{height} pixels; at most {max_pixels} pixels");
                    return Err(ApiError::invalid("messages", message));
                }
                let picture =
                    processor.decode(&bytes).map_err(|e| ApiError::invalid("messages", format!("{at}: {e}")))?;
                pictures.push(picture);
                text.push_str(processor.placeholder());
            }
        }
    }
    Ok(text)
}

/// The conversation of a chat request, for the engine to lay out in the model's template
/// ([`crate::chat::ChatTemplate::render`]): roles read, each content's text joined. Pictures (`image_url`
/// parts of user messages) are decoded and prepared by `images`, the model's processor (each of
/// at most the pixels given beside it), their places marked in the text: a model without one
/// refuses them.
pub fn conversation(messages: &[Message], images: Option<(&ImageProcessor, u64)>) -> Result<Conversation, ApiError> {
    if messages.is_empty() {
        return Err(ApiError::invalid("messages", "messages is empty"));
    }
    let mut pictures = Vec::new();
    let mut conversation = Vec::with_capacity(messages.len());
    for (i, message) in messages.iter().enumerate() {
        let role = match message.role.as_str() {
            "system" | "developer" => Role::System,
            "user" => Role::User,
            "assistant" => Role::Assistant,
            other => {
                return Err(ApiError::invalid(
                    "messages",
                    format!("messages[{i}].role is {other:?}; expected system, user or assistant"),
                ))
            }
        };
        let content = content_text(i, &message.content, images, role == Role::User, &mut pictures)?;
        conversation.push(ChatMessage { role, content });
    }
    Ok(Conversation { messages: conversation, pictures })
}

/// Why a choice ended, in OpenAI's words.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    /// A stop token or a stop string.
    Stop,
    /// `max_tokens`, or the model's context.
    Length,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Usage {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    pub total_tokens: usize,
}

impl Usage {
    pub fn new(prompt_tokens: usize, completion_tokens: usize) -> Self {
        Self { prompt_tokens, completion_tokens, total_tokens: prompt_tokens.saturating_add(completion_tokens) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::chat::ChatTemplate;

    fn message(role: &str, content: &str) -> Message {
        Message { role: role.into(), content: content.into() }
    }

    /// The chat's prompt text as the engine lays it out.
    fn render_chat(template: ChatTemplate, messages: &[Message]) -> Result<String, ApiError> {
        template
            .render(&conversation(messages, None)?.messages)
            .map_err(|e| ApiError::invalid("messages", e.to_string()))
    }

    #[test]
    fn chats_render_in_each_template() -> Result<(), ApiError> {
        let chat = [
            message("system", "Be brief."),
            message("user", "Hi"),
            message("assistant", "Hello!"),
            message("user", "Again"),
        ];
        assert_eq!(
            render_chat(ChatTemplate::Gemma, &chat)?,
            "<start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\nHello!<end_of_turn>\n\
             <start_of_turn>user\nAgain<end_of_turn>\n<start_of_turn>model\n"
        );
        assert_eq!(
            render_chat(ChatTemplate::Gemma4, &chat)?,
            "<|turn>system\nBe brief.<turn|>\n<|turn>user\nHi<turn|>\n<|turn>model\nHello!<turn|>\n\
             <|turn>user\nAgain<turn|>\n<|turn>model\n"
        );
        Ok(())
    }

    #[test]
    fn bad_chats_name_the_field() {
        for (chat, says) in [
            (vec![], "messages is empty"),
            (vec![message("user", "a"), message("assistant", "b")], "last message"),
            (vec![message("user", "a"), message("system", "b"), message("user", "c")], "must come first"),
            (vec![message("tool", "a")], "messages[0].role is \"tool\""),
        ] {
            let e = render_chat(ChatTemplate::Gemma, &chat).unwrap_err();
            assert_eq!(e.param.as_deref(), Some("messages"));
            assert!(e.message.contains(says), "{} does not say {says}", e.message);
        }
    }

    #[test]
    fn sampling_fields_are_checked() -> Result<(), Box<dyn std::error::Error>> {
        let fields = |json: &str| serde_json::from_str::<RequestBody>(json);
        for (json, param) in [
            (r#"{"max_tokens": 0}"#, "max_tokens"),
            (r#"{"temperature": 3}"#, "temperature"),
            (r#"{"top_p": 0}"#, "top_p"),
            (r#"{"top_k": 0}"#, "top_k"),
            (r#"{"min_p": 2}"#, "min_p"),
            (r#"{"n": 9}"#, "n"),
            (r#"{"n": 0}"#, "n"),
            (r#"{"stop": ["a","b","c","d","e"]}"#, "stop"),
            (r#"{"stop": ""}"#, "stop"),
            (r#"{"presence_penalty": 0.5}"#, "presence_penalty"),
            (r#"{"stop": "123456789"}"#, "stop"),
        ] {
            assert_eq!(fields(json)?.generation(16, 8).err().and_then(|e| e.param).as_deref(), Some(param), "{json}");
        }
        let config = fields(r#"{"max_tokens": 7, "temperature": 0, "seed": 5, "stop": "\n"}"#)?
            .generation(16, 8)
            .map_err(|e| e.message)?;
        assert_eq!((config.max_new_tokens, config.sampling.temperature, config.sampling.seed), (7, 0.0, 5));
        assert_eq!(config.stop_strings, vec!["\n".to_string()]);
        assert_eq!(fields("{}")?.generation(16, 8).map_err(|e| e.message)?.max_new_tokens, 16);
        Ok(())
    }

    #[test]
    fn max_tokens_must_fit_the_room_the_prompt_leaves() {
        // (asked, default, prompt, positions) -> tokens, or the field refused
        assert_eq!(fit_max_tokens(Some((10, "max_tokens")), 256, 20, 64, "prompt"), Ok(10));
        assert_eq!(fit_max_tokens(Some((44, "max_tokens")), 256, 20, 64, "prompt"), Ok(44));
        assert_eq!(fit_max_tokens(None, 256, 20, 64, "prompt"), Ok(44));
        assert_eq!(fit_max_tokens(None, 8, 20, 64, "prompt"), Ok(8));
        for asked in [45, 1 << 62, usize::MAX] {
            let e = fit_max_tokens(Some((asked, "max_tokens")), 8, 20, 64, "prompt").expect_err("too many");
            assert_eq!((e.param.as_deref(), e.code), (Some("max_tokens"), Some("context_length_exceeded")));
            assert!(e.message.contains("at most 44"), "{}", e.message);
        }
        assert!(fit_max_tokens(None, 8, 64, 64, "prompt").is_err());
    }
}
