//! The server against hostile clients, over local HTTP: requests that once killed the engine
//! or ran unbounded work, every numeric field out of range, broken JSON and HTTP, slow and
//! non-reading clients, disconnects, floods, missing keys; then a seeded fuzzer of request
//! bodies. After each, the server still answers, nothing it ran is left holding resources, and
//! no status but 503 (overload) is a 5xx.
//!
//! `HTTP_FUZZ_CASES=N` sets the fuzzer's cases (default 300); `HTTP_FUZZ_SEED=S` its seed
//! (default: the clock, printed).

use crate::common::Rng;
use crate::server::{long_context_model, model, start_with, Running};

use burn_gemma::{
    engine::EngineConfig,
    server::{Access, ApiKey, ConnectionLimits, Cors, RequestLimits, ServerConfig, UnknownFields},
};
use serde_json::{json, Value};
use std::{
    num::NonZeroUsize,
    sync::{atomic::Ordering, Arc},
    time::{Duration, Instant},
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

fn server_config() -> ServerConfig {
    ServerConfig {
        default_max_tokens: 4,
        connections: ConnectionLimits {
            header_timeout: Duration::from_secs(1),
            body_timeout: Duration::from_secs(1),
            write_timeout: Duration::from_secs(1),
            ..ConnectionLimits::default()
        },
        ..ServerConfig::new("tiny-gemma3")
    }
}

async fn start(server: ServerConfig) -> Running {
    start_with(model(), EngineConfig::default(), server).await
}

/// Status and body of a raw exchange: `request` written as it is, the answer read to its end
/// (the server closes), within `bound`.
async fn raw(base: &str, request: &[u8], bound: Duration) -> (Option<u16>, String) {
    let address = base.trim_start_matches("http://");
    let mut stream = tokio::net::TcpStream::connect(address).await.expect("connect");
    let _ = stream.write_all(request).await;
    let mut answer = Vec::new();
    let _ = tokio::time::timeout(bound, stream.read_to_end(&mut answer)).await;
    let text = String::from_utf8_lossy(&answer).into_owned();
    let status = text.split_whitespace().nth(1).and_then(|s| s.parse().ok());
    (status, text)
}

fn post_bytes(path: &str, content_type: &str, body: &[u8]) -> Vec<u8> {
    let mut request = format!(
        "POST {path} HTTP/1.1\r\nhost: x\r\ncontent-type: {content_type}\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
        body.len()
    )
    .into_bytes();
    request.extend_from_slice(body);
    request
}

/// How long `/health` takes to answer now.
async fn health_time(base: &str) -> (u16, Duration) {
    let started = Instant::now();
    let response = reqwest::get(format!("{base}/health")).await.expect("health");
    (response.status().as_u16(), started.elapsed())
}

/// The server answers a plain request, and its engine holds nothing.
async fn still_serving(running: &Running) {
    let (status, text) =
        running.post("/v1/completions", &json!({ "prompt": "still there?", "max_tokens": 2, "temperature": 0 })).await;
    assert_eq!(status, 200, "{text}");
    let (status, _) = health_time(&running.base).await;
    assert_eq!(status, 200);
    let metrics = running.server.engine().metrics();
    let started = Instant::now();
    while metrics.running.load(Ordering::SeqCst) + metrics.waiting.load(Ordering::SeqCst) > 0 {
        assert!(started.elapsed() < Duration::from_secs(30), "requests still held by the engine");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert_eq!(metrics.worker_panics.load(Ordering::SeqCst), 0);
}

/// The error body's `param`, checked to be OpenAI's shape.
fn param_of(text: &str) -> Option<String> {
    let error: Value = serde_json::from_str(text).unwrap_or_else(|e| panic!("not JSON ({e}): {text}"));
    assert!(error["error"]["message"].is_string(), "{text}");
    assert!(error["error"]["type"].is_string(), "{text}");
    error["error"]["param"].as_str().map(str::to_string)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_requests_that_once_broke_the_server_are_refused_and_it_goes_on() {
    let running = start(server_config()).await;
    // The request that killed the engine worker (capacity overflow), and u64::MAX.
    for max_tokens in ["4611686018427387904", "18446744073709551615"] {
        let body = format!(r#"{{"prompt":"hi","max_tokens":{max_tokens}}}"#);
        let (status, text) = raw(
            &running.base,
            &post_bytes("/v1/completions", "application/json", body.as_bytes()),
            Duration::from_secs(10),
        )
        .await;
        assert_eq!(status, Some(400), "{text}");
        assert!(text.contains("\"param\":\"max_tokens\""), "{text}");
        still_serving(&running).await;
    }
    // A 2 MiB prompt of `<` is refused by its size, before tokenizing.
    let started = Instant::now();
    let (status, text) = running.post("/v1/completions", &json!({ "prompt": "<".repeat(2 << 20) })).await;
    assert_eq!((status, param_of(&text).as_deref()), (400, Some("prompt")), "{text}");
    assert!(started.elapsed() < Duration::from_secs(5), "{:?}", started.elapsed());
    // Two 4 MiB prompts at once: /health answers meanwhile within 100 ms.
    let big = Arc::new(json!({ "prompt": "<".repeat(4 << 20) }));
    let posts: Vec<_> = (0..2)
        .map(|_| {
            let (base, big) = (running.base.clone(), Arc::clone(&big));
            tokio::spawn(async move {
                reqwest::Client::new()
                    .post(format!("{base}/v1/completions"))
                    .json(&*big)
                    .send()
                    .await
                    .map(|r| r.status())
            })
        })
        .collect();
    let mut slowest = Duration::ZERO;
    for _ in 0..20 {
        let (status, took) = health_time(&running.base).await;
        assert_eq!(status, 200);
        slowest = slowest.max(took);
    }
    for post in posts {
        assert_eq!(post.await.expect("task").expect("post").as_u16(), 400);
    }
    println!("slowest /health beside two 4 MiB prompts: {slowest:?}");
    assert!(slowest < Duration::from_millis(100), "{slowest:?}");
    // A web page's text/plain POST (no CORS preflight) does not generate.
    let body = br#"{"prompt":"hi","max_tokens":2}"#;
    let (status, text) =
        raw(&running.base, &post_bytes("/v1/completions", "text/plain", body), Duration::from_secs(10)).await;
    assert_eq!(status, Some(415), "{text}");
    assert!(text.contains("application/json"), "{text}");
    // No CORS header unless configured.
    let response = reqwest::Client::new()
        .post(format!("{}/v1/completions", running.base))
        .header("origin", "https://evil.example")
        .json(&json!({ "prompt": "hi", "max_tokens": 1 }))
        .send()
        .await
        .expect("post");
    assert!(response.headers().get("access-control-allow-origin").is_none());
    still_serving(&running).await;
    running.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn fields_the_server_does_not_implement_are_refused_by_name() {
    let running = start(server_config()).await;
    let user = json!([{ "role": "user", "content": "hi" }]);
    for (field, value) in [
        ("logprobs", json!(true)),
        ("top_logprobs", json!(2)),
        ("tools", json!([{ "type": "function", "function": { "name": "get_weather", "parameters": {} } }])),
        ("tool_choice", json!("required")),
        ("response_format", json!({ "type": "json_schema", "json_schema": { "name": "x", "schema": {} } })),
        ("logit_bias", json!({ "17": -100 })),
        ("frobnicate", json!(1)),
    ] {
        let mut body = json!({ "messages": user, "max_tokens": 2 });
        body[field] = value;
        let (status, text) = running.post("/v1/chat/completions", &body).await;
        assert_eq!((status, param_of(&text).as_deref()), (400, Some(field)), "{text}");
    }
    let (status, text) = running.post("/v1/completions", &json!({ "prompt": "a", "logprobs": 3 })).await;
    assert_eq!((status, param_of(&text).as_deref()), (400, Some("logprobs")), "{text}");
    running.shutdown().await;

    // Lenient: unknown fields are ignored and named in a header; unimplemented ones still refused.
    let running = start(ServerConfig { unknown_fields: UnknownFields::Ignore, ..server_config() }).await;
    let response = reqwest::Client::new()
        .post(format!("{}/v1/chat/completions", running.base))
        .json(&json!({ "messages": user, "max_tokens": 2, "frobnicate": 1, "temperature": 0 }))
        .send()
        .await
        .expect("post");
    assert_eq!(response.status().as_u16(), 200);
    assert_eq!(response.headers().get("x-ignored-fields").and_then(|v| v.to_str().ok()), Some("frobnicate"));
    let (status, _) = running.post("/v1/chat/completions", &json!({ "messages": user, "logprobs": true })).await;
    assert_eq!(status, 400);
    running.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn api_keys_are_required_where_configured() {
    let access = Access { api_keys: vec![ApiKey::new("sk-test-0123456789").expect("key")], ..Access::default() };
    let running = start(ServerConfig { access, ..server_config() }).await;
    let client = reqwest::Client::new();
    let body = json!({ "prompt": "hi", "max_tokens": 2 });
    let url = format!("{}/v1/completions", running.base);
    for (authorization, status) in [
        (None, 401),
        (Some("Bearer sk-test-012345678"), 401),
        (Some("Bearer sk-test-01234567890"), 401),
        (Some("Basic c2stdGVzdA=="), 401),
        (Some("Bearer "), 401),
        (Some("bearer sk-test-0123456789"), 200),
        (Some("Bearer sk-test-0123456789"), 200),
    ] {
        let mut request = client.post(&url).json(&body);
        if let Some(a) = authorization {
            request = request.header("authorization", a);
        }
        let response = request.send().await.expect("post");
        let got = response.status().as_u16();
        let text = response.text().await.expect("body");
        assert_eq!(got, status, "{authorization:?}: {text}");
        if status == 401 {
            let error: Value = serde_json::from_str(&text).expect("JSON");
            assert_eq!(error["error"]["code"], "invalid_api_key", "{text}");
        }
    }
    // Probes and every other route: health answers without a key, the rest ask for one.
    assert_eq!(health_time(&running.base).await.0, 200);
    assert_eq!(reqwest::get(format!("{}/ready", running.base)).await.expect("ready").status().as_u16(), 200);
    for path in ["/v1/models", "/metrics", "/nowhere"] {
        assert_eq!(
            reqwest::get(format!("{}{path}", running.base)).await.expect("get").status().as_u16(),
            401,
            "{path}"
        );
    }
    running.shutdown().await;
}

/// A hostile request and the status it must get.
struct Case {
    what: &'static str,
    path: &'static str,
    body: Vec<u8>,
    status: u16,
    /// The field the 400 names, where one is.
    param: Option<&'static str>,
}

fn json_case(what: &'static str, path: &'static str, body: Value, status: u16, param: Option<&'static str>) -> Case {
    Case { what, path, body: body.to_string().into_bytes(), status, param }
}

/// Values of one field: (JSON, what it is, the status it gets).
type Values = &'static [(&'static str, &'static str, u16)];

/// Every numeric field of a request, each with values out of its range or of the wrong type.
fn numeric_cases() -> Vec<Case> {
    let mut cases = Vec::new();
    let fields: [(&str, Values); 10] = [
        (
            "max_tokens",
            &[
                ("-1", "negative", 400),
                ("1.5", "a float", 400),
                ("1e300", "huge float", 400),
                ("\"7\"", "a string", 400),
                ("99999999999999999999", "past u64", 400),
            ],
        ),
        ("max_completion_tokens", &[("-7", "negative", 400), ("0", "zero", 400), ("4611686018427387904", "2^62", 400)]),
        (
            "n",
            &[
                ("0", "zero", 400),
                ("-1", "negative", 400),
                ("9", "over the cap", 400),
                ("1e19", "huge float", 400),
                ("true", "a bool", 400),
            ],
        ),
        (
            "top_k",
            &[
                ("0", "zero", 400),
                ("-5", "negative", 400),
                ("2.5", "a float", 400),
                ("4611686018427387904", "2^62 (clamped to the vocabulary)", 200),
            ],
        ),
        (
            "seed",
            &[
                ("-1", "negative", 400),
                ("1.5", "a float", 400),
                ("18446744073709551616", "past u64", 400),
                ("18446744073709551615", "u64::MAX", 200),
            ],
        ),
        (
            "temperature",
            &[
                ("-1", "negative", 400),
                ("1e300", "past f32", 400),
                ("2.0001", "over 2", 400),
                ("\"hot\"", "a string", 400),
            ],
        ),
        (
            "top_p",
            &[("0", "zero", 400), ("-0.5", "negative", 400), ("1.5", "over 1", 400), ("1e-300", "a denormal", 400)],
        ),
        ("min_p", &[("-0.1", "negative", 400), ("1.1", "over 1", 400), ("1e300", "past f32", 400)]),
        ("frequency_penalty", &[("0.5", "not 0", 400), ("-1e300", "past f32", 400), ("[]", "an array", 400)]),
        ("presence_penalty", &[("2", "not 0", 400), ("null", "null", 200), ("{}", "an object", 400)]),
    ];
    for (field, values) in fields {
        for &(value, kind, status) in values {
            let body = format!(r#"{{"prompt":"hi","max_tokens":2,"{field}":{value}}}"#);
            let body = match field {
                "max_tokens" => format!(r#"{{"prompt":"hi","max_tokens":{value}}}"#),
                "max_completion_tokens" => {
                    format!(r#"{{"messages":[{{"role":"user","content":"hi"}}],"max_completion_tokens":{value}}}"#)
                }
                _ => body,
            };
            let path = if field == "max_completion_tokens" { "/v1/chat/completions" } else { "/v1/completions" };
            let what: &'static str = Box::leak(format!("{field} = {value} ({kind})").into_boxed_str());
            let param = (status == 400).then_some(field);
            cases.push(Case { what, path, body: body.into_bytes(), status, param });
        }
    }
    cases
}

fn other_cases() -> Vec<Case> {
    let chat = "/v1/chat/completions";
    let cmpl = "/v1/completions";
    let deep = format!("{}1{}", "[".repeat(100_000), "]".repeat(100_000));
    let mut invalid_utf8 = br#"{"prompt":"caf"#.to_vec();
    invalid_utf8.extend_from_slice(&[0xC3, 0x28, 0xFF]);
    invalid_utf8.extend_from_slice(br#"","max_tokens":2}"#);
    let nine_pictures: Vec<Value> =
        (0..9).map(|_| json!({ "type": "image_url", "image_url": { "url": "data:image/png;base64,AAAA" } })).collect();
    vec![
        Case {
            what: "deep JSON (100,000 nested arrays)",
            path: cmpl,
            body: deep.into_bytes(),
            status: 400,
            param: None,
        },
        Case { what: "invalid UTF-8 in a string", path: cmpl, body: invalid_utf8, status: 400, param: None },
        Case {
            what: "a lone surrogate escape",
            path: cmpl,
            body: br#"{"prompt":"\ud800"}"#.to_vec(),
            status: 400,
            param: None,
        },
        Case { what: "an empty body", path: cmpl, body: Vec::new(), status: 400, param: None },
        Case { what: "a JSON array body", path: cmpl, body: b"[1,2,3]".to_vec(), status: 400, param: None },
        Case { what: "a JSON string body", path: chat, body: b"\"hello\"".to_vec(), status: 400, param: None },
        Case { what: "JSON null", path: chat, body: b"null".to_vec(), status: 400, param: None },
        Case {
            what: "trailing garbage",
            path: cmpl,
            body: br#"{"prompt":"a"} xyz"#.to_vec(),
            status: 400,
            param: None,
        },
        json_case(
            "a stop string of 300 bytes",
            cmpl,
            json!({ "prompt": "a", "stop": "x".repeat(300) }),
            400,
            Some("stop"),
        ),
        json_case(
            "five stop strings",
            cmpl,
            json!({ "prompt": "a", "stop": ["a", "b", "c", "d", "e"] }),
            400,
            Some("stop"),
        ),
        json_case("a numeric stop", cmpl, json!({ "prompt": "a", "stop": 5 }), 400, Some("stop")),
        json_case("stream = \"yes\"", cmpl, json!({ "prompt": "a", "stream": "yes" }), 400, Some("stream")),
        json_case("model = 123", cmpl, json!({ "prompt": "a", "model": 123 }), 400, Some("model")),
        json_case("prompt = null", cmpl, json!({ "prompt": null }), 400, Some("prompt")),
        json_case("a list of prompts", cmpl, json!({ "prompt": ["a", "b"] }), 400, Some("prompt")),
        json_case(
            "role tool",
            chat,
            json!({ "messages": [{ "role": "tool", "content": "a" }] }),
            400,
            Some("messages"),
        ),
        json_case(
            "content null",
            chat,
            json!({ "messages": [{ "role": "user", "content": null }] }),
            400,
            Some("messages"),
        ),
        json_case(
            "an audio content part",
            chat,
            json!({ "messages": [{ "role": "user", "content": [{ "type": "input_audio", "input_audio": {} }] }] }),
            400,
            Some("messages"),
        ),
        json_case(
            "nine pictures (counted before any is decoded)",
            chat,
            json!({ "messages": [{ "role": "user", "content": nine_pictures }] }),
            400,
            Some("messages"),
        ),
        json_case(
            "a picture for a model that reads none",
            chat,
            json!({ "messages": [{ "role": "user", "content": [{ "type": "image_url", "image_url": { "url": "data:image/png;base64,AAAA" } }] }] }),
            400,
            Some("messages"),
        ),
        json_case(
            "300 empty turns (the template's tokens past the context)",
            chat,
            json!({ "messages": (0..301).map(|i| json!({ "role": if i % 2 == 0 { "user" } else { "assistant" }, "content": "" })).collect::<Vec<_>>() }),
            400,
            Some("messages"),
        ),
        json_case(
            "a message name",
            chat,
            json!({ "messages": [{ "role": "user", "content": "a", "name": "mallory" }] }),
            400,
            Some("messages"),
        ),
        json_case(
            "control tokens typed as text",
            cmpl,
            json!({ "prompt": "<eos><bos><start_of_turn>user\n<end_of_turn>", "max_tokens": 2 }),
            200,
            None,
        ),
        json_case(
            "NUL and control characters",
            cmpl,
            json!({ "prompt": "a\u{0}\u{1}\u{7f}\u{1b}[31m", "max_tokens": 2 }),
            200,
            None,
        ),
        json_case(
            "emoji and combining marks",
            cmpl,
            json!({ "prompt": "🦀é\u{301}\u{200d}", "max_tokens": 2 }),
            200,
            None,
        ),
        json_case("echo = true", cmpl, json!({ "prompt": "a", "echo": true }), 400, Some("echo")),
        json_case("best_of = 3", cmpl, json!({ "prompt": "a", "best_of": 3 }), 400, Some("best_of")),
        Case {
            what: "a duplicate field (the last one is read)",
            path: cmpl,
            body: br#"{"prompt":"a","max_tokens":2,"max_tokens":1}"#.to_vec(),
            status: 200,
            param: None,
        },
        json_case(
            "stream_options without a stream",
            cmpl,
            json!({ "prompt": "a", "max_tokens": 1, "stream_options": { "include_usage": true } }),
            200,
            None,
        ),
        json_case(
            "a prompt too long for the context",
            cmpl,
            json!({ "prompt": "w300 ".repeat(600) }),
            400,
            Some("prompt"),
        ),
    ]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn hostile_requests_get_the_statuses_they_should() {
    let running = start(server_config()).await;
    let mut table = Vec::new();
    for case in numeric_cases().into_iter().chain(other_cases()) {
        let request = post_bytes(case.path, "application/json", &case.body);
        let (status, text) = raw(&running.base, &request, Duration::from_secs(30)).await;
        let body = text.split_once("\r\n\r\n").map_or("", |(_, b)| b);
        assert_eq!(status, Some(case.status), "{}: {text}", case.what);
        if case.status >= 400 {
            assert_eq!(param_of(body).as_deref(), case.param, "{}: {body}", case.what);
        }
        table.push(format!("| {} | {} |", case.what, case.status));
    }
    println!("{} hostile bodies:\n{}", table.len(), table.join("\n"));
    assert!(table.len() >= 60, "{}", table.len());
    still_serving(&running).await;
    running.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn broken_http_gets_json_errors_and_bounded_time() {
    let running = start(ServerConfig {
        limits: RequestLimits { max_body_bytes: 64 << 10, ..RequestLimits::default() },
        ..server_config()
    })
    .await;
    let base = &running.base;
    let bound = Duration::from_secs(10);
    // Routes, methods and sizes: OpenAI's JSON error for each.
    for (request, status) in [
        (b"GET /nowhere HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n".to_vec(), 404),
        (b"GET /../../etc/passwd HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n".to_vec(), 404),
        (b"GET /v1/completions HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n".to_vec(), 405),
        (b"PATCH /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 0\r\nconnection: close\r\n\r\n".to_vec(), 405),
        (b"DELETE /health HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n".to_vec(), 405),
        (post_bytes("/v1/completions", "application/json", &vec![b' '; 65 << 10]), 413),
        (
            b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: 999999999999\r\nconnection: close\r\n\r\n".to_vec(),
            413,
        ),
        (post_bytes("/v1/completions", "application/x-www-form-urlencoded", b"prompt=hi"), 415),
        (post_bytes("/v1/completions", "multipart/form-data; boundary=x", b"--x--"), 415),
    ] {
        let (got, text) = raw(base, &request, bound).await;
        assert_eq!(got, Some(status), "{}: {text}", String::from_utf8_lossy(&request[..40.min(request.len())]));
        let body = text.split_once("\r\n\r\n").map_or("", |(_, b)| b);
        param_of(body);
    }
    // A chunked body larger than the limit, with no length declared: 413 as it passes it.
    let mut chunked = b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\nconnection: close\r\n\r\n".to_vec();
    for _ in 0..80 {
        chunked.extend_from_slice(b"400\r\n");
        chunked.extend_from_slice(&[b' '; 0x400]);
        chunked.extend_from_slice(b"\r\n");
    }
    chunked.extend_from_slice(b"0\r\n\r\n");
    assert_eq!(raw(base, &chunked, bound).await.0, Some(413));
    // Malformed HTTP: hyper answers 400/431 itself and closes; the server goes on.
    for (request, status) in [
        (b"GARBAGE\r\n\r\n".to_vec(), 400),
        (b"POST /v1/completions HTTP/1.1\r\ncontent-length: -1\r\n\r\n".to_vec(), 400),
        (format!("GET /health HTTP/1.1\r\nx-big: {}\r\n\r\n", "a".repeat(1 << 20)).into_bytes(), 431),
    ] {
        assert_eq!(raw(base, &request, bound).await.0, Some(status));
    }
    // A client that never finishes its headers is closed after the header timeout (1 s here).
    let started = Instant::now();
    let (status, _) = raw(base, b"POST /v1/completions HTTP/1.1\r\nhost: x\r\n", bound).await;
    let took = started.elapsed();
    println!("unfinished headers: closed after {took:?} ({status:?})");
    assert!(took >= Duration::from_millis(900) && took < Duration::from_secs(5), "{took:?}");
    // A client that sends headers but not the body it announced: 408 after the body timeout.
    let started = Instant::now();
    let (status, text) = raw(
        base,
        b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: 100\r\nconnection: close\r\n\r\n{\"prompt\"",
        bound,
    )
    .await;
    assert_eq!(status, Some(408), "{text}");
    assert!(started.elapsed() < Duration::from_secs(5), "{:?}", started.elapsed());
    // An idle kept-alive connection is closed after the header timeout too.
    let address = base.trim_start_matches("http://");
    let mut idle = tokio::net::TcpStream::connect(address).await.expect("connect");
    idle.write_all(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n").await.expect("write");
    let mut buffer = vec![0u8; 4096];
    let started = Instant::now();
    let mut closed = false;
    while started.elapsed() < Duration::from_secs(5) {
        match tokio::time::timeout(Duration::from_secs(5), idle.read(&mut buffer)).await {
            Ok(Ok(0)) | Ok(Err(_)) => {
                closed = true;
                break;
            }
            Ok(Ok(_)) => continue,
            Err(_) => break,
        }
    }
    assert!(closed, "an idle connection stayed open");
    still_serving(&running).await;
    running.shutdown().await;
}

/// How many HTTP connections the server has open, read from `/metrics` (the reading one
/// counted: 1 when no other is open).
async fn open_connections(base: &str) -> u64 {
    let text = reqwest::get(format!("{base}/metrics")).await.expect("metrics").text().await.expect("text");
    text.lines()
        .find_map(|l| l.strip_prefix("burn_gemma_http_connections_open "))
        .and_then(|v| v.parse().ok())
        .expect("the open-connections gauge")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn clients_that_stop_reading_or_leave_free_what_they_held() {
    // Long streams: a context of 8,192 positions, eight choices of up to 8,000 tokens each.
    let config = EngineConfig {
        max_running: NonZeroUsize::new(8).unwrap(),
        max_sequence_len: NonZeroUsize::new(8192).unwrap(),
        ..EngineConfig::default()
    };
    let running = start_with(long_context_model(8192), config, server_config()).await;
    let metrics = running.server.engine().metrics();
    let body = json!({ "prompt": "Once upon a time", "max_tokens": 8000, "n": 8, "stream": true, "temperature": 0 });
    // A client that reads nothing, with a small receive buffer: the server's writes stall, and
    // after the write timeout (1 s here) its connection is closed and its requests cancelled.
    let socket = tokio::net::TcpSocket::new_v4().expect("socket");
    socket.set_recv_buffer_size(4096).expect("buffer");
    let address = running.base.trim_start_matches("http://").parse().expect("address");
    let mut stalled = socket.connect(address).await.expect("connect");
    stalled
        .write_all(&post_bytes("/v1/completions", "application/json", body.to_string().as_bytes()))
        .await
        .expect("write");
    let started = Instant::now();
    while metrics.running.load(Ordering::SeqCst) == 0 {
        assert!(started.elapsed() < Duration::from_secs(30), "the stream never started");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    while open_connections(&running.base).await > 1 || metrics.running.load(Ordering::SeqCst) > 0 {
        assert!(started.elapsed() < Duration::from_secs(30), "a non-reading client kept its connection");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let generated = metrics.generated_tokens.load(Ordering::SeqCst);
    println!("non-reading client: dropped after {:?}, {generated} tokens generated of 64,000", started.elapsed());
    assert!(generated < 64_000, "the streams ran to their end");
    drop(stalled);
    // Twenty clients that send a request and leave at once, and twenty that leave after the
    // first event: every request ends, the engine holds nothing.
    for read_first in [false, true] {
        let mut clients = Vec::new();
        for _ in 0..20 {
            let (base, body) = (running.base.clone(), body.clone());
            clients.push(tokio::spawn(async move {
                let mut response = reqwest::Client::new()
                    .post(format!("{base}/v1/completions"))
                    .json(&body)
                    .send()
                    .await
                    .expect("post");
                if read_first {
                    let _ = response.chunk().await;
                }
            }));
        }
        for client in clients {
            client.await.expect("client");
        }
    }
    still_serving(&running).await;
    assert_eq!(metrics.requests_failed.load(Ordering::SeqCst), 0);
    running.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 8)]
async fn floods_get_429_and_503_and_the_server_stays_up() {
    let connections = ConnectionLimits { max_connections: 16, ..server_config().connections };
    let config = EngineConfig { max_running: NonZeroUsize::new(4).unwrap(), max_waiting: 8, ..EngineConfig::default() };
    let running = Arc::new(start_with(model(), config, ServerConfig { connections, ..server_config() }).await);
    // 200 requests at once on 200 connections: past 16 connections a 503, past the queue a
    // 429, the rest answered; never another 5xx.
    let mut tasks = Vec::new();
    for i in 0..200 {
        let running = Arc::clone(&running);
        tasks.push(tokio::spawn(async move {
            let body = format!(r#"{{"prompt":"flood {i}","max_tokens":3,"temperature":0}}"#);
            raw(
                &running.base,
                &post_bytes("/v1/completions", "application/json", body.as_bytes()),
                Duration::from_secs(60),
            )
            .await
        }));
    }
    let mut counts = std::collections::BTreeMap::new();
    for task in tasks {
        let (status, text) = task.await.expect("task");
        let status = status.unwrap_or(0);
        assert!(matches!(status, 200 | 429 | 503), "{status}: {text}");
        if status != 200 {
            let body = text.split_once("\r\n\r\n").map_or("", |(_, b)| b);
            param_of(body);
        }
        *counts.entry(status).or_insert(0) += 1;
    }
    println!("a flood of 200: {counts:?}");
    assert!(counts.get(&200).is_some_and(|&n| n >= 4), "{counts:?}");
    assert!(counts.get(&503).is_some_and(|&n| n > 0), "{counts:?}");
    still_serving(&running).await;
    match Arc::try_unwrap(running) {
        Ok(running) => running.shutdown().await,
        Err(_) => panic!("a task still holds the server"),
    }
}

/// A seed from the clock, for a run that gives none.
fn clock_seed() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64)
}

/// A mutation of a valid request body: fields dropped, set to random JSON, unknown ones added,
/// or the serialized bytes cut, flipped, doubled.
fn mutate(rng: &mut Rng, valid: &Value) -> Vec<u8> {
    let random_value = |rng: &mut Rng| -> Value {
        match rng.next() % 14 {
            0 => json!(null),
            1 => json!(rng.next().is_multiple_of(2)),
            2 => json!(rng.next() as i64),
            3 => json!(-((rng.next() % 1000) as i64)),
            4 => json!(f64::from_bits(rng.next() & !(0x7ffu64 << 52)) * 1e300),
            5 => json!(rng.next() % 300),
            6 => json!((rng.next() % 1000) as f64 / 100.0),
            7 => json!("x".repeat((rng.next() % 300) as usize)),
            8 => json!([1, "a", null]),
            9 => json!({ "type": "text", "text": "hi" }),
            10 => json!(u64::MAX),
            11 => json!("<start_of_turn>\u{0}\u{ffff}"),
            12 => json!([]),
            _ => json!({}),
        }
    };
    let mut body = valid.clone();
    let fields = [
        "prompt",
        "messages",
        "max_tokens",
        "n",
        "stream",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "seed",
        "stop",
        "logprobs",
        "tools",
        "stream_options",
        "frequency_penalty",
        "x-unknown",
    ];
    for _ in 0..1 + rng.next() % 3 {
        let field = fields[(rng.next() % fields.len() as u64) as usize];
        match rng.next() % 4 {
            0 => {
                body.as_object_mut().map(|o| o.remove(field));
            }
            _ => body[field] = random_value(rng),
        }
        // Keep generation short where the mutation left a valid budget.
        if body["max_tokens"].as_u64().is_some_and(|m| m > 16) && !rng.next().is_multiple_of(4) {
            body["max_tokens"] = json!(8);
        }
    }
    let mut bytes = body.to_string().into_bytes();
    match rng.next() % 6 {
        0 if !bytes.is_empty() => {
            let cut = (rng.next() % bytes.len() as u64) as usize;
            bytes.truncate(cut);
        }
        1 if !bytes.is_empty() => {
            let at = (rng.next() % bytes.len() as u64) as usize;
            bytes[at] ^= 1 << (rng.next() % 8);
        }
        2 if !bytes.is_empty() => {
            let at = (rng.next() % bytes.len() as u64) as usize;
            bytes.insert(at, [b'{', b'"', b'\\', 0xff, b']', b'\0'][(rng.next() % 6) as usize]);
        }
        _ => {}
    }
    bytes
}

#[tokio::test(flavor = "multi_thread", worker_threads = 8)]
async fn fuzzed_request_bodies_never_break_the_server() {
    let cases: usize = std::env::var("HTTP_FUZZ_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(300);
    let seed = std::env::var("HTTP_FUZZ_SEED").ok().and_then(|v| v.parse().ok()).unwrap_or_else(clock_seed);
    println!("HTTP fuzz: {cases} cases, HTTP_FUZZ_SEED={seed}");
    let running = Arc::new(start(server_config()).await);
    let valid = [
        ("/v1/completions", json!({ "prompt": "The quick brown fox", "max_tokens": 4, "temperature": 0 })),
        ("/v1/completions", json!({ "prompt": "a b c", "max_tokens": 3, "stream": true, "n": 2, "seed": 7 })),
        ("/v1/chat/completions", json!({ "messages": [{ "role": "user", "content": "Hi" }], "max_tokens": 4 })),
        (
            "/v1/chat/completions",
            json!({ "messages": [{ "role": "system", "content": "Be brief" }, { "role": "user", "content": [{ "type": "text", "text": "Hi" }] }], "stream": true, "stop": ["\n"] }),
        ),
    ];
    let permits = Arc::new(tokio::sync::Semaphore::new(8));
    let mut tasks = Vec::new();
    for case in 0..cases {
        let mut rng = Rng(seed ^ (case as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15));
        let (path, body) = &valid[(rng.next() % valid.len() as u64) as usize];
        let bytes = mutate(&mut rng, body);
        let (running, permits, path) = (Arc::clone(&running), Arc::clone(&permits), *path);
        tasks.push(tokio::spawn(async move {
            let _permit = permits.acquire().await.expect("permit");
            let request = post_bytes(path, "application/json", &bytes);
            let (status, text) = raw(&running.base, &request, Duration::from_secs(60)).await;
            (case, status, text, bytes)
        }));
    }
    let mut statuses = std::collections::BTreeMap::new();
    for task in tasks {
        let (case, status, text, bytes) = task.await.expect("fuzz task");
        let shown = String::from_utf8_lossy(&bytes[..bytes.len().min(300)]).into_owned();
        let status = status.unwrap_or_else(|| panic!("case {case} (seed {seed}): no answer to {shown}"));
        assert!(status < 500 || status == 503, "case {case} (seed {seed}): {status} for {shown}: {text}");
        let body = text.split_once("\r\n\r\n").map_or("", |(_, b)| b);
        if status == 200 && text.contains("text/event-stream") {
            assert!(body.contains("data: [DONE]"), "case {case}: a stream without its end: {body}");
        } else if status >= 400 {
            param_of(body);
        }
        *statuses.entry(status).or_insert(0usize) += 1;
    }
    println!("HTTP fuzz statuses: {statuses:?}");
    assert!(statuses.get(&200).is_some_and(|&n| n > 0), "{statuses:?}");
    assert!(statuses.get(&400).is_some_and(|&n| n > 0), "{statuses:?}");
    still_serving(&running).await;
    match Arc::try_unwrap(running) {
        Ok(running) => running.shutdown().await,
        Err(_) => panic!("a fuzz task still holds the server"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn cors_answers_only_the_origins_configured() {
    let access = Access { cors: Cors::Origins(vec!["https://app.example.com".into()]), ..Access::default() };
    let running = start(ServerConfig { access, ..server_config() }).await;
    let client = reqwest::Client::new();
    let url = format!("{}/v1/chat/completions", running.base);
    for (origin, allowed) in [("https://app.example.com", true), ("https://evil.example", false)] {
        let preflight = client
            .request(reqwest::Method::OPTIONS, &url)
            .header("origin", origin)
            .header("access-control-request-method", "POST")
            .header("access-control-request-headers", "content-type, authorization")
            .send()
            .await
            .expect("preflight");
        let allow = preflight.headers().get("access-control-allow-origin").and_then(|v| v.to_str().ok());
        assert_eq!(allow, allowed.then_some(origin), "{origin}");
    }
    running.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_shutdown_closes_what_is_left_at_its_deadline() {
    // A context long enough that the stream below cannot end by itself within the deadline:
    // the tiny model writes tens of thousands of tokens in well over a second.
    const POSITIONS: usize = 1 << 16;
    let config = EngineConfig {
        max_sequence_len: NonZeroUsize::new(POSITIONS).unwrap(),
        max_running: NonZeroUsize::new(1).unwrap(),
        ..EngineConfig::default()
    };
    let connections = ConnectionLimits { shutdown_deadline: Duration::from_secs(1), ..server_config().connections };
    let running =
        start_with(long_context_model(POSITIONS), config, ServerConfig { connections, ..server_config() }).await;
    let body = json!({ "prompt": "Once upon a time", "max_tokens": POSITIONS - 64, "stream": true, "temperature": 0 });
    let mut response =
        reqwest::Client::new().post(format!("{}/v1/completions", running.base)).json(&body).send().await.expect("post");
    assert!(response.chunk().await.expect("a first event").is_some());
    // The client keeps reading, so that neither its buffers nor a write timeout end the stream.
    let reader = tokio::spawn(async move {
        let mut tail = Vec::new();
        loop {
            match response.chunk().await {
                Ok(Some(chunk)) => {
                    tail.extend_from_slice(&chunk);
                    let keep = tail.len().saturating_sub(256);
                    tail.drain(..keep);
                }
                Ok(None) => return (String::from_utf8_lossy(&tail).into_owned(), true),
                Err(_) => return (String::from_utf8_lossy(&tail).into_owned(), false),
            }
        }
    });
    let started = Instant::now();
    running.shutdown().await;
    let took = started.elapsed();
    println!("shutdown with a stream in flight: {took:?}");
    let (tail, ended_cleanly) = reader.await.expect("reader");
    assert!(!tail.contains("[DONE]"), "the stream ended by itself before the deadline: {tail}");
    assert!(!ended_cleanly, "the stream was not cut: {tail}");
    assert!(took >= Duration::from_millis(900) && took < Duration::from_secs(10), "{took:?}");
}
