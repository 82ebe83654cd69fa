//! The OpenAI-compatible request and response bodies, their checks, and the chat templates.

use crate::{
    chat::{ChatTemplate, SystemTurn, Thinking},
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
}

impl ApiError {
    pub fn invalid(param: &'static str, message: impl Into<String>) -> Self {
        Self { status: StatusCode::BAD_REQUEST, message: message.into(), param: Some(param.to_string()) }
    }

    /// The error's JSON body.
    pub fn body(&self) -> serde_json::Value {
        let kind = match self.status {
            StatusCode::TOO_MANY_REQUESTS => "rate_limit_exceeded",
            StatusCode::SERVICE_UNAVAILABLE => "service_unavailable",
            s if s.is_server_error() => "server_error",
            StatusCode::NOT_FOUND => "not_found_error",
            _ => "invalid_request_error",
        };
        serde_json::json!({
            "error": { "message": self.message, "type": kind, "param": self.param, "code": null }
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

    /// The generation settings, checked; `default_max_tokens` where the request gives none.
    pub fn generation(&self, default_max_tokens: usize) -> Result<(GenerationConfig, Vec<String>), ApiError> {
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
        let max_new_tokens = self.max_completion_tokens.or(self.max_tokens).unwrap_or(default_max_tokens);
        if max_new_tokens == 0 {
            return Err(ApiError::invalid("max_tokens", "max_tokens must be at least 1"));
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
        // A top-p of 1 and a min-p of 0 keep every token: no filter.
        let sampling = SamplingConfig {
            top_p: sampling.top_p.filter(|&p| p < 1.0),
            min_p: sampling.min_p.filter(|&p| p > 0.0),
            ..sampling
        };
        Ok((GenerationConfig { max_new_tokens, sampling, ..GenerationConfig::default() }, stops))
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

/// A chat's prompt text in the model's template and its pictures, in the order of their
/// places in the text ([`ImageProcessor::placeholder`]).
#[derive(Debug, Clone)]
pub struct ChatPrompt {
    pub text: String,
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
    images: Option<&ImageProcessor>,
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
                let Some(processor) = images.filter(|_| pictures_here) else {
                    let why = match images {
                        None => "this model reads no images (serve a multimodal checkpoint)",
                        Some(_) => "pictures go in user messages",
                    };
                    return Err(ApiError::invalid("messages", format!("{at}: {why}")));
                };
                let bytes =
                    data_url_bytes(&image_url.url).map_err(|e| ApiError::invalid("messages", format!("{at}: {e}")))?;
                let picture =
                    processor.decode(&bytes).map_err(|e| ApiError::invalid("messages", format!("{at}: {e}")))?;
                pictures.push(picture);
                text.push_str(processor.placeholder());
            }
        }
    }
    Ok(text)
}

/// The prompt of a chat in the model's template, its model turn opened: system messages
/// (first only) as Gemma 4's system turn or, before Gemma 4, at the head of the first user
/// message; user and assistant turns alternating as they come; the last message a user's.
/// Pictures (`image_url` parts of user messages) are decoded and prepared by `images`, the
/// model's processor: a model without one refuses them.
pub fn render_chat(
    template: ChatTemplate,
    messages: &[Message],
    images: Option<&ImageProcessor>,
) -> Result<ChatPrompt, ApiError> {
    if messages.is_empty() {
        return Err(ApiError::invalid("messages", "messages is empty"));
    }
    let mut system = None;
    let mut text = String::new();
    let mut pictures = Vec::new();
    for (i, message) in messages.iter().enumerate() {
        let user = message.role == "user";
        let content = content_text(i, &message.content, images, user, &mut pictures)?;
        match message.role.as_str() {
            "system" | "developer" if i == 0 => system = Some(content),
            "system" | "developer" => {
                return Err(ApiError::invalid("messages", format!("messages[{i}]: a system message must come first")))
            }
            "user" => {
                let content = match (template, system.take()) {
                    (ChatTemplate::Gemma, Some(s)) => format!("{s}\n\n{content}"),
                    (_, s) => {
                        if let Some(s) = s {
                            let turn = SystemTurn { instructions: Some(s), thinking: Thinking::Off, tools: Vec::new() };
                            text.push_str(&turn.render());
                        }
                        content
                    }
                };
                text.push_str(&template.user_turn(&content));
            }
            "assistant" => {
                if i + 1 == messages.len() {
                    return Err(ApiError::invalid("messages", "the last message must be the user's"));
                }
                text.push_str(&content);
                text.push_str(template.end_of_turn());
                text.push_str(crate::chat::TURN_SEPARATOR);
            }
            other => {
                return Err(ApiError::invalid(
                    "messages",
                    format!("messages[{i}].role is {other:?}; expected system, user or assistant"),
                ))
            }
        }
    }
    if messages.last().is_some_and(|m| m.role != "user") {
        return Err(ApiError::invalid("messages", "the last message must be the user's"));
    }
    Ok(ChatPrompt { text, pictures })
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
        Self { prompt_tokens, completion_tokens, total_tokens: prompt_tokens + completion_tokens }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn message(role: &str, content: &str) -> Message {
        Message { role: role.into(), content: content.into() }
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
            render_chat(ChatTemplate::Gemma, &chat, None)?.text,
            "<start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\nHello!<end_of_turn>\n\
             <start_of_turn>user\nAgain<end_of_turn>\n<start_of_turn>model\n"
        );
        assert_eq!(
            render_chat(ChatTemplate::Gemma4, &chat, None)?.text,
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
            let e = render_chat(ChatTemplate::Gemma, &chat, None).unwrap_err();
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
        ] {
            assert_eq!(fields(json)?.generation(16).err().and_then(|e| e.param).as_deref(), Some(param), "{json}");
        }
        let (config, stops) = fields(r#"{"max_tokens": 7, "temperature": 0, "seed": 5, "stop": "\n"}"#)?
            .generation(16)
            .map_err(|e| e.message)?;
        assert_eq!((config.max_new_tokens, config.sampling.temperature, config.sampling.seed), (7, 0.0, 5));
        assert_eq!(stops, vec!["\n".to_string()]);
        assert_eq!(fields("{}")?.generation(16).map_err(|e| e.message)?.0.max_new_tokens, 16);
        Ok(())
    }
}
