//! An OpenAI-compatible HTTP server over an [`Engine`] (feature `server`): axum on tokio.
//!
//! - `POST /v1/completions` and `POST /v1/chat/completions`, streamed as server-sent events
//!   (`"stream": true`) or not;
//! - `GET /v1/models`, `GET /health`, `GET /metrics` (Prometheus text).
//!
//! Chat messages take OpenAI's content parts: `text`, and `image_url` with a `data:` URL
//! (`data:image/png;base64,...`; PNG, JPEG, WebP or GIF) in user messages, for an engine that
//! reads pictures ([`Engine::with_vision`]); each picture goes where its part is. Bodies up to
//! [`MAX_BODY_BYTES`].
//!
//! A bad request gets a 400 with an OpenAI-style JSON error naming the field; a full queue a
//! 429; a server shutting down a 503. The `model` field of a request is not checked against the
//! served model's name (as llama.cpp's server does): the server serves one model.

mod metrics;
pub mod openai;

use crate::{
    chat::ChatTemplate,
    engine::{Engine, EngineError, Event, Request, RequestStream},
    tokenizer::Bos,
    vision::Picture,
    Error, StopReason,
};
use axum::{
    body::Bytes,
    extract::{DefaultBodyLimit, State},
    http::StatusCode,
    response::{
        sse::{Event as SseEvent, KeepAlive, Sse},
        IntoResponse, Response,
    },
    routing::{get, post},
    Json, Router,
};
use openai::{ApiError, FinishReason, RequestBody, Usage};
use serde_json::json;
use std::{
    convert::Infallible,
    sync::{atomic::AtomicU64, Arc},
    time::{Instant, SystemTime, UNIX_EPOCH},
};

/// The largest request body read: room for a few pictures as base64 data URLs (axum's default
/// is 2 MB).
pub const MAX_BODY_BYTES: usize = 32 << 20;

/// What the server is told at start.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// The name `/v1/models` lists and responses carry.
    pub model_id: String,
    /// `max_tokens` of a request that gives none.
    pub default_max_tokens: usize,
}

/// The server's shared state: the engine and its settings.
#[derive(Debug)]
pub struct Server {
    engine: Engine,
    config: ServerConfig,
    template: ChatTemplate,
    started: Instant,
    next_id: AtomicU64,
}

impl Server {
    /// Serves `engine`, whose model's chat layout is `template`.
    pub fn new(engine: Engine, template: ChatTemplate, config: ServerConfig) -> Arc<Self> {
        Arc::new(Self { engine, config, template, started: Instant::now(), next_id: AtomicU64::new(1) })
    }

    /// The engine served.
    pub fn engine(&self) -> &Engine {
        &self.engine
    }

    /// The routes.
    pub fn router(self: &Arc<Self>) -> Router {
        Router::new()
            .route("/v1/completions", post(completions))
            .route("/v1/chat/completions", post(chat_completions))
            .route("/v1/models", get(models))
            .route("/health", get(health))
            .route("/metrics", get(metrics::handler))
            .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
            .with_state(Arc::clone(self))
    }

    /// Serves on `listener` until `shutdown` completes, then lets the requests in flight
    /// finish.
    pub async fn serve(
        self: &Arc<Self>,
        listener: tokio::net::TcpListener,
        shutdown: impl std::future::Future<Output = ()> + Send + 'static,
    ) -> std::io::Result<()> {
        axum::serve(listener, self.router()).with_graceful_shutdown(shutdown).await
    }

    fn id(&self, prefix: &str) -> String {
        format!("{prefix}-{}", self.next_id.fetch_add(1, std::sync::atomic::Ordering::Relaxed))
    }
}

fn now() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

/// A JSON body, or a 400 naming what is wrong with it and where.
fn parse(body: &Bytes) -> Result<RequestBody, ApiError> {
    let mut json = serde_json::Deserializer::from_slice(body);
    serde_path_to_error::deserialize(&mut json).map_err(|e| {
        let path = e.path().to_string();
        // The top-level field, as OpenAI's `param` names it.
        let field = path.split(['.', '[']).next().filter(|f| !f.is_empty()).map(str::to_string);
        let message = match &field {
            None => format!("invalid request body: {}", e.inner()),
            Some(_) => format!("invalid request body: {path}: {}", e.inner()),
        };
        ApiError { status: StatusCode::BAD_REQUEST, message, param: field }
    })
}

