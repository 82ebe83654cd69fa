//! `GET /metrics`: the engine's counters in Prometheus' text format.

use super::Server;
use crate::engine::EngineHealth;
use axum::{extract::State, http::header, response::IntoResponse};
use std::{
    fmt::Write,
    sync::{atomic::Ordering, Arc},
};

pub(super) async fn handler(State(server): State<Arc<Server>>) -> impl IntoResponse {
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], render(&server))
}

/// The text of every metric.
fn render(server: &Server) -> String {
    let m = server.engine.metrics();
    let uptime = server.started.elapsed().as_secs_f64();
    let prompt = m.prompt_tokens.load(Ordering::Relaxed);
    let generated = m.generated_tokens.load(Ordering::Relaxed);
    let first_tokens = m.first_tokens.load(Ordering::Relaxed);
    let first_token_seconds = m.first_token_micros.load(Ordering::Relaxed) as f64 / 1e6;
    let up = matches!(server.engine.health(), EngineHealth::Serving | EngineHealth::Stopping);
    let connections = &server.connections;
    let metrics: [(&str, &str, &str, f64); 30] = [
        ("burn_gemma_requests_running", "gauge", "Requests generating now.", m.running.load(Ordering::Relaxed) as f64),
        (
            "burn_gemma_requests_waiting",
            "gauge",
            "Requests waiting to start.",
            m.waiting.load(Ordering::Relaxed) as f64,
        ),
        (
            "burn_gemma_kv_cache_bytes",
            "gauge",
            "KV cache bytes allocated (the batched cache and the prompt caches).",
            m.kv_cache_bytes.load(Ordering::Relaxed) as f64,
        ),
        (
            "burn_gemma_kv_sequences_in_use",
            "gauge",
            "Sequences of the batched KV cache held by generating requests.",
            m.kv_sequences_in_use.load(Ordering::Relaxed) as f64,
        ),
        (
            "burn_gemma_kv_blocks_in_use",
            "gauge",
            "KV blocks held by generating requests (all the cache's pools).",
            m.kv_blocks_in_use.load(Ordering::Relaxed) as f64,
        ),
        (
            "burn_gemma_kv_blocks_total",
            "gauge",
            "KV blocks in the batched cache (all its pools).",
            m.kv_blocks_total.load(Ordering::Relaxed) as f64,
        ),
        (
            "burn_gemma_kv_blocks_cached",
            "gauge",
            "KV blocks only the prefix cache holds (given up when requests need them).",
            m.kv_blocks_cached.load(Ordering::Relaxed) as f64,
        ),
        (
            "burn_gemma_prefix_hits_total",
            "counter",
            "Requests whose prompt began with a cached prefix.",
            m.prefix_hits.load(Ordering::Relaxed) as f64,
        ),
        (
            "burn_gemma_prefix_cached_tokens_total",
            "counter",
            "Prompt tokens found in the prefix cache (not run through the model).",
            m.prefix_cached_tokens.load(Ordering::Relaxed) as f64,
        ),
        (
            "burn_gemma_draft_tokens_total",
            "counter",
            "Tokens requests drafted for their batched steps to verify (--draft).",
            m.draft_tokens.load(Ordering::Relaxed) as f64,
        ),
        (
            "burn_gemma_draft_tokens_accepted_total",
            "counter",
            "Drafted tokens the model kept (each a token without a step of its own).",
            m.draft_tokens_accepted.load(Ordering::Relaxed) as f64,
        ),
        (
            "burn_gemma_decode_steps_total",
            "counter",
            "Batched decode steps run.",
            m.decode_steps.load(Ordering::Relaxed) as f64,
        ),
        (
            "burn_gemma_decode_sequences_total",
            "counter",
            "Sequences stepped by the batched decode steps (over the steps: the mean batch).",
            m.decode_rows.load(Ordering::Relaxed) as f64,
        ),
        (
            "burn_gemma_decode_graph_steps_total",
            "counter",
            "Batched decode steps replayed as CUDA graphs.",
            m.decode_graph_steps.load(Ordering::Relaxed) as f64,
        ),
        (
            "burn_gemma_decode_seconds_total",
            "counter",
            "Seconds spent in batched decode steps (the step, sampling, the tokens read back).",
            m.decode_micros.load(Ordering::Relaxed) as f64 / 1e6,
        ),
        (
            "burn_gemma_prompt_seconds_total",
            "counter",
            "Seconds spent running prompt chunks (their first tokens included).",
            m.prompt_micros.load(Ordering::Relaxed) as f64 / 1e6,
        ),
        (
            "burn_gemma_requests_finished_total",
            "counter",
            "Requests that ended (done, stopped or cancelled).",
            m.requests_finished.load(Ordering::Relaxed) as f64,
        ),
        (
            "burn_gemma_requests_failed_total",
            "counter",
            "Requests that ended in an error.",
            m.requests_failed.load(Ordering::Relaxed) as f64,
        ),
        (
            "burn_gemma_requests_refused_total",
            "counter",
            "Requests refused because the queue was full.",
            m.requests_refused.load(Ordering::Relaxed) as f64,
        ),
        ("burn_gemma_prompt_tokens_total", "counter", "Prompt tokens run through the model.", prompt as f64),
        ("burn_gemma_generated_tokens_total", "counter", "Tokens generated.", generated as f64),
        (
            "burn_gemma_prompt_tokens_per_second",
            "gauge",
            "Prompt tokens per second since start (rate() of the total gives it over any window).",
            prompt as f64 / uptime.max(1e-9),
        ),
        (
            "burn_gemma_generated_tokens_per_second",
            "gauge",
            "Generated tokens per second since start (rate() of the total gives it over any window).",
            generated as f64 / uptime.max(1e-9),
        ),
        (
            "burn_gemma_time_to_first_token_seconds_sum",
            "counter",
            "Seconds from each request's arrival to its first token (waiting included), summed.",
            first_token_seconds,
        ),
        (
            "burn_gemma_time_to_first_token_seconds_count",
            "counter",
            "Requests that got a first token (the mean time to first token is sum / count).",
            first_tokens as f64,
        ),
        ("burn_gemma_uptime_seconds", "gauge", "Seconds since the server started.", uptime),
        (
            "burn_gemma_engine_up",
            "gauge",
            "1 while the engine's worker serves, 0 once it has stopped or failed.",
            f64::from(u8::from(up)),
        ),
        (
            "burn_gemma_worker_panics_total",
            "counter",
            "Panics the engine's worker caught in its rounds (each ended the requests running then).",
            m.worker_panics.load(Ordering::Relaxed) as f64,
        ),
        (
            "burn_gemma_http_connections_open",
            "gauge",
            "HTTP connections open now.",
            connections.open.load(Ordering::Relaxed) as f64,
        ),
        (
            "burn_gemma_http_connections_refused_total",
            "counter",
            "HTTP connections refused at the cap (answered 503 and closed).",
            connections.refused.load(Ordering::Relaxed) as f64,
        ),
    ];
    let mut text = String::new();
    for (name, kind, help, value) in metrics {
        let _ = writeln!(text, "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {value}");
    }
    text
}
