//! The OpenAI-compatible server on a tiny model, hit by a real HTTP client (reqwest): both
//! endpoints streamed and not, answers equal to the plain generator's, stop strings, bad
//! requests refused with OpenAI-style errors naming the field, a full queue refused with 429,
//! 200 requests at 32 concurrent all answered once, the engine's counters back to zero, and a
//! clean shutdown.

use crate::common;

use burn::tensor::DType;
use burn_gemma::{
    backends::NdArray,
    chat::ChatTemplate,
    engine::{Engine, EngineConfig},
    server::{Server, ServerConfig},
    Checkpoint, Gemma, GenerationConfig, Generator, LoadOptions, SamplingConfig,
};
use serde_json::{json, Value};
use std::{collections::HashSet, num::NonZeroUsize, sync::atomic::Ordering, sync::Arc};

const FIXTURE: &str = "tiny-gemma/gemma3";

pub(crate) fn model() -> Gemma<NdArray> {
    let options = LoadOptions::<NdArray>::new().dtype(DType::F32);
    Checkpoint::open(common::fixtures().join(FIXTURE)).expect("open").load(options).expect("load").model
}

/// The tiny model with a context of `positions` (its config says 256; nothing else in it
/// depends on that number): for requests that must run long.
pub(crate) fn long_context_model(positions: usize) -> Gemma<NdArray> {
    let dir = common::Scratch::new("long-context");
    let fixture = common::fixtures().join(FIXTURE);
    let mut config: Value =
        serde_json::from_slice(&std::fs::read(fixture.join("config.json")).expect("config")).expect("config JSON");
    config["max_position_embeddings"] = json!(positions);
    std::fs::write(dir.join("config.json"), config.to_string()).expect("write config");
    std::fs::copy(fixture.join("model.safetensors"), dir.join("model.safetensors")).expect("copy weights");
    let options = LoadOptions::<NdArray>::new().dtype(DType::F32);
    Checkpoint::open(&*dir).expect("open").load(options).expect("load").model
}

/// What the plain generator answers to `prompt` greedily in `max_new_tokens`.
fn alone(prompt: &str, max_new_tokens: usize) -> String {
    alone_sampled(prompt, max_new_tokens, SamplingConfig::default())
}

/// What the plain generator answers to `prompt` with `sampling`.
fn alone_sampled(prompt: &str, max_new_tokens: usize, sampling: SamplingConfig) -> String {
    let mut generator = Generator::new(model(), common::tiny_tokenizer()).expect("generator");
    let config = GenerationConfig { max_new_tokens, sampling, ..GenerationConfig::default() };
    generator.generate(prompt, &config, |_| {}).expect("generate").text
}

/// A running server and how to stop it.
pub(crate) struct Running {
    pub(crate) base: String,
    pub(crate) server: Arc<Server>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<std::io::Result<()>>,
}

async fn start(config: EngineConfig) -> Running {
    let server = ServerConfig { default_max_tokens: 8, ..ServerConfig::new("tiny-gemma3") };
    start_with(model(), config, server).await
}

/// A server of `model` with these settings, on a port of its own.
pub(crate) async fn start_with(model: Gemma<NdArray>, config: EngineConfig, server: ServerConfig) -> Running {
    let engine = Engine::new(model, common::tiny_tokenizer(), config).expect("engine");
    let server = Server::new(engine, server).expect("server");
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let base = format!("http://{}", listener.local_addr().expect("address"));
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let serving = Arc::clone(&server);
    let task = tokio::spawn(async move {
        serving
            .serve(listener, async move {
                let _ = stopped.await;
            })
            .await
    });
    Running { base, server, stop: Some(stop), task }
}

impl Running {
    pub(crate) async fn post(&self, path: &str, body: &Value) -> (u16, String) {
        let response =
            reqwest::Client::new().post(format!("{}{path}", self.base)).json(body).send().await.expect("post");
        let status = response.status().as_u16();
        (status, response.text().await.expect("body"))
    }

