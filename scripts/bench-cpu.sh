#!/usr/bin/env bash
# burn-gemma on the CPU backends side by side with llama.cpp's CPU build, on the same GGUF files.
#
#   scripts/bench-cpu.sh [GGUF ...]
#
# Default files: the default model (real Gemma 3 270M, Q4_K_M; fetched by the library if missing)
# and, when present, /tmp/gguf/270m-F16.gguf (random weights from the kit's gen_gguf.py). Builds
# llama.cpp from the kit ($GPU_BENCH_KIT, default ../shared/gpu-bench) in /tmp/lcpp-cpu without
# -march=native (its native build dies with "Illegal instruction" on CPUs that report AMX), about
# 10 minutes on 2 cores. Prompt 128, 64 generated tokens, 3 reps, the machine's physical cores
# for both (THREADS=N to change; PROMPTS="128,512" for several prompt lengths).
# RUNS: our backend:weights pairs (default: Candle with the file's own blocks, Candle with dense
# f32 weights, NdArray dense).
# Results: bench-cpu-out/ (ours.txt, llama.jsonl, table.md).
set -euo pipefail
cd "$(dirname "$0")/.."
kit=${GPU_BENCH_KIT:-../shared/gpu-bench}
lcpp=${LCPP_CPU:-/tmp/lcpp-cpu}
out=${OUT:-bench-cpu-out}
threads=${THREADS:-$(lscpu -p=Core,Socket | grep -v '^#' | sort -u | wc -l)}
runs=${RUNS:-candle:native candle:f32 ndarray:f32}
prompts=${PROMPTS:-128}
mkdir -p "$out"
if [ ! -x "$lcpp/build/bin/llama-bench" ]; then
  command -v cmake > /dev/null || python3 -m pip install -q cmake
  mkdir -p "$lcpp" && tar xzf "$kit/llama.cpp-src.tgz" -C "$lcpp"
  (cd "$lcpp" && cmake -B build -DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON \
      -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_CURL=OFF -DLLAMA_BUILD_SERVER=OFF > /dev/null &&
    cmake --build build -j"$threads" --target llama-bench > /dev/null)
fi
# BENCH_BIN: an already built bench executable (any feature set that includes the CPU backends).
bench=${BENCH_BIN:-target/release/examples/bench}
[ -n "${BENCH_BIN:-}" ] || cargo build --release --features tools --example bench
files=("$@")
if [ ${#files[@]} -eq 0 ]; then
  # The default model's cached path (fetched on first use).
  "$bench" --model default --backend ndarray --prompt-len 1 --gen 1 --reps 1 > "$out/default.txt" 2>&1
  files+=("$(sed -n 's/^JSON {"model":"\([^"]*\)".*/\1/p' "$out/default.txt")")
  [ -s /tmp/gguf/270m-F16.gguf ] && files+=(/tmp/gguf/270m-F16.gguf)
fi
: > "$out/ours.txt"; : > "$out/llama.jsonl"
for f in "${files[@]}"; do
  LD_LIBRARY_PATH=$lcpp/build/bin "$lcpp/build/bin/llama-bench" -m "$f" -p "$prompts" -n 64 -r 3 -t "$threads" -o jsonl >> "$out/llama.jsonl" 2> /dev/null
  for run in $runs; do
    "$bench" --model "$f" --backend "${run%%:*}" --weights "${run#*:}" --threads "$threads" --prompt-len "$prompts" --gen 64 \
      --reps 3 >> "$out/ours.txt" 2>&1
  done
done
python3 - "$out" <<'EOF' | tee "$out/table.md"
import json, os, statistics, sys
out = sys.argv[1]
llama = {}
for line in open(os.path.join(out, "llama.jsonl")):
    r = json.loads(line)
    key = r["n_prompt"] if r["n_prompt"] else "tg"
    llama[(r["model_filename"], key)] = statistics.median(r["samples_ts"])
print(f"| model file | backend (weights) | prompt | llama.cpp pp | ours pp | ratio | llama.cpp tg64 | ours tg64 | ratio | resident after load |")
print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
for line in open(os.path.join(out, "ours.txt")):
    if line.startswith("JSON "):
        r = json.loads(line[5:])
        n = r.get("prompt_len", 128)
        lpp, ltg = llama.get((r["model"], n), float("nan")), llama.get((r["model"], "tg"), float("nan"))
        rss = r.get("rss_loaded_bytes", 0) / 1e6
        print(f"| {os.path.basename(r['model'])} | {r['backend']} ({r['weights']}, {r['dtype']}) | {n} | {lpp:.1f} | {r['pp']:.1f} | {r['pp'] / lpp:.2f} | {ltg:.1f} | {r['tg']:.1f} | {r['tg'] / ltg:.2f} | {rss:.0f} MB |")
EOF
