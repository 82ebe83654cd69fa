//! An OpenAI-compatible HTTP server over an [`Engine`] (feature `server`): axum on tokio, its
//! connections served by hyper with timeouts ([`ConnectionLimits`]).
//!
//! - `POST /v1/completions` and `POST /v1/chat/completions`, streamed as server-sent events
//!   (`"stream": true`) or not;
//! - `GET /v1/models`, `GET /health` (the engine's worker alive), `GET /ready` (taking
//!   requests now), `GET /metrics` (Prometheus text).
//!
//! Chat messages take OpenAI's content parts: `text`, and `image_url` with a `data:` URL
//! (`data:image/png;base64,...`; PNG, JPEG, WebP or GIF) in user messages, for an engine that
//! reads pictures ([`Engine::with_vision`]); each picture goes where its part is.
//!
//! Every request is checked before the work it asks for starts ([`RequestLimits`]): the body's
//! size, the fields (one the server does not implement is refused, [`UnknownFields`]), the
//! prompt's bytes before tokenizing, the pictures' count and pixels before decoding,
//! `max_tokens` against the room the prompt leaves. Tokenizing and decoding run on blocking
//! threads, a few at a time. Errors come in OpenAI's JSON shape for every status: 400 naming
//! the field, 401 without a known key ([`Access`]), 413, 415 for a body not sent as JSON, 429
//! on a full queue, 503 while shutting down or when the engine's worker failed. The `model`
//! field is not checked against the served model's name (as llama.cpp's server does): the
//! server serves one model.

mod access;
pub mod config;
mod connection;
mod fields;
mod metrics;
pub mod openai;

pub use config::{Access, ApiKey, ConfigError, ConnectionLimits, Cors, RequestLimits, ServerConfig, UnknownFields};

use crate::{
    engine::{Engine, EngineError, EngineHealth, Event, Prompt, Request, RequestStream},
    vision::Picture,
    Error, GenerationConfig, StopReason,
};
use axum::{
    body::Bytes,
    extract::State,
    http::{header, HeaderValue, StatusCode},
    middleware,
    response::{
        sse::{Event as SseEvent, KeepAlive, Sse},
        IntoResponse, Response,
    },
    routing::{get, post},
    Json, Router,
};
use connection::ConnectionCounts;
use openai::{ApiError, FinishReason, RequestBody, Usage};
use serde_json::{json, Value};
use std::{
    convert::Infallible,
    sync::{atomic::AtomicU64, Arc},
    time::{Instant, SystemTime, UNIX_EPOCH},
};
use tokio::sync::Semaphore;

/// The server's shared state: the engine and its settings.
#[derive(Debug)]
pub struct Server {
    engine: Engine,
    config: ServerConfig,
    started: Instant,
    next_id: AtomicU64,
    /// Turns on the blocking threads that tokenize and decode pictures.
    preparing: Arc<Semaphore>,
    connections: Arc<ConnectionCounts>,
    /// Bytes past which a prompt cannot fit a sequence, whatever its tokens.
    prompt_bytes: usize,
    /// The CORS layer, where [`Access::cors`] allows other origins.
    cors: Option<tower_http::cors::CorsLayer>,
}

impl Server {
    /// Serves `engine`; fails on a configuration it cannot serve with (a CORS origin that is
    /// not one, a zero limit).
    pub fn new(engine: Engine, config: ServerConfig) -> Result<Arc<Self>, ConfigError> {
        let cors = access::cors_layer(&config.access.cors)?;
        for (name, value) in [
            ("max_connections", config.connections.max_connections),
            ("prepare_concurrency", config.limits.prepare_concurrency),
            ("default_max_tokens", config.default_max_tokens),
            ("max_body_bytes", config.limits.max_body_bytes),
        ] {
            if value == 0 {
                return Err(ConfigError::Zero(name));
            }
        }
        let fits = engine.sequence_positions().saturating_mul(engine.tokenizer().longest_token_bytes().max(1));
        Ok(Arc::new(Self {
            preparing: Arc::new(Semaphore::new(config.limits.prepare_concurrency)),
            connections: Arc::default(),
            prompt_bytes: config.limits.max_prompt_bytes.min(fits),
            cors,
            engine,
            config,
            started: Instant::now(),
            next_id: AtomicU64::new(1),
        }))
    }

