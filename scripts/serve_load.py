#!/usr/bin/env python3
"""Load for an OpenAI-compatible server: `--streams` clients at once, each sending streamed
`/v1/completions` requests one after another until `--requests` are done in all.

The same script drives `cargo run --release --example serve` and `llama-server -np N`, so the
two are measured alike. Each prompt is its own (random words, seeded per request, about
`--prompt-words` tokens), generation is greedy for `--max-tokens` tokens. Prints one JSON line:
requests answered, generated tokens (the servers' `usage`), wall time, total generated tokens
per second, time to first token (median, 90th percentile) and per-stream decode speed
(median). Standard library only.

    python3 scripts/serve_load.py --url http://127.0.0.1:8080 --streams 32 --requests 96
"""
import argparse
import http.client
import json
import random
import statistics
import threading
import time
import urllib.parse

WORDS = (
    "time person year way day thing man world life hand part child eye woman place work week case point "
    "government company number group problem fact river mountain garden window letter market question "
    "answer history music table paper money story light night water power city game school family"
).split()


def prompt(seed, words):
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(words))


def one_request(url, body):
    """Sends one streamed completion; returns (ttft_s, total_s, completion_tokens, prompt_tokens)."""
    parsed = urllib.parse.urlparse(url)
    conn = http.client.HTTPConnection(parsed.hostname, parsed.port, timeout=600)
    start = time.perf_counter()
    conn.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
    response = conn.getresponse()
    if response.status != 200:
        raise RuntimeError(f"HTTP {response.status}: {response.read()[:300]!r}")
    first, usage, chunks = None, None, 0
    for raw in response:
        line = raw.decode("utf-8", "replace").strip()
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            break
        event = json.loads(data)
        if event.get("usage"):
            usage = event["usage"]
        for choice in event.get("choices", []):
            if choice.get("text"):
                chunks += 1
                if first is None:
                    first = time.perf_counter() - start
    total = time.perf_counter() - start
    conn.close()
    tokens = usage["completion_tokens"] if usage else chunks
    prompt_tokens = usage.get("prompt_tokens") if usage else None
    return first if first is not None else total, total, tokens, prompt_tokens


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", default="http://127.0.0.1:8080")
    ap.add_argument("--model", default="gemma")
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--prompt-words", type=int, default=512)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--label", default="")
    ap.add_argument("--per-request", action="store_true", help="also print each request's prompt tokens and TTFT")
    args = ap.parse_args()

    lock = threading.Lock()
    next_index = [0]
    results, errors = [], []

    def client():
        while True:
            with lock:
                i = next_index[0]
                if i >= args.requests:
                    return
                next_index[0] += 1
            body = {
                "model": args.model,
                "prompt": prompt(args.seed * 100003 + i, args.prompt_words),
                "max_tokens": args.max_tokens,
                "temperature": 0,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            try:
                r = one_request(args.url, body)
                with lock:
                    results.append(r)
            except Exception as e:  # reported, the run goes on
                with lock:
                    errors.append(str(e))

    start = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(args.streams)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    tokens = sum(r[2] for r in results)
    ttft = sorted(r[0] for r in results)
    decode = [(r[2] - 1) / (r[1] - r[0]) for r in results if r[2] > 1 and r[1] > r[0]]
    out = {
        "label": args.label,
        "streams": args.streams,
        "requests": len(results),
        "errors": len(errors),
        "generated": tokens,
        "wall_s": round(wall, 3),
        "total_tok_s": round(tokens / wall, 1),
        "ttft_median_s": round(statistics.median(ttft), 4) if ttft else None,
        "ttft_p90_s": round(ttft[int(0.9 * (len(ttft) - 1))], 4) if ttft else None,
        "decode_per_stream_median": round(statistics.median(decode), 1) if decode else None,
    }
    print("JSON " + json.dumps(out), flush=True)
    if args.per_request:
        for r in results:
            print(f"request: prompt_tokens {r[3]} ttft_s {r[0]:.4f} total_s {r[1]:.3f}", flush=True)
    for e in errors[:3]:
        print("error:", e, flush=True)


if __name__ == "__main__":
    main()