/// What an engine refusal means to a client; `input` names the field the prompt came in.
fn refused(e: EngineError, input: &'static str) -> ApiError {
    match e {
        EngineError::QueueFull { .. } => {
            ApiError { status: StatusCode::TOO_MANY_REQUESTS, message: e.to_string(), param: None }
        }
        EngineError::ShutDown => {
            ApiError { status: StatusCode::SERVICE_UNAVAILABLE, message: e.to_string(), param: None }
        }
        EngineError::Generation(Error::Sampling(s)) => openai::sampling_error(&s),
        EngineError::Generation(e @ Error::Request(crate::error::RequestError::KvCacheTooSmall { .. })) => {
            ApiError::invalid("max_tokens", e.to_string())
        }
        EngineError::Generation(e @ Error::Request(_)) => ApiError::invalid(input, e.to_string()),
        EngineError::Generation(e) => {
            ApiError { status: StatusCode::INTERNAL_SERVER_ERROR, message: e.to_string(), param: None }
        }
    }
}

/// One request on its way, with its choices (one engine request each): what the two
/// endpoints share.
struct Started {
    streams: Vec<RequestStream>,
    prompt_tokens: usize,
    id: String,
    model: String,
}

/// What a request's prompt is: its text, and the pictures at its places.
struct Prompt<'a> {
    text: &'a str,
    pictures: Vec<Picture>,
    /// The request field it came in.
    field: &'static str,
}

fn start(server: &Server, prompt: Prompt<'_>, fields: &RequestBody, prefix: &str) -> Result<Started, ApiError> {
    let (generation, stops) = fields.generation(server.config.default_max_tokens)?;
    let input = prompt.field;
    let tokenizer = server.engine.tokenizer();
    let text = match server.engine.image_processor() {
        Some(processor) if !prompt.pictures.is_empty() => processor
            .expand(prompt.text, &prompt.pictures, tokenizer)
            .map_err(|e| ApiError::invalid(input, e.to_string()))?,
        _ => prompt.text.to_string(),
    };
    let ids = tokenizer.encode(&text, Bos::Prepend).map_err(|e| ApiError::invalid(input, e.to_string()))?;
    let prompt_tokens = ids.len();
    let mut streams = Vec::new();
    for index in 0..fields.choices() {
        let mut generation = generation.clone();
        generation.sampling.seed = generation.sampling.seed.wrapping_add(index as u64);
        // On a refusal the choices already queued are cancelled as their streams drop.
        let request =
            Request { input: ids.clone(), generation, stop_strings: stops.clone(), images: prompt.pictures.clone() };
        streams.push(server.engine.submit(request).map_err(|e| refused(e, input))?);
    }
    Ok(Started { streams, prompt_tokens, id: server.id(prefix), model: server.config.model_id.clone() })
}

/// How a generation went.
struct Outcome {
    finish_reason: FinishReason,
    completion_tokens: usize,
}