    /// The engine served.
    pub fn engine(&self) -> &Engine {
        &self.engine
    }

    /// The routes, behind the key check, CORS and the JSON error shape.
    pub fn router(self: &Arc<Self>) -> Router {
        let access = Arc::new(self.config.access.clone());
        let routes = Router::new()
            .route("/v1/completions", post(completions))
            .route("/v1/chat/completions", post(chat_completions))
            .route("/v1/models", get(models))
            .route("/health", get(health))
            .route("/ready", get(ready))
            .route("/metrics", get(metrics::handler))
            .fallback(access::not_found)
            .method_not_allowed_fallback(access::method_not_allowed)
            .with_state(Arc::clone(self))
            .layer(middleware::from_fn(move |request, next| access::guard(Arc::clone(&access), request, next)));
        let routes = match &self.cors {
            Some(cors) => routes.layer(cors.clone()),
            None => routes,
        };
        routes.layer(middleware::map_response(access::json_errors))
    }

    /// Serves on `listener` until `shutdown` completes, then lets the requests in flight
    /// finish (within [`ConnectionLimits::shutdown_deadline`]).
    pub async fn serve(
        self: &Arc<Self>,
        listener: tokio::net::TcpListener,
        shutdown: impl std::future::Future<Output = ()> + Send + 'static,
    ) -> std::io::Result<()> {
        let counts = Arc::clone(&self.connections);
        connection::serve(listener, self.router(), self.config.connections, counts, shutdown).await
    }

    fn id(&self, prefix: &str) -> String {
        format!("{prefix}-{}", self.next_id.fetch_add(1, std::sync::atomic::Ordering::Relaxed))
    }
}

fn now() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

/// The body, within the size and time limits: 413 past the size, 408 past the time.
async fn read_body(config: &ServerConfig, request: axum::extract::Request) -> Result<Bytes, ApiError> {
    let max = config.limits.max_body_bytes;
    let too_large = |size: String| {
        ApiError::new(StatusCode::PAYLOAD_TOO_LARGE, format!("a request body of {size} bytes; at most {max}"))
    };
    let declared = request.headers().get(header::CONTENT_LENGTH).and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
    if let Some(declared) = declared.filter(|&d| d > max as u64) {
        return Err(too_large(declared.to_string()));
    }
    let timeout = config.connections.body_timeout;
    match tokio::time::timeout(timeout, axum::body::to_bytes(request.into_body(), max)).await {
        Err(_) => Err(ApiError::new(
            StatusCode::REQUEST_TIMEOUT,
            format!("the request body did not arrive within {} s", timeout.as_secs_f64()),
        )),
        Ok(Ok(bytes)) => Ok(bytes),
        Ok(Err(e)) => {
            let limited = std::error::Error::source(&e)
                .is_some_and(|s| s.downcast_ref::<http_body_util::LengthLimitError>().is_some());
            match limited {
                true => Err(too_large(format!("more than {max}"))),
                false => Err(ApiError::invalid_body(format!("the request body could not be read: {e}"))),
            }
        }
    }
}

/// A JSON body: its fields checked against `endpoint`'s ([`fields::check`]), then read; the
/// fields ignored (where [`UnknownFields::Ignore`]), by path.
fn parse(body: &Bytes, endpoint: Endpoint, unknown: UnknownFields) -> Result<(RequestBody, Vec<String>), ApiError> {
    let value: Value =
        serde_json::from_slice(body).map_err(|e| ApiError::invalid_body(format!("invalid request body: {e}")))?;
    let ignored = fields::check(&value, endpoint, unknown)?;
    let request = serde_path_to_error::deserialize(&value).map_err(|e| {
        let path = e.path().to_string();
        // The top-level field, as OpenAI's `param` names it.
        let field = path.split(['.', '[']).next().filter(|f| !f.is_empty()).map(str::to_string);
        let message = match &field {
            None => format!("invalid request body: {}", e.inner()),
            Some(_) => format!("invalid request body: {path}: {}", e.inner()),
        };
        ApiError { param: field, ..ApiError::invalid_body(message) }
    })?;
    Ok((request, ignored))
}