    pub(crate) async fn shutdown(mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        let done = tokio::time::timeout(std::time::Duration::from_secs(30), self.task).await;
        assert!(matches!(done, Ok(Ok(Ok(())))), "the server did not shut down cleanly: {done:?}");
    }
}

/// The text of a streamed response's first choice: its events' pieces joined, and its finish
/// reason.
fn streamed(body: &str, chat: bool) -> (String, String) {
    streamed_choice(body, chat, 0)
}

/// The text and finish reason of choice `index` of a streamed response.
fn streamed_choice(body: &str, chat: bool, index: u64) -> (String, String) {
    let events: Vec<&str> = body.lines().filter_map(|l| l.strip_prefix("data: ")).collect();
    assert_eq!(events.last(), Some(&"[DONE]"), "the stream does not end with [DONE]: {body}");
    let mut text = String::new();
    let mut finish = String::new();
    for event in &events[..events.len() - 1] {
        let chunk: Value = serde_json::from_str(event).expect("chunk JSON");
        let Some(choice) = chunk["choices"].as_array().and_then(|c| c.iter().find(|c| c["index"] == index)) else {
            continue;
        };
        let piece = if chat { &choice["delta"]["content"] } else { &choice["text"] };
        text.push_str(piece.as_str().unwrap_or(""));
        if let Some(f) = choice["finish_reason"].as_str() {
            finish = f.to_string();
        }
    }
    (text, finish)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn answers_as_the_generator_does_streamed_or_not() {
    let running = start(EngineConfig::default()).await;
    let client = reqwest::Client::new();
    let health: Value = client.get(format!("{}/health", running.base)).send().await.unwrap().json().await.unwrap();
    assert_eq!(health, json!({ "status": "ok" }));
    let models: Value = client.get(format!("{}/v1/models", running.base)).send().await.unwrap().json().await.unwrap();
    assert_eq!(models["data"][0]["id"], "tiny-gemma3");

    let prompt = "The quick brown fox";
    let expected = alone(prompt, 12);
    let body = json!({ "model": "x", "prompt": prompt, "max_tokens": 12, "temperature": 0 });
    let (status, text) = running.post("/v1/completions", &body).await;
    assert_eq!(status, 200, "{text}");
    let answer: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(answer["object"], "text_completion");
    assert_eq!(answer["choices"][0]["text"], expected.as_str());
    let completion_tokens = answer["usage"]["completion_tokens"].as_u64().unwrap();
    assert!((1..=12).contains(&completion_tokens), "{answer}");
    assert!(!expected.is_empty(), "the fixture's greedy answer to {prompt:?} is empty");
    let mut streaming = body.clone();
    streaming["stream"] = json!(true);
    let (status, text) = running.post("/v1/completions", &streaming).await;
    assert_eq!(status, 200);
    let (streamed_text, finish) = streamed(&text, false);
    assert_eq!(streamed_text, expected);
    assert_eq!(finish, answer["choices"][0]["finish_reason"].as_str().unwrap());

    // Chat: the same answer as the generator's on the rendered template.
    let chat_prompt = ChatTemplate::Gemma.user_turn("Hello there");
    let expected = alone(&chat_prompt, 10);
    let body = json!({ "model": "x", "messages": [{ "role": "user", "content": "Hello there" }], "max_tokens": 10, "temperature": 0 });
    let (status, text) = running.post("/v1/chat/completions", &body).await;
    assert_eq!(status, 200, "{text}");
    let answer: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(answer["object"], "chat.completion");
    assert_eq!(answer["choices"][0]["message"]["role"], "assistant");
    assert_eq!(answer["choices"][0]["message"]["content"], expected.as_str());
    let mut streaming = body.clone();
    streaming["stream"] = json!(true);
    let (_, text) = running.post("/v1/chat/completions", &streaming).await;
    assert_eq!(streamed(&text, true).0, expected);

    // Three choices, sampled with seeds 5, 6 and 7: each is the generator's answer with its seed.
    let sampled = |seed| SamplingConfig { temperature: 0.9, top_k: Some(40), seed, ..SamplingConfig::default() };
    let expected: Vec<String> = (5..8).map(|seed| alone_sampled(prompt, 10, sampled(seed))).collect();
    assert!(expected.iter().collect::<HashSet<_>>().len() > 1, "the seeds gave one answer: {expected:?}");
    let body = json!({ "prompt": prompt, "max_tokens": 10, "temperature": 0.9, "top_k": 40, "seed": 5, "n": 3 });
    let (status, text) = running.post("/v1/completions", &body).await;
    assert_eq!(status, 200, "{text}");
    let answer: Value = serde_json::from_str(&text).unwrap();
    for (i, e) in expected.iter().enumerate() {
        assert_eq!(answer["choices"][i]["index"], i);
        assert_eq!(answer["choices"][i]["text"], e.as_str(), "choice {i}");
    }
    let mut streaming = body.clone();
    streaming["stream"] = json!(true);
    let (_, text) = running.post("/v1/completions", &streaming).await;
    for (i, e) in expected.iter().enumerate() {
        assert_eq!(&streamed_choice(&text, false, i as u64).0, e, "streamed choice {i}");
    }

    // A stop string cuts the answer before it.
    let full = alone(prompt, 12);
    let cut = full.char_indices().nth(full.chars().count() / 2).map(|(i, _)| i).unwrap();
    let stop: String = full[cut..].chars().take(2).collect();
    let before = &full[..full.find(&stop).unwrap()];
    for stream in [false, true] {
        let body = json!({ "prompt": prompt, "max_tokens": 12, "temperature": 0, "stop": [stop], "stream": stream });
        let (status, text) = running.post("/v1/completions", &body).await;
        assert_eq!(status, 200);
        let (got, finish) = if stream {
            streamed(&text, false)
        } else {
            let v: Value = serde_json::from_str(&text).unwrap();
            (
                v["choices"][0]["text"].as_str().unwrap().to_string(),
                v["choices"][0]["finish_reason"].as_str().unwrap().to_string(),
            )
        };
        assert_eq!((got.as_str(), finish.as_str()), (before, "stop"), "stop {stop:?} in {full:?}, streamed: {stream}");
    }
    running.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn bad_requests_get_openai_errors_naming_the_field() {
    let running = start(EngineConfig::default()).await;
    let user = json!([{ "role": "user", "content": "hi" }]);
    let cases: Vec<(&str, Value, Option<&str>, &str)> = vec![
        ("/v1/chat/completions", json!({ "model": "x" }), Some("messages"), "missing field `messages`"),
        ("/v1/chat/completions", json!({ "messages": "hi" }), Some("messages"), "messages: invalid type"),
        (
            "/v1/chat/completions",
            json!({ "messages": user, "temperature": "hot" }),
            Some("temperature"),
            "temperature: invalid type",
        ),
        (
            "/v1/chat/completions",
            json!({ "messages": [{ "role": "user" }] }),
            Some("messages"),
            "messages[0]: missing field `content`",
        ),
        ("/v1/chat/completions", json!({ "messages": [] }), Some("messages"), "messages is empty"),
        (
            "/v1/chat/completions",
            json!({ "messages": [{ "role": "robot", "content": "a" }] }),
            Some("messages"),
            "role",
        ),
        ("/v1/chat/completions", json!({ "messages": user, "temperature": 5 }), Some("temperature"), "outside [0, 2]"),
        ("/v1/chat/completions", json!({ "messages": user, "max_tokens": 0 }), Some("max_tokens"), "at least 1"),
        ("/v1/chat/completions", json!({ "messages": user, "n": 9 }), Some("n"), "from 1 to 8 choices"),
        ("/v1/chat/completions", json!({ "messages": user, "top_p": 1.5 }), Some("top_p"), "outside (0, 1]"),
        ("/v1/completions", json!({ "prompt": "" }), Some("prompt"), "prompt is empty"),
        ("/v1/completions", json!({ "prompt": 7 }), Some("prompt"), "prompt: invalid type"),
        ("/v1/completions", json!({ "max_tokens": 7 }), Some("prompt"), "missing field `prompt`"),
        ("/v1/completions", json!({ "prompt": "a".repeat(100_000) }), Some("prompt"), "exceeds the model's context"),
    ];
    for (path, body, param, says) in cases {
        let (status, text) = running.post(path, &body).await;
        assert_eq!(status, 400, "{path} {body}: {text}");
        let error: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{text}: {e}"));
        assert_eq!(error["error"]["type"], "invalid_request_error", "{text}");
        assert_eq!(error["error"]["param"].as_str(), param, "{text}");
        assert!(error["error"]["message"].as_str().unwrap().contains(says), "{text} does not say {says:?}");
    }
    let raw = reqwest::Client::new()
        .post(format!("{}/v1/completions", running.base))
        .header("content-type", "application/json")
        .body("{not json")
        .send()
        .await
        .unwrap();
    assert_eq!(raw.status().as_u16(), 400);
    // The server still answers.
    let (status, _) = running.post("/v1/chat/completions", &json!({ "messages": user, "max_tokens": 2 })).await;
    assert_eq!(status, 200);
    running.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_full_queue_gets_429_and_a_gone_client_frees_its_place() {
    // A context long enough for a request that runs until its client goes away.
    let config = EngineConfig {
        max_running: NonZeroUsize::new(1).unwrap(),
        max_waiting: 1,
        max_sequence_len: NonZeroUsize::new(131_072).unwrap(),
        ..EngineConfig::default()
    };
    let server = ServerConfig { default_max_tokens: 8, ..ServerConfig::new("tiny-gemma3") };
    let running = start_with(long_context_model(131_072), config, server).await;
    let long = json!({ "prompt": "Once upon a time", "max_tokens": 100_000, "temperature": 0, "stream": true });
    // The first runs (its first event is out), the second waits, the third is refused.
    let mut first =
        reqwest::Client::new().post(format!("{}/v1/completions", running.base)).json(&long).send().await.unwrap();
    assert_eq!(first.status().as_u16(), 200);
    let _ = first.chunk().await.unwrap().expect("a first event");
    let base = running.base.clone();
    let second = tokio::spawn(async move {
        let mut short = long.clone();
        short["stream"] = json!(false);
        short["max_tokens"] = json!(3);
        reqwest::Client::new()
            .post(format!("{base}/v1/completions"))
            .json(&short)
            .send()
            .await
            .unwrap()
            .status()
            .as_u16()
    });
    // Until the second is queued.
    while running.server.engine().metrics().waiting.load(Ordering::SeqCst) == 0 {
        tokio::time::sleep(std::time::Duration::from_millis(2)).await;
    }
    let (status, text) = running.post("/v1/completions", &json!({ "prompt": "x", "max_tokens": 2 })).await;
    assert_eq!(status, 429, "{text}");
    let error: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(error["error"]["type"], "rate_limit_exceeded");
    // The first client goes away: its request is cancelled and the second runs.
    drop(first);
    assert_eq!(tokio::time::timeout(std::time::Duration::from_secs(60), second).await.unwrap().unwrap(), 200);
    running.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 8)]
async fn two_hundred_requests_at_32_concurrent_are_all_answered_once() {
    let config =
        EngineConfig { max_running: NonZeroUsize::new(8).unwrap(), max_waiting: 256, ..EngineConfig::default() };
    let running = Arc::new(start(config).await);
    let prompts: Vec<String> = (0..10).map(|i| format!("Request number {i}: tell me")).collect();
    let expected: Vec<String> = prompts.iter().map(|p| alone(&ChatTemplate::Gemma.user_turn(p), 6)).collect();
    assert!(expected.iter().all(|e| !e.is_empty()), "{expected:?}");
    println!("expected answers: {expected:?}");
    let rss_before = burn_gemma::backends::resident_bytes();
    let semaphore = Arc::new(tokio::sync::Semaphore::new(32));
    let mut tasks = Vec::new();
    for i in 0..200usize {
        let (running, semaphore, prompt) = (Arc::clone(&running), Arc::clone(&semaphore), prompts[i % 10].clone());
        tasks.push(tokio::spawn(async move {
            let _permit = semaphore.acquire().await.unwrap();
            let stream = i % 2 == 1;
            let body = json!({
                "messages": [{ "role": "user", "content": prompt }],
                "max_tokens": 6, "temperature": 0, "stream": stream,
            });
            let (status, text) = running.post("/v1/chat/completions", &body).await;
            assert_eq!(status, 200, "request {i}: {text}");
            if stream {
                let id = text
                    .lines()
                    .find_map(|l| l.strip_prefix("data: "))
                    .map(|e| serde_json::from_str::<Value>(e).unwrap()["id"].as_str().unwrap().to_string());
                (i, id.unwrap(), streamed(&text, true).0)
            } else {
                let v: Value = serde_json::from_str(&text).unwrap();
                (
                    i,
                    v["id"].as_str().unwrap().to_string(),
                    v["choices"][0]["message"]["content"].as_str().unwrap().to_string(),
                )
            }
        }));
    }
    let mut ids = HashSet::new();
    for task in tasks {
        let (i, id, text) = task.await.expect("request task");
        assert_eq!(text, expected[i % 10], "request {i}");
        assert!(ids.insert(id.clone()), "response id {id} came twice");
    }
    assert_eq!(ids.len(), 200);
    let metrics = running.server.engine().metrics();
    assert_eq!(metrics.running.load(Ordering::SeqCst), 0);
    assert_eq!(metrics.waiting.load(Ordering::SeqCst), 0);
    assert_eq!(metrics.kv_sequences_in_use.load(Ordering::SeqCst), 0);
    assert_eq!(metrics.requests_finished.load(Ordering::SeqCst), 200);
    // Decode steps ran several requests at once.
    let (steps, rows) = (metrics.decode_steps.load(Ordering::SeqCst), metrics.decode_rows.load(Ordering::SeqCst));
    println!("{steps} decode steps of {:.2} sequences on average", rows as f64 / steps.max(1) as f64);
    assert!(rows > steps, "{rows} sequences in {steps} decode steps");
    assert_eq!(metrics.requests_failed.load(Ordering::SeqCst), 0);
    let text = reqwest::get(format!("{}/metrics", running.base)).await.unwrap().text().await.unwrap();
    assert!(text.contains("burn_gemma_requests_finished_total 200"), "{text}");
    assert!(text.contains("burn_gemma_requests_running 0"), "{text}");
    // Every request got a first token, after a positive time.
    assert!(text.contains("burn_gemma_time_to_first_token_seconds_count 200"), "{text}");
    let ttft_sum: f64 = text
        .lines()
        .find_map(|l| l.strip_prefix("burn_gemma_time_to_first_token_seconds_sum "))
        .and_then(|v| v.parse().ok())
        .expect("the time-to-first-token sum");
    assert!(ttft_sum > 0.0, "{text}");
    println!("mean time to first token under 32 concurrent requests: {:.1} ms", ttft_sum / 200.0 * 1e3);
    if let (Some(before), Some(after)) = (rss_before, burn_gemma::backends::resident_bytes()) {
        println!(
            "resident memory {:.1} MB before the 200 requests, {:.1} MB after",
            before as f64 / 1e6,
            after as f64 / 1e6
        );
    }
    match Arc::try_unwrap(running) {
        Ok(running) => running.shutdown().await,
        Err(_) => panic!("a request task still holds the server"),
    }
}
