#!/usr/bin/env python3
"""The decode rows of calls 2-4 as one table (quant_table.py's columns), with each row's KV bytes
per token recomputed per layer type (the bench of these calls counted every Gemma 4 layer with
the sliding layers' heads and head size; Gemma 3 rows are unchanged, checked below)."""
import json, statistics, glob, os

# layers, sliding pattern (every n-th layer full), window, (kv heads, head dim) sliding / full.
SHAPES = {
    "1b": (26, 6, 512, (1, 256), (1, 256)), "4b": (34, 6, 1024, (4, 256), (4, 256)),
    "12b": (48, 6, 1024, (8, 256), (8, 256)), "27b": (62, 6, 1024, (16, 128), (16, 128)),
    "g4-e4b": (42, 6, 512, (2, 256), (2, 512)), "g4-31b": (60, 6, 1024, (16, 256), (4, 512)),
}
BW = 4186e9  # the calls' measured copy rate (env.txt / quant.md: 4186 GB/s)

def kv_bytes(stem, kv, position):
    L, pattern, window, sliding, full = SHAPES[stem]
    total = 0
    for i in range(L):
        is_full = (i + 1) % pattern == 0
        heads, dim = full if is_full else sliding
        per = dim * 2 if kv == "bf16" else dim + 4
        total += 2 * heads * per * (position if is_full else min(window, position))
    return total

llama, ours = {}, {}
for call in ("call2", "call3", "call4"):
    for line in open(f"{call}/quant-llama.jsonl"):
        r = json.loads(line)
        llama[(os.path.basename(r["model_filename"]), r["n_depth"], r["type_k"])] = statistics.median(r["samples_ts"])
    for line in open(f"{call}/quant-ours.txt"):
        if line.startswith("JSON "):
            r = json.loads(line[5:])
            ours[(os.path.basename(r["model"]), r["depth"], r["kv_cache"])] = r
print("| file | depth | KV (llama.cpp / ours) | llama.cpp tg128 | ours tg128 | ratio | our GB/token (weights + KV) | our floor tok/s | our % of floor |")
print("| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
for (f, d, okv), r in sorted(ours.items(), key=lambda kv: (list(SHAPES).index(kv[0][0].split("-Q")[0]), kv[0][0], kv[0][1], kv[0][2])):
    stem = f.split("-Q")[0]
    kv = kv_bytes(stem, okv, d + r["gen"] // 2)
    if not stem.startswith("g4"):
        assert kv == r["kv_read_bytes"], (f, d, okv, kv, r["kv_read_bytes"])
    lkv = "f16" if okv == "bf16" else "q8_0"
    ltg = llama[(f, d, lkv)]
    per_token = r["weight_bytes"] + kv
    floor = BW / per_token
    print(f"| {f.removesuffix('.gguf')} | {d} | {lkv} / {okv} | {ltg:,.1f} | {r['tg']:,.1f} | {r['tg'] / ltg:.2f} | "
          f"{per_token / 1e9:.2f} | {floor:,.0f} | {100 * r['tg'] / floor:.0f}% |")
