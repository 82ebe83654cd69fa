#!/usr/bin/env python3
"""A soak of an OpenAI-compatible server: `--clients` clients at once send `--requests` greedy
requests in all (streamed and not, alternating; every `--leave-every`-th leaves after sending
or after its first event), while a probe times `/health` every 50 ms.

Before the load each distinct prompt is answered alone, one at a time: under load every answer
must equal its solo answer (greedy), every request that stayed must be answered once (status 200,
a stream ending in [DONE], a response id never seen before), and `/health` must answer 200.
With `--pid` it reads the server's resident memory before and after (and, where nvidia-smi
is there, its device memory). Prints one JSON line and exits 1 if any check failed.

    python3 scripts/serve_soak.py --url http://127.0.0.1:8080 --clients 64 --requests 320 --pid 1234

Standard library only.
"""
import argparse
import http.client
import json
import random
import statistics
import subprocess
import threading
import time
import urllib.parse

WORDS = (
    "time person year way day thing man world life hand part child eye woman place work week case point "
    "government company number group problem fact river mountain garden window letter market question"
).split()


def prompt(i, words):
    rng = random.Random(i)
    return "Write about " + " ".join(rng.choice(WORDS) for _ in range(words)) + "."


def connect(url, timeout=600):
    parsed = urllib.parse.urlparse(url)
    return http.client.HTTPConnection(parsed.hostname, parsed.port, timeout=timeout)


def ask(url, body, headers, leave=None):
    """One request; returns (status, text, response id, finished). `leave`: 'sent' closes right
    after sending, 'first' after the first event (streamed) or the headers."""
    conn = connect(url)
    conn.request("POST", "/v1/completions", body=json.dumps(body), headers=headers)
    if leave == "sent":
        conn.close()
        return None, "", None, False
    response = conn.getresponse()
    if response.status != 200:
        text = response.read().decode("utf-8", "replace")
        conn.close()
        return response.status, text, None, False
    if not body.get("stream"):
        if leave == "first":
            conn.close()
            return 200, "", None, False
        answer = json.loads(response.read())
        conn.close()
        return 200, answer["choices"][0]["text"], answer["id"], True
    text, rid, done = [], None, False
    for raw in response:
        line = raw.decode("utf-8", "replace").strip()
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            done = True
            break
        event = json.loads(data)
        rid = event.get("id", rid)
        for choice in event.get("choices", []):
            text.append(choice.get("text") or "")
        if leave == "first":
            conn.close()
            return 200, "", rid, False
    conn.close()
    return 200, "".join(text), rid, done


def rss_bytes(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return None


def device_bytes(pid):
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=10,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    for line in out.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 2 and parts[0] == str(pid):
            return int(parts[1]) * 1024 * 1024
    return None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", default="http://127.0.0.1:8080")
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--requests", type=int, default=320)
    ap.add_argument("--prompts", type=int, default=24, help="distinct prompts, answered alone first")
    ap.add_argument("--prompt-words", type=int, default=24)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--leave-every", type=int, default=10)
    ap.add_argument("--api-key")
    ap.add_argument("--pid", type=int)
    ap.add_argument("--label", default="")
    args = ap.parse_args()
    headers = {"Content-Type": "application/json"}
    if args.api_key:
        headers["Authorization"] = f"Bearer {args.api_key}"

    def body(p, stream):
        return {"prompt": prompt(p, args.prompt_words), "max_tokens": args.max_tokens, "temperature": 0, "stream": stream}

    solo = {}
    for p in range(args.prompts):
        status, text, _, finished = ask(args.url, body(p, False), headers)
        if status != 200 or not finished:
            raise SystemExit(f"solo answer to prompt {p}: {status} {text[:300]}")
        solo[p] = text

    probe_times, probe_bad, stop = [], [], threading.Event()

    def probe():
        conn = connect(args.url, timeout=10)
        while not stop.is_set():
            started = time.perf_counter()
            try:
                conn.request("GET", "/health")
                response = conn.getresponse()
                response.read()
                if response.status != 200:
                    probe_bad.append(response.status)
            except (OSError, http.client.HTTPException) as e:
                probe_bad.append(str(e))
                conn = connect(args.url, timeout=10)
            probe_times.append(time.perf_counter() - started)
            time.sleep(0.05)

    rss_before = rss_bytes(args.pid) if args.pid else None
    device_before = device_bytes(args.pid) if args.pid else None
    lock = threading.Lock()
    next_index = [0]
    outcomes = []

    def client():
        while True:
            with lock:
                i = next_index[0]
                if i >= args.requests:
                    return
                next_index[0] += 1
            p = i % args.prompts
            stream = i % 2 == 1
            leave = None
            if args.leave_every and i % args.leave_every == args.leave_every - 1:
                leave = "sent" if (i // args.leave_every) % 2 == 0 else "first"
            try:
                outcome = ask(args.url, body(p, stream), headers, leave)
            except (OSError, http.client.HTTPException, ValueError) as e:
                outcome = (None, f"{type(e).__name__}: {e}", None, False)
            with lock:
                outcomes.append((i, p, stream, leave, outcome))

    prober = threading.Thread(target=probe)
    prober.start()
    start = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(args.clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    time.sleep(1.0)  # the left requests' cancellations, then the memory after
    stop.set()
    prober.join()
    rss_after = rss_bytes(args.pid) if args.pid else None
    device_after = device_bytes(args.pid) if args.pid else None

    failures, ids = [], set()
    stayed = answered = 0
    for i, p, stream, leave, (status, text, rid, finished) in outcomes:
        if leave:
            continue
        stayed += 1
        if status != 200 or not finished:
            failures.append(f"request {i}: status {status}, finished {finished}: {text[:200]}")
            continue
        answered += 1
        if rid in ids:
            failures.append(f"request {i}: response id {rid} seen twice")
        ids.add(rid)
        if text != solo[p]:
            failures.append(f"request {i} (prompt {p}, stream {stream}): {text!r} != alone {solo[p]!r}")
    if len(outcomes) != args.requests:
        failures.append(f"{len(outcomes)} outcomes for {args.requests} requests")
    slowest = max(probe_times) if probe_times else None
    if probe_bad:
        failures.append(f"/health failed {len(probe_bad)} times: {probe_bad[:3]}")
    if slowest is not None and slowest >= 0.1:
        failures.append(f"/health took {slowest * 1e3:.1f} ms at worst")
    out = {
        "label": args.label,
        "clients": args.clients,
        "requests": args.requests,
        "left_early": args.requests - stayed,
        "answered": answered,
        "equal_to_solo": answered - sum(1 for f in failures if "!= alone" in f),
        "wall_s": round(wall, 2),
        "health_probes": len(probe_times),
        "health_median_ms": round(statistics.median(probe_times) * 1e3, 2) if probe_times else None,
        "health_max_ms": round(slowest * 1e3, 2) if slowest is not None else None,
        "rss_before_mb": round(rss_before / 1e6, 1) if rss_before else None,
        "rss_after_mb": round(rss_after / 1e6, 1) if rss_after else None,
        "device_before_mb": round(device_before / 1e6, 1) if device_before else None,
        "device_after_mb": round(device_after / 1e6, 1) if device_after else None,
        "failures": len(failures),
    }
    print("JSON " + json.dumps(out), flush=True)
    for f in failures[:10]:
        print("failure:", f, flush=True)
    raise SystemExit(1 if failures else 0)


if __name__ == "__main__":
    main()
