#!/usr/bin/env python3
"""The decode side-by-side table of `scripts/bench-gpu.sh quant`, from its results folder.

Reads quant-llama.jsonl (llama-bench -o jsonl, tg128 with F16 and q8_0 KV, medians of its
samples), quant-ours.txt (our bench's `JSON {...}` lines, bf16 and int8 KV), env.txt (GPU, copy
bandwidth) and kernels.txt if there (the kernel table, whose GEMV rows are repeated here).

Bytes per decode token: llama.cpp reads its file's tensors (gguf-py, when importable; else the
file size) plus its KV cache; we report our own counts from the bench (`weight_bytes`: weights
as they sit on the device; `kv_read_bytes`: keys and values one step reads at the middle of the
tg run). The floor is the copy bandwidth over our bytes per token.
"""
import json
import os
import re
import statistics
import sys


def median(xs):
    return statistics.median(xs) if xs else float("nan")


def main(out):
    env = open(os.path.join(out, "env.txt")).read()
    m = re.search(r"copy_bw_GBps ([\d.]+)", env)
    bw = float(m.group(1)) * 1e9 if m else float("nan")
    print(f"GPU: {env.splitlines()[0] if env else '?'}; copy bandwidth {bw / 1e9:.0f} GB/s\n")
    llama = {}
    path = os.path.join(out, "quant-llama.jsonl")
    for line in open(path) if os.path.exists(path) else []:
        r = json.loads(line)
        key = (os.path.basename(r["model_filename"]), r["n_depth"], r["type_k"], "pp" if r["n_prompt"] else "tg")
        llama[key] = median(r["samples_ts"])
    ours = {}
    path = os.path.join(out, "quant-ours.txt")
    for line in open(path) if os.path.exists(path) else []:
        if line.startswith("JSON "):
            r = json.loads(line[5:])
            ours[(os.path.basename(r["model"]), r["depth"], r["kv_cache"])] = r
    print("| file | depth | KV (llama.cpp / ours) | llama.cpp tg128 | ours tg128 | tg ratio | our MB/token (weights + KV) | our floor tok/s | our % of floor |")
    print("| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    files = sorted({k[0] for k in ours} | {k[0] for k in llama})
    depths = sorted({k[1] for k in ours} | {k[1] for k in llama})
    for f in files:
        for d in depths:
            for lkv, okv in [("f16", "bf16"), ("q8_0", "int8")]:
                r = ours.get((f, d, okv))
                ltg = llama.get((f, d, lkv, "tg"), float("nan"))
                if r is None and ltg != ltg:
                    continue
                otg = r["tg"] if r else float("nan")
                per_token = (r["weight_bytes"] + r.get("kv_read_bytes", 0)) if r else float("nan")
                floor = bw / per_token if r else float("nan")
                print(
                    f"| {f} | {d} | {lkv} / {okv} | {ltg:,.1f} | {otg:,.1f} | {otg / ltg:.2f} | "
                    f"{per_token / 1e6:,.0f} | {floor:,.0f} | {100 * otg / floor:.0f}% |"
                )
    kernels = os.path.join(out, "kernels.txt")
    if os.path.exists(kernels):
        rows = [l for l in open(kernels) if l.startswith("| project") or l.startswith("| decode attention") or l.startswith("| kernel") or l.startswith("|---")]
        copy = [l for l in open(kernels) if l.startswith("copy")]
        print("\nKernels (bf16 activations; for quantized GEMV the reference column is the dense bf16 GEMV, for int8 attention the dense kernel):\n")
        print("".join(copy) + "\n" + "".join(rows))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "bench-out")