/// What an engine refusal means to a client; `input` names the field the prompt came in.
fn refused(e: Error, input: &'static str) -> ApiError {
    match e {
        Error::Engine(EngineError::QueueFull { .. }) => ApiError::new(StatusCode::TOO_MANY_REQUESTS, e.to_string()),
        Error::Engine(EngineError::ShutDown | EngineError::WorkerFailed { .. }) => {
            ApiError::new(StatusCode::SERVICE_UNAVAILABLE, e.to_string())
        }
        Error::Sampling(s) => openai::sampling_error(&s),
        e @ Error::Request(crate::error::RequestError::KvCacheTooSmall { .. }) => {
            ApiError::invalid("max_tokens", e.to_string())
        }
        e @ Error::Request(_) => ApiError::invalid(input, e.to_string()),
        e => ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()),
    }
}

/// One request on its way, with its choices (one engine request each): what the two
/// endpoints share.
struct Started {
    streams: Vec<RequestStream>,
    prompt_tokens: usize,
    id: String,
    model: String,
    /// Streams: whether the last chunk carries the usage.
    include_usage: bool,
}

/// A request checked and tokenized, ready for the engine.
struct Prepared {
    ids: Vec<u32>,
    pictures: Vec<Picture>,
    generation: GenerationConfig,
    choices: usize,
    delivery: Delivery,
    include_usage: bool,
    /// The request field the prompt came in.
    field: &'static str,
    /// Fields ignored ([`UnknownFields::Ignore`]), by path.
    ignored: Vec<String>,
}

/// Reads, checks and tokenizes a request to `endpoint`: every limit is checked before the work
/// it bounds, and the tokenizing (with any pictures' decoding) runs on a blocking thread once
/// one of the server's turns for it is free.
async fn prepare(
    server: &Arc<Server>,
    endpoint: Endpoint,
    request: axum::extract::Request,
) -> Result<Prepared, ApiError> {
    let config = &server.config;
    let body = read_body(config, request).await?;
    let (fields, ignored) = parse(&body, endpoint, config.unknown_fields)?;
    let generation = fields.generation(config.default_max_tokens, config.limits.max_stop_bytes)?;
    let field = match endpoint {
        Endpoint::Completions => "prompt",
        Endpoint::Chat => "messages",
    };
    // The prompt's size before any work on it.
    let (bytes, pictures) = match endpoint {
        Endpoint::Completions => match fields.prompt.as_deref() {
            None => return Err(ApiError::invalid("prompt", "missing field `prompt`")),
            Some("") => return Err(ApiError::invalid("prompt", "prompt is empty")),
            Some(p) => (p.len(), 0),
        },
        Endpoint::Chat => match &fields.messages {
            None => return Err(ApiError::invalid("messages", "missing field `messages`")),
            Some(messages) => messages
                .iter()
                .map(openai::Message::size)
                .fold((0usize, 0usize), |(b, p), (mb, mp)| (b.saturating_add(mb), p.saturating_add(mp))),
        },
    };
    if bytes > server.prompt_bytes {
        let message = format!(
            "the prompt's text is {bytes} bytes, more than the {} a request of {} tokens takes: it exceeds the \
             model's context, or this server's limit",
            server.prompt_bytes,
            server.engine.sequence_positions()
        );
        return Err(ApiError::invalid(field, message).with_code("context_length_exceeded"));
    }
    if pictures > config.limits.max_images {
        let message = format!("{pictures} pictures; at most {} per request", config.limits.max_images);
        return Err(ApiError::invalid("messages", message));
    }
    // What is read of the fields after tokenizing, so that they move to the blocking thread
    // (a chat's pictures with them) instead of being copied.
    let asked = fields.max_tokens_asked().map(|n| (n, fields.max_tokens_field()));
    let (choices, delivery) = (fields.choices(), Delivery::of(&fields));
    let include_usage = fields.stream_options.is_some_and(|o| o.include_usage);
    let turn = Arc::clone(&server.preparing).acquire_owned().await.map_err(|_| shutting_down())?;
    let tokenizing = Arc::clone(server);
    let (ids, pictures) = tokio::task::spawn_blocking(move || {
        let _turn = turn;
        tokenize(&tokenizing, endpoint, &fields)
    })
    .await
    .map_err(join_error)??;
    let positions = server.engine.sequence_positions();
    let max_new_tokens = openai::fit_max_tokens(asked, generation.max_new_tokens, ids.len(), positions, field)?;
    Ok(Prepared {
        ids,
        pictures,
        generation: GenerationConfig { max_new_tokens, ..generation },
        choices,
        delivery,
        include_usage,
        field,
        ignored,
    })
}