/// Runs one choice to its end on this (blocking) thread, handing each piece of text to `emit`
/// (which says whether the client still listens; the engine holds back text that could begin
/// a stop string, and ends the request at one).
fn drive(stream: &RequestStream, mut emit: impl FnMut(&str) -> bool) -> Result<Outcome, ApiError> {
    let mut completion_tokens = 0;
    for event in stream.events() {
        match event {
            Ok(Event::Token(token)) => {
                completion_tokens += 1;
                if !token.text.is_empty() && !emit(&token.text) {
                    stream.cancel();
                }
            }
            Ok(Event::Done(finish)) => {
                if !finish.text.is_empty() {
                    emit(&finish.text);
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
    Err(ApiError {
        status: StatusCode::INTERNAL_SERVER_ERROR,
        message: "the request ended without finishing".into(),
        param: None,
    })
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
    ApiError { status: StatusCode::INTERNAL_SERVER_ERROR, message: e.to_string(), param: None }
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
    let Started { streams, prompt_tokens, id, model } = started;
    // A client that goes away drops this future: the guards then cancel its choices.
    let _guards: Vec<CancelOnDrop> = streams.iter().map(|s| CancelOnDrop(s.cancel_flag())).collect();
    let choices: Vec<_> = streams
        .into_iter()
        .map(|stream| {
            tokio::task::spawn_blocking(move || {
                let mut text = String::new();
                drive(&stream, |piece| {
                    text.push_str(piece);
                    true
                })
                .map(|outcome| (text, outcome))
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
    let Started { streams, prompt_tokens, id, model } = started;
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
            tokio::task::spawn_blocking(move || {
                if endpoint == Endpoint::Chat {
                    let role = json!({ "index": index, "delta": { "role": "assistant", "content": "" }, "finish_reason": null });
                    if sender.blocking_send(chunk(json!([role]), None)).is_err() {
                        stream.cancel();
                    }
                }
                let piece = |text: Option<&str>, finish| json!([endpoint.choice(index, text, finish, Delivery::Streamed)]);
                let outcome = drive(&stream, |text| sender.blocking_send(chunk(piece(Some(text), None), None)).is_ok());
                let last = match &outcome {
                    Ok(o) => chunk(piece(None, Some(o.finish_reason)), None),
                    Err(e) => SseEvent::default().data(e.body().to_string()),
                };
                let _ = sender.blocking_send(last);
                outcome.map(|o| o.completion_tokens).unwrap_or(0)
            })
        })
        .collect();
    tokio::spawn(async move {
        let mut completion_tokens = 0;
        for choice in choices {
            completion_tokens += choice.await.unwrap_or(0);
        }
        let _ = sender.send(chunk(json!([]), Some(Usage::new(prompt_tokens, completion_tokens)))).await;
        let _ = sender.send(SseEvent::default().data("[DONE]")).await;
        drop(server);
    });
    let events = tokio_stream::wrappers::ReceiverStream::new(receiver);
    let events = tokio_stream::StreamExt::map(events, Ok::<_, Infallible>);
    Sse::new(events).keep_alive(KeepAlive::default()).into_response()
}

async fn completions(State(server): State<Arc<Server>>, body: Bytes) -> Response {
    let request = match parse(&body) {
        Ok(r) => r,
        Err(e) => return e.into_response(),
    };
    let prompt = match request.prompt.as_deref() {
        None => return ApiError::invalid("prompt", "missing field `prompt`").into_response(),
        Some("") => return ApiError::invalid("prompt", "prompt is empty").into_response(),
        Some(p) => p,
    };
    let prompt = Prompt { text: prompt, pictures: Vec::new(), field: "prompt" };
    match start(&server, prompt, &request, "cmpl") {
        Ok(started) => respond(Arc::clone(&server), started, Endpoint::Completions, Delivery::of(&request)).await,
        Err(e) => e.into_response(),
    }
}

async fn chat_completions(State(server): State<Arc<Server>>, body: Bytes) -> Response {
    let request = match parse(&body) {
        Ok(r) => r,
        Err(e) => return e.into_response(),
    };
    let Some(messages) = &request.messages else {
        return ApiError::invalid("messages", "missing field `messages`").into_response();
    };
    // Pictures are decoded off the async threads.
    let rendered = match messages.iter().any(|m| m.content.has_images()) {
        false => openai::render_chat(server.template, messages, None),
        true => {
            let (server, messages) = (Arc::clone(&server), messages.clone());
            let render = move || openai::render_chat(server.template, &messages, server.engine.image_processor());
            tokio::task::spawn_blocking(render).await.unwrap_or_else(|e| Err(join_error(e)))
        }
    };
    let chat = match rendered {
        Ok(chat) => chat,
        Err(e) => return e.into_response(),
    };
    let prompt = Prompt { text: &chat.text, pictures: chat.pictures, field: "messages" };
    match start(&server, prompt, &request, "chatcmpl") {
        Ok(started) => respond(Arc::clone(&server), started, Endpoint::Chat, Delivery::of(&request)).await,
        Err(e) => e.into_response(),
    }
}

async fn models(State(server): State<Arc<Server>>) -> Json<serde_json::Value> {
    Json(json!({
        "object": "list",
        "data": [{ "id": server.config.model_id, "object": "model", "created": now(), "owned_by": "burn-gemma" }],
    }))
}

async fn health() -> Json<serde_json::Value> {
    Json(json!({ "status": "ok" }))
}
