#!/usr/bin/env python3
"""The side-by-side table of scripts/bench-gpu.sh, from the results folder it wrote.

Reads llama.jsonl (llama-bench -o jsonl), ours.txt (our bench's `JSON {...}` lines), hf.txt
(hf_bench.py), env.txt (GPU, driver, copy bandwidth) and the GGUF files themselves (through the
gguf-py reader of the llama.cpp tree, for the bytes each token reads).

Bytes per decode token: every weight once (the tied embedding table is the output projection) plus
the KV cache of the average context of the tg run: sliding layers read at most their window. The
floor is the copy bandwidth (bytes read + written) over those bytes: what a decoder that only
streamed its bytes at copy speed would reach.
"""
import json
import os
import re
import statistics
import sys

import gguf  # llama.cpp's gguf-py (PYTHONPATH)


def median(xs):
    return statistics.median(xs) if xs else float("nan")


def model_bytes(path):
    r = gguf.GGUFReader(path)
    arch = r.fields["general.architecture"].contents()
    get = lambda key: r.fields[f"{arch}.{key}"].contents()
    weights = sum(int(t.n_bytes) for t in r.tensors)
    params = sum(int(t.n_elements) for t in r.tensors)
    layers, kv_heads, head_dim = get("block_count"), get("attention.head_count_kv"), get("attention.key_length")
    window = get("attention.sliding_window") if f"{arch}.attention.sliding_window" in r.fields else None
    return weights, params, layers, kv_heads, head_dim, window


def kv_bytes(layers, kv_heads, head_dim, window, depth, gen, elem=2):
    """Average KV bytes read per decode token over a tg run at `depth` (Gemma 3: 5 sliding : 1 global)."""
    total = 0
    for ctx in range(depth + 1, depth + gen + 1):
        for layer in range(layers):
            is_global = window is None or (layer + 1) % 6 == 0
            total += 2 * kv_heads * head_dim * elem * (ctx if is_global else min(ctx, window))
    return total / gen


def main(out):
    env = open(os.path.join(out, "env.txt")).read()
    bw = float(re.search(r"copy_bw_GBps ([\d.]+)", env).group(1)) * 1e9
    gpu = env.splitlines()[0]
    llama = {}
    for line in open(os.path.join(out, "llama.jsonl")):
        r = json.loads(line)
        key = (os.path.basename(r["model_filename"]), r["n_depth"], "pp" if r["n_prompt"] else "tg")
        llama[key] = median(r["samples_ts"])
    ours = {}
    for line in open(os.path.join(out, "ours.txt")):
        if line.startswith("JSON "):
            r = json.loads(line[5:])
            ours[(os.path.basename(r["model"]), r["depth"])] = r
    hf = {}
    if os.path.exists(os.path.join(out, "hf.txt")):
        for m in re.finditer(r"HF (\w+) bf16 \w+: pp512 (\d+) tok/s, tg128 ([\d.]+) tok/s", open(os.path.join(out, "hf.txt")).read()):
            hf[m.group(1)] = (float(m.group(2)), float(m.group(3)))

    print(f"GPU: {gpu}; copy bandwidth {bw / 1e9:.0f} GB/s (read + write)")
    print()
    print("| model | file weights | depth | llama.cpp pp512 | ours pp512 | ratio | llama.cpp tg128 | ours tg128 | ratio | HF tg128 | GB/token llama.cpp / ours | floor tok/s llama.cpp / ours | ours % of its floor |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    order = {"270m": 0, "1b": 1, "4b": 2, "12b": 3}
    rows = []
    for (name, depth), r in ours.items():
        size, fmt = re.match(r"(\w+)-(\w+)\.gguf", name).groups()
        rows.append((order.get(size, 9), fmt, depth, name, size, r))
    for _, fmt, depth, name, size, r in sorted(rows):
        weights, params, layers, kv_heads, head_dim, window = model_bytes(r["model"])
        kv = kv_bytes(layers, kv_heads, head_dim, window, depth, r["gen"])
        theirs_b = weights + kv
        ours_b = r["weight_bytes"] + kv
        lpp, ltg = llama.get((name, depth, "pp"), float("nan")), llama.get((name, depth, "tg"), float("nan"))
        h = hf.get(size) if fmt == "F16" and depth == 0 else None
        print(
            f"| {size} | {fmt} | {depth} | {lpp:,.0f} | {r['pp']:,.0f} | {r['pp'] / lpp:.2f} | "
            f"{ltg:,.1f} | {r['tg']:,.1f} | {r['tg'] / ltg:.2f} | {f'{h[1]:.1f}' if h else '-'} | "
            f"{theirs_b / 1e9:.2f} / {ours_b / 1e9:.2f} | {bw / theirs_b:,.0f} / {bw / ours_b:,.0f} | {100 * r['tg'] / (bw / ours_b):.0f}% |"
        )
    if hf:
        print()
        print("HF transformers (bf16, SDPA, eager generate, its own random weights): " +
              ", ".join(f"{k} pp512 {v[0]:,.0f} / tg128 {v[1]:.1f} tok/s" for k, v in hf.items()))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "bench-out")