/// The prompt's token ids and pictures: the chat's pictures decoded, then the engine's
/// [`Engine::prompt_ids`] (the template, the pictures' soft tokens, the tokenizer). Runs on a
/// blocking thread.
fn tokenize(server: &Server, endpoint: Endpoint, fields: &RequestBody) -> Result<(Vec<u32>, Vec<Picture>), ApiError> {
    let (prompt, pictures, field) = match (endpoint, &fields.prompt, &fields.messages) {
        (Endpoint::Completions, Some(prompt), _) => (Prompt::Text(prompt.clone()), Vec::new(), "prompt"),
        (Endpoint::Chat, _, Some(messages)) => {
            let images = server.engine.image_processor().map(|p| (p, server.config.limits.max_image_pixels));
            let chat = openai::conversation(messages, images)?;
            (Prompt::Chat(chat.messages), chat.pictures, "messages")
        }
        _ => return Err(ApiError::invalid_body("the request has no prompt")),
    };
    let ids = server.engine.prompt_ids(prompt, &pictures).map_err(|e| ApiError::invalid(field, e.to_string()))?;
    Ok((ids, pictures))
}

fn shutting_down() -> ApiError {
    ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "the server is shutting down")
}

/// Submits each of `prepared`'s choices to the engine.
fn start(server: &Server, prepared: Prepared, prefix: &str) -> Result<Started, ApiError> {
    let prompt_tokens = prepared.ids.len();
    let mut streams = Vec::new();
    for index in 0..prepared.choices {
        let mut generation = prepared.generation.clone();
        generation.sampling.seed = generation.sampling.seed.wrapping_add(index as u64);
        // On a refusal the choices already queued are cancelled as their streams drop.
        let request =
            Request { prompt: Prompt::Ids(prepared.ids.clone()), generation, images: prepared.pictures.clone() };
        streams.push(server.engine.submit(request).map_err(|e| refused(e, prepared.field))?);
    }
    Ok(Started {
        streams,
        prompt_tokens,
        id: server.id(prefix),
        model: server.config.model_id.clone(),
        include_usage: prepared.include_usage,
    })
}

/// How a generation went.
struct Outcome {
    finish_reason: FinishReason,
    completion_tokens: usize,
}

/// Runs one choice to its end, handing each piece of text to `emit` (whose future says whether
/// the client still listens; the engine holds back text that could begin a stop string, and
/// ends the request at one). No thread waits on the engine: its events come as a stream.
async fn drive<F, Sent>(stream: RequestStream, mut emit: F) -> Result<Outcome, ApiError>
where
    F: FnMut(String) -> Sent,
    Sent: std::future::Future<Output = bool>,
{
    let mut stream = stream.into_async();
    let mut completion_tokens = 0;
    while let Some(event) = futures_lite::StreamExt::next(&mut stream).await {
        match event {
            Ok(Event::Token(token)) => {
                completion_tokens += 1;
                if !token.text.is_empty() && !emit(token.text).await {
                    stream.cancel();
                }
            }
            Ok(Event::Done(finish)) => {
                if !finish.text.is_empty() {
                    emit(finish.text).await;
                }
                let finish_reason = match finish.reason {
                    StopReason::MaxTokens | StopReason::ContextFull => FinishReason::Length,
                    _ => FinishReason::Stop,
                };
                return Ok(Outcome {
                    finish_reason,
                    completion_tokens: finish.generated_tokens.max(completion_tokens),
                });
            }
            Err(e) => return Err(refused(e, "prompt")),
        }
    }
    // The worker went away with the request unfinished.
    Err(ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "the engine stopped before the request finished"))
}

