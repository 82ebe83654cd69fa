#!/usr/bin/env python3
"""Prefill table from `bench-gpu.sh prefill`: llama-bench's pp512/pp4096 (prefill-llama.jsonl)
beside ours (JSON lines in prefill-ours.txt), one row per (file, prompt length)."""
import json
import os
import sys

out = sys.argv[1]
llama = {}
path = os.path.join(out, "prefill-llama.jsonl")
if os.path.exists(path):
    for line in open(path):
        line = line.strip()
        if not line.startswith("{"):
            continue
        r = json.loads(line)
        if r.get("n_gen", 0) == 0:
            llama[(os.path.basename(r["model_filename"]), r["n_prompt"])] = r["avg_ts"]
ours = {}
for line in open(os.path.join(out, "prefill-ours.txt")):
    if line.startswith("JSON "):
        r = json.loads(line[5:])
        ours[(os.path.basename(r["model"]), r["prompt_len"])] = r

print("| file | prompt | llama.cpp tok/s | ours tok/s | ratio | our time to first token ms |")
print("|---|---:|---:|---:|---:|---:|")
for (name, p), r in sorted(ours.items()):
    l = llama.get((name, p))
    ratio = "%.2fx" % (r["pp"] / l) if l else "-"
    lt = "%.0f" % l if l else "-"
    print("| %s | %d | %s | %.0f | %s | %.1f |" % (name, p, lt, r["pp"], ratio, r["ttft_ms"]))
