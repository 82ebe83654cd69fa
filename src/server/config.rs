//! What a [`Server`](super::Server) is told at start: its name, the limits a request must keep,
//! the limits of a connection, who may call it, and what it does with fields it does not know.
//!
//! ```
//! use burn_gemma::server::{Access, ApiKey, ServerConfig};
//! let config = ServerConfig {
//!     access: Access { api_keys: vec![ApiKey::new("sk-local-1234")?], ..Access::default() },
//!     ..ServerConfig::new("gemma-3-270m")
//! };
//! assert_eq!(config.limits.max_images, 8);
//! # Ok::<(), burn_gemma::server::ConfigError>(())
//! ```

use std::time::Duration;

/// Everything the server is told at start.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// The name `/v1/models` lists and responses carry.
    pub model_id: String,
    /// `max_tokens` of a request that gives none, cut to the room its prompt leaves.
    pub default_max_tokens: usize,
    pub limits: RequestLimits,
    pub connections: ConnectionLimits,
    pub access: Access,
    pub unknown_fields: UnknownFields,
}

impl ServerConfig {
    /// The defaults below, serving `model_id`.
    pub fn new(model_id: impl Into<String>) -> Self {
        Self { model_id: model_id.into(), ..Self::default() }
    }
}

impl Default for ServerConfig {
    fn default() -> Self {
        Self {
            model_id: "gemma".into(),
            default_max_tokens: 256,
            limits: RequestLimits::default(),
            connections: ConnectionLimits::default(),
            access: Access::default(),
            unknown_fields: UnknownFields::Refuse,
        }
    }
}

/// What one request may carry. Each is checked before the work it bounds starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RequestLimits {
    /// Bytes of a request body (pictures come in it as base64). Past it: 413.
    pub max_body_bytes: usize,
    /// Bytes of the prompt text (a completion's `prompt`, or a chat's message texts), checked
    /// before tokenizing. The server also refuses any prompt longer than its sequences'
    /// positions times the vocabulary's longest token, which cannot fit.
    pub max_prompt_bytes: usize,
    /// Pictures in one request, counted before any is decoded.
    pub max_images: usize,
    /// Pixels (width times height) of one picture, read from its header before decoding.
    pub max_image_pixels: u64,
    /// Bytes of one stop string (the server holds back this much text while it could begin one).
    pub max_stop_bytes: usize,
    /// Requests tokenized or decoding pictures at once, on threads apart from the connections'.
    /// The others wait their turn.
    pub prepare_concurrency: usize,
}

impl Default for RequestLimits {
    fn default() -> Self {
        Self {
            max_body_bytes: 32 << 20,
            max_prompt_bytes: 1 << 20,
            max_images: 8,
            max_image_pixels: 4096 * 4096,
            max_stop_bytes: 256,
            prepare_concurrency: std::thread::available_parallelism().map_or(2, |n| n.get().clamp(2, 16)),
        }
    }
}

/// Limits of the HTTP connections.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConnectionLimits {
    /// Connections open at once. One more gets a 503 and is closed.
    pub max_connections: usize,
    /// Time a client has to send a request's headers, on a new connection or between two
    /// requests on a kept-alive one (so also how long an idle connection stays open).
    pub header_timeout: Duration,
    /// Time a client has to send a request's body once its headers are in. Past it: 408.
    pub body_timeout: Duration,
    /// Time one write to a client may wait for it to read. A client that stops reading a
    /// stream loses its connection after this, and its request is cancelled.
    pub write_timeout: Duration,
    /// After a shutdown is asked: how long the requests in flight may take to finish before
    /// their connections are closed.
    pub shutdown_deadline: Duration,
}

impl Default for ConnectionLimits {
    fn default() -> Self {
        Self {
            max_connections: 1024,
            header_timeout: Duration::from_secs(30),
            body_timeout: Duration::from_secs(60),
            write_timeout: Duration::from_secs(30),
            shutdown_deadline: Duration::from_secs(30),
        }
    }
}

/// Who may call the server, and from which web pages.
#[derive(Debug, Clone, Default)]
pub struct Access {
    /// Keys a request must bring as `Authorization: Bearer <key>`; empty: none needed.
    /// `/health` and `/ready` answer without one (probes carry none).
    pub api_keys: Vec<ApiKey>,
    /// Which web pages' scripts may read the answers.
    pub cors: Cors,
}

/// A key clients present. Held as its SHA-256, compared in constant time.
#[derive(Clone, PartialEq, Eq)]
pub struct ApiKey([u8; 32]);

impl ApiKey {
    /// A key of at least 8 printable ASCII characters (what an `Authorization` header carries).
    pub fn new(key: &str) -> Result<Self, ConfigError> {
        if key.len() < 8 || !key.bytes().all(|b| b.is_ascii_graphic()) {
            return Err(ConfigError::BadApiKey);
        }
        Ok(Self(digest(key.as_bytes())))
    }

    /// Whether `presented` is this key: the digests compared in constant time, so that the
    /// time taken says nothing of how much of a guess was right.
    pub fn matches(&self, presented: &[u8]) -> bool {
        use subtle::ConstantTimeEq;
        self.0.ct_eq(&digest(presented)).into()
    }
}

impl std::fmt::Debug for ApiKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ApiKey(..)")
    }
}

fn digest(bytes: &[u8]) -> [u8; 32] {
    use sha2::Digest;
    sha2::Sha256::digest(bytes).into()
}

/// Cross-origin reads by web pages (CORS).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum Cors {
    /// No page of another origin may read the answers (no CORS headers are sent).
    #[default]
    Off,
    /// Pages of these origins (`https://app.example.com`) may.
    Origins(Vec<String>),
    /// Pages of any origin may (`*`; fit for a server that needs a key).
    AnyOrigin,
}

/// What the server does with a request field it does not know.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UnknownFields {
    /// A 400 naming the field: a client that depends on it learns it was not applied.
    Refuse,
    /// Ignored, and named in the answer's `x-ignored-fields` header. Fields the server knows
    /// and does not implement (`tools`, `logprobs`, ...) are refused either way.
    Ignore,
}

/// A configuration the server cannot start with.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("an API key must be at least 8 printable ASCII characters, without spaces")]
    BadApiKey,
    #[error("CORS origin {0:?} is not an origin like https://app.example.com")]
    BadOrigin(String),
    #[error("{0} must be at least 1")]
    Zero(&'static str),
}