/// Sets a request's cancel flag when dropped.
struct CancelOnDrop(Arc<std::sync::atomic::AtomicBool>);

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        self.0.store(true, std::sync::atomic::Ordering::SeqCst);
    }
}

/// How a response goes out: one JSON body, or server-sent events as the tokens come.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Delivery {
    Whole,
    Streamed,
}

impl Delivery {
    fn of(request: &RequestBody) -> Self {
        if request.stream {
            Self::Streamed
        } else {
            Self::Whole
        }
    }
}

/// Which endpoint a request came to, for the shapes of its responses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Endpoint {
    Completions,
    Chat,
}

impl Endpoint {
    fn object(self, delivery: Delivery) -> &'static str {
        match (self, delivery) {
            (Self::Completions, _) => "text_completion",
            (Self::Chat, Delivery::Whole) => "chat.completion",
            (Self::Chat, Delivery::Streamed) => "chat.completion.chunk",
        }
    }

    /// A choice carrying `text` (a whole answer, or a streamed piece).
    fn choice(
        self,
        index: usize,
        text: Option<&str>,
        finish: Option<FinishReason>,
        delivery: Delivery,
    ) -> serde_json::Value {
        match (self, delivery) {
            (Self::Completions, _) => {
                json!({ "index": index, "text": text.unwrap_or(""), "finish_reason": finish, "logprobs": null })
            }
            (Self::Chat, Delivery::Whole) => json!({
                "index": index,
                "message": { "role": "assistant", "content": text.unwrap_or("") },
                "finish_reason": finish,
            }),
            (Self::Chat, Delivery::Streamed) => {
                let delta = match text {
                    Some(t) => json!({ "content": t }),
                    None => json!({}),
                };
                json!({ "index": index, "delta": delta, "finish_reason": finish })
            }
        }
    }
}

fn join_error(e: tokio::task::JoinError) -> ApiError {
    ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, e.to_string())
}

async fn respond(server: Arc<Server>, started: Started, endpoint: Endpoint, delivery: Delivery) -> Response {
    match delivery {
        Delivery::Whole => respond_whole(started, endpoint).await,
        Delivery::Streamed => respond_streamed(server, started, endpoint),
    }
}

/// Every choice run to its end, then one JSON body.
async fn respond_whole(started: Started, endpoint: Endpoint) -> Response {
    let created = now();
    let Started { streams, prompt_tokens, id, model, .. } = started;
    // A client that goes away drops this future: the guards then cancel its choices.
    let _guards: Vec<CancelOnDrop> = streams.iter().map(|s| CancelOnDrop(s.cancel_flag())).collect();
    let choices: Vec<_> = streams
        .into_iter()
        .map(|stream| {
            tokio::spawn(async move {
                let mut text = String::new();
                let outcome = drive(stream, |piece| {
                    text.push_str(&piece);
                    std::future::ready(true)
                })
                .await;
                outcome.map(|outcome| (text, outcome))
            })
        })
        .collect();
    let mut body = Vec::new();
    let mut completion_tokens = 0;
    for (index, choice) in choices.into_iter().enumerate() {
        let (text, outcome) = match choice.await.map_err(join_error) {
            Ok(Ok(done)) => done,
            Ok(Err(e)) | Err(e) => return e.into_response(),
        };
        completion_tokens += outcome.completion_tokens;
        body.push(endpoint.choice(index, Some(&text), Some(outcome.finish_reason), Delivery::Whole));
    }
    Json(json!({
        "id": id,
        "object": endpoint.object(Delivery::Whole),
        "created": created,
        "model": model,
        "choices": body,
        "usage": Usage::new(prompt_tokens, completion_tokens),
    }))
    .into_response()
}

/// Server-sent events as the choices' tokens come (each chunk naming its choice), a last chunk
/// with the usage, then `[DONE]`. The tasks feeding the events hold `server`, so that its
/// engine outlives them.
fn respond_streamed(server: Arc<Server>, started: Started, endpoint: Endpoint) -> Response {
    let created = now();
    let Started { streams, prompt_tokens, id, model, include_usage } = started;
    let (sender, receiver) = tokio::sync::mpsc::channel::<SseEvent>(64);
    let chunk = Arc::new(move |choices: serde_json::Value, usage: Option<Usage>| {
        let mut body = json!({
            "id": id,
            "object": endpoint.object(Delivery::Streamed),
            "created": created,
            "model": model,
            "choices": choices,
        });
        if let Some(usage) = usage {
            body["usage"] = json!(usage);
        }
        SseEvent::default().data(body.to_string())
    });
    let choices: Vec<_> = streams
        .into_iter()
        .enumerate()
        .map(|(index, stream)| {
            let (sender, chunk) = (sender.clone(), Arc::clone(&chunk));
            tokio::spawn(async move {
                if endpoint == Endpoint::Chat {
                    let role = json!({ "index": index, "delta": { "role": "assistant", "content": "" }, "finish_reason": null });
                    if sender.send(chunk(json!([role]), None)).await.is_err() {
                        stream.cancel();
                    }
                }
                let piece = |text: Option<&str>, finish| json!([endpoint.choice(index, text, finish, Delivery::Streamed)]);
                let outcome = drive(stream, |text| {
                    let (sender, event) = (sender.clone(), chunk(piece(Some(&text), None), None));
                    async move { sender.send(event).await.is_ok() }
                })
                .await;
                let last = match &outcome {
                    Ok(o) => chunk(piece(None, Some(o.finish_reason)), None),
                    Err(e) => SseEvent::default().data(e.body().to_string()),
                };
                let _ = sender.send(last).await;
                outcome.map(|o| o.completion_tokens).unwrap_or(0)
            })
        })
        .collect();
    tokio::spawn(async move {
        let mut completion_tokens = 0;
        for choice in choices {
            completion_tokens += choice.await.unwrap_or(0);
        }
        if include_usage {
            let _ = sender.send(chunk(json!([]), Some(Usage::new(prompt_tokens, completion_tokens)))).await;
        }
        let _ = sender.send(SseEvent::default().data("[DONE]")).await;
        drop(server);
    });
    let events = tokio_stream::wrappers::ReceiverStream::new(receiver);
    let events = tokio_stream::StreamExt::map(events, Ok::<_, Infallible>);
    Sse::new(events).keep_alive(KeepAlive::default()).into_response()
}

async fn completions(State(server): State<Arc<Server>>, request: axum::extract::Request) -> Response {
    handle(server, Endpoint::Completions, request).await
}

async fn chat_completions(State(server): State<Arc<Server>>, request: axum::extract::Request) -> Response {
    handle(server, Endpoint::Chat, request).await
}

async fn handle(server: Arc<Server>, endpoint: Endpoint, request: axum::extract::Request) -> Response {
    let mut prepared = match prepare(&server, endpoint, request).await {
        Ok(prepared) => prepared,
        Err(e) => return e.into_response(),
    };
    let ignored = std::mem::take(&mut prepared.ignored);
    let delivery = prepared.delivery;
    let prefix = match endpoint {
        Endpoint::Completions => "cmpl",
        Endpoint::Chat => "chatcmpl",
    };
    let mut response = match start(&server, prepared, prefix) {
        Ok(started) => respond(Arc::clone(&server), started, endpoint, delivery).await,
        Err(e) => e.into_response(),
    };
    if !ignored.is_empty() {
        // Field names as JSON gave them: shown escaped where a header cannot carry them.
        let names: String = ignored.join(", ").chars().flat_map(char::escape_default).collect();
        if let Ok(value) = HeaderValue::from_str(&names) {
            response.headers_mut().insert("x-ignored-fields", value);
        }
    }
    response
}

async fn models(State(server): State<Arc<Server>>) -> Json<serde_json::Value> {
    Json(json!({
        "object": "list",
        "data": [{ "id": server.config.model_id, "object": "model", "created": now(), "owned_by": "burn-gemma" }],
    }))
}

/// Whether the engine's worker is alive: 200 while it serves (or finishes the requests in
/// flight at a shutdown), 503 once it has stopped or failed.
async fn health(State(server): State<Arc<Server>>) -> Response {
    match server.engine.health() {
        EngineHealth::Serving | EngineHealth::Stopping => Json(json!({ "status": "ok" })).into_response(),
        EngineHealth::Stopped => {
            (StatusCode::SERVICE_UNAVAILABLE, Json(json!({ "status": "stopped" }))).into_response()
        }
        EngineHealth::Failed { reason } => {
            (StatusCode::SERVICE_UNAVAILABLE, Json(json!({ "status": "error", "reason": reason }))).into_response()
        }
    }
}

/// Whether a request sent now would be taken: the worker serving and the queue not full.
async fn ready(State(server): State<Arc<Server>>) -> Response {
    let engine = &server.engine;
    let waiting = engine.metrics().waiting.load(std::sync::atomic::Ordering::Relaxed);
    let reason = match engine.health() {
        EngineHealth::Serving if waiting < engine.config().max_waiting => None,
        EngineHealth::Serving => Some(format!("the queue is full ({waiting} requests waiting)")),
        EngineHealth::Stopping | EngineHealth::Stopped => Some("shutting down".into()),
        EngineHealth::Failed { reason } => Some(format!("the engine's worker failed: {reason}")),
    };
    match reason {
        None => Json(json!({ "status": "ready" })).into_response(),
        Some(reason) => {
            (StatusCode::SERVICE_UNAVAILABLE, Json(json!({ "status": "not ready", "reason": reason }))).into_response()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::{tests::tiny_engine, Fault};

    /// A worker that stopped on a failure turns `/health`, `/ready` and the metric to failed, and
    /// requests get a 503 naming it.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_failed_worker_is_reported_not_hidden() -> Result<(), Box<dyn std::error::Error>> {
        let server = Server::new(tiny_engine()?, ServerConfig::new("tiny"))?;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let base = format!("http://{}", listener.local_addr()?);
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let serving = Arc::clone(&server);
        let task = tokio::spawn(async move {
            serving
                .serve(listener, async move {
                    let _ = stopped.await;
                })
                .await
        });
        let get = |path: &'static str| {
            let base = base.clone();
            async move {
                let response = reqwest::get(format!("{base}{path}")).await?;
                Ok::<_, reqwest::Error>((response.status().as_u16(), response.text().await?))
            }
        };
        assert_eq!(get("/health").await?, (200, json!({ "status": "ok" }).to_string()));
        assert_eq!(get("/ready").await?.0, 200);
        server.engine.inject(Fault::Worker);
        let started = Instant::now();
        while get("/health").await?.0 == 200 {
            assert!(started.elapsed() < std::time::Duration::from_secs(30), "the failure was not reported");
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        }
        let (status, text) = get("/health").await?;
        assert_eq!(status, 503);
        let health: Value = serde_json::from_str(&text)?;
        assert_eq!(health["status"], "error");
        assert!(health["reason"].as_str().is_some_and(|r| r.contains("a fault injected")), "{text}");
        assert_eq!(get("/ready").await?.0, 503);
        assert!(get("/metrics").await?.1.contains("burn_gemma_engine_up 0"));
        let response = reqwest::Client::new()
            .post(format!("{base}/v1/completions"))
            .json(&json!({ "prompt": "hi", "max_tokens": 2 }))
            .send()
            .await?;
        assert_eq!(response.status().as_u16(), 503);
        let body: Value = response.json().await?;
        assert!(body["error"]["message"].as_str().is_some_and(|m| m.contains("worker failed")), "{body}");
        let _ = stop.send(());
        task.await??;
        Ok(())
    }
}
