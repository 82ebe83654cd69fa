#!/usr/bin/env bash
# burn-gemma side by side with llama.cpp (and HF transformers) on one CUDA GPU, on the same
# random-weight Gemma 3 GGUF files. See BENCHMARKS.md for the method and the latest results.
#
# Here (Rust toolchain, no GPU needed):
#   scripts/bench-gpu.sh bundle
#       builds examples/bench with the `cuda` feature and gathers it, the scripts and the benchmark
#       kit ($GPU_BENCH_KIT, default ../shared/gpu-bench) into .gpu-bench/ (ignored by git, ~25 MB).
# There (CUDA machine, no network, no Rust), with .gpu-bench copied over:
#   bash .gpu-bench/bench-gpu.sh prepare   builds llama.cpp in /tmp/lcpp, writes /tmp/gguf/*.gguf
#   bash .gpu-bench/bench-gpu.sh run       llama-bench and our bench on every file, the decode
#                                          profile, HF transformers, and the table ($OUT/table.md)
#   bash .gpu-bench/bench-gpu.sh all       both (about 16 minutes on an H100 with 16 cores: more
#                                          than one device call allows, so use prepare, then run)
#   bash .gpu-bench/bench-gpu.sh profile   only the decode profile (GGUFs if prepared, else
#                                          synthetic models of the same shapes; no llama.cpp)
#
# Knobs (environment): MODELS="270m 1b 4b", QUANTS="Q8_0" (F16 is always written), REPS=5,
# DEPTH_RUNS="1b:Q8_0:8192" (extra tg128/pp512 runs at depth; "none" for none), PROFILE="270m 4b"
# (ncu decode profile of the F16 file; "none" for none), HF=1 (0 skips transformers), OUT (results folder, default ./bench-out).
set -uo pipefail

MODELS=${MODELS:-"270m 1b 4b"}
QUANTS=${QUANTS:-"Q8_0"}
REPS=${REPS:-5}
DEPTH_RUNS=${DEPTH_RUNS:-"1b:Q8_0:8192"}
PROFILE=${PROFILE:-"270m 4b"}
HF=${HF:-1}
LCPP=${LCPP:-/tmp/lcpp}
GGUF=${GGUF:-/tmp/gguf}

bundle() {
  set -e
  cd "$(dirname "$0")/.."
  local kit=${GPU_BENCH_KIT:-../shared/gpu-bench}
  rm -rf .gpu-bench && mkdir -p .gpu-bench/kit
  grep -qxF "/.gpu-bench/" .git/info/exclude 2>/dev/null || echo "/.gpu-bench/" >> .git/info/exclude
  cargo build --release --features cuda --example bench --example kernel_bench
  for exe in bench kernel_bench; do
    strip -o .gpu-bench/$exe target/release/examples/$exe && gzip -9 .gpu-bench/$exe
  done
  cp scripts/bench-gpu.sh scripts/bench_table.py scripts/decode_profile.py .gpu-bench/
  cp "$kit"/gen_gguf.py "$kit"/gemma3-vocab.json.gz "$kit"/hf_bench.py "$kit"/llama.cpp-src.tgz .gpu-bench/kit/
  du -sh .gpu-bench
}

here=$(cd "$(dirname "$0")" && pwd)
OUT=${OUT:-$PWD/bench-out}
mkdir -p "$OUT"
log() { echo "[$(date +%T)] $*" | tee -a "$OUT/log.txt" >&2; }

prepare() {
  if [ ! -x "$LCPP/build/bin/llama-bench" ]; then
    log "building llama.cpp in $LCPP"
    mkdir -p "$LCPP" && tar xzf "$here/kit/llama.cpp-src.tgz" -C "$LCPP" || return 1
    (cd "$LCPP" && cmake -B build -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DLLAMA_BUILD_TESTS=OFF \
        -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_CURL=OFF -DLLAMA_BUILD_SERVER=OFF > "$OUT/llama-build.txt" 2>&1 &&
      cmake --build build -j"$(nproc)" --target llama-bench llama-quantize >> "$OUT/llama-build.txt" 2>&1) ||
      { log "llama.cpp build failed (see llama-build.txt)"; return 1; }
  fi
  export LD_LIBRARY_PATH=$LCPP/build/bin PYTHONPATH=$LCPP/gguf-py
  mkdir -p "$GGUF"
  for m in $MODELS; do
    if [ ! -s "$GGUF/$m-F16.gguf" ]; then
      log "writing $GGUF/$m-F16.gguf"
      python3 "$here/kit/gen_gguf.py" "$m" "$here/kit/gemma3-vocab.json.gz" "$GGUF/$m-F16.gguf" >> "$OUT/log.txt" 2>&1 || return 1
    fi
    for q in $QUANTS; do
      [ -s "$GGUF/$m-$q.gguf" ] && continue
      log "quantizing $m to $q"
      "$LCPP/build/bin/llama-quantize" "$GGUF/$m-F16.gguf" "$GGUF/$m-$q.gguf" "$q" "$(nproc)" > /dev/null 2>&1 || return 1
    done
  done
  log "prepared: $(ls "$GGUF" | tr '\n' ' ')"
}

ours() { # file, depth
  "$bin" --model "$1" --backend cuda --dtype bf16 --prompt-len 512 --gen 128 --depth "$2" --reps "$REPS" >> "$OUT/ours.txt" 2>&1 ||
    log "our bench failed on $1 at depth $2"
}

llama() { # file, depth
  "$LCPP/build/bin/llama-bench" -m "$1" -p 512 -n 128 -d "$2" -fa 1 -ngl 99 -r "$REPS" -o jsonl >> "$OUT/llama.jsonl" 2>> "$OUT/log.txt" ||
    log "llama-bench failed on $1 at depth $2"
}

unpack() {
  bin=/tmp/burn-gemma-bench
  gzip -dc "$here/bench.gz" > $bin && chmod +x $bin
  gzip -dc "$here/kernel_bench.gz" > /tmp/burn-gemma-kernel-bench && chmod +x /tmp/burn-gemma-kernel-bench
}

# Where decode time goes, per model in $PROFILE: our tg128 (wall and host time per token, unless
# the run already measured it), an ncu trace of a window of launches in the middle of a run of
# single-token forwards (kernel time per token), and the host cost of single small launches.
profile() {
  /tmp/burn-gemma-kernel-bench --backend cuda --dtype bf16 --launch-only >> "$OUT/profile.txt" 2>> "$OUT/log.txt"
  for m in ${PROFILE/none/}; do
    local model=$GGUF/$m-F16.gguf
    [ -s "$model" ] || model=synthetic:gemma3-$m
    grep -q "^JSON {\"model\":\"$model\",[^}]*\"depth\":0," "$OUT/ours.txt" 2>/dev/null || ours "$model" 0
    log "decode profile $m ($model)"
    ncu --csv --print-units base --metrics gpu__time_duration.sum --clock-control none --cache-control none \
      --launch-skip 8000 --launch-count 2000 --log-file "/tmp/ncu-$m.csv" \
      $bin --model "$model" --backend cuda --dtype bf16 --prompt-len 1 --gen 24 --depth 0 --reps 1 > /dev/null 2>> "$OUT/log.txt"
    python3 "$here/decode_profile.py" "/tmp/ncu-$m.csv" --label "$m ($model)" --ours "$OUT/ours.txt" --model "$model" \
      >> "$OUT/profile.txt" 2>> "$OUT/log.txt" || log "decode_profile failed for $m"
  done
}

run() {
  export LD_LIBRARY_PATH=$LCPP/build/bin PYTHONPATH=$LCPP/gguf-py
  [ -x "$LCPP/build/bin/llama-bench" ] || { log "no llama.cpp build: run 'prepare' first"; return 1; }
  unpack
  {
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.memory --format=csv,noheader
    python3 - <<'EOF'
import torch
n = 1 << 30
x = torch.empty(n, dtype=torch.uint8, device="cuda"); y = torch.empty_like(x)
for _ in range(3): y.copy_(x)
times = []
for _ in range(20):
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record(); y.copy_(x); b.record(); b.synchronize(); times.append(a.elapsed_time(b) / 1e3)
times.sort()
print(f"copy_bw_GBps {2 * n / times[len(times) // 2] / 1e9:.1f}  (device-to-device copy of 1 GiB, bytes read + written, median of 20)")
EOF
  } > "$OUT/env.txt" 2>&1
  log "$(tr '\n' ' ' < "$OUT/env.txt")"
  for m in $MODELS; do
    for q in F16 $QUANTS; do
      f=$GGUF/$m-$q.gguf
      [ -s "$f" ] || { log "missing $f"; continue; }
      log "llama-bench $m $q"; llama "$f" 0
      log "ours $m $q"; ours "$f" 0
    done
  done
  for r in ${DEPTH_RUNS/none/}; do
    IFS=: read -r m q d <<< "$r"
    log "depth $d: $m $q"; llama "$GGUF/$m-$q.gguf" "$d"; ours "$GGUF/$m-$q.gguf" "$d"
  done
  profile
  if [ "$HF" = 1 ]; then
    log "HF transformers"
    PYTHONUNBUFFERED=1 python3 "$here/kit/hf_bench.py" $MODELS > "$OUT/hf.txt" 2>> "$OUT/log.txt" || log "hf_bench failed"
  fi
  python3 "$here/bench_table.py" "$OUT" > "$OUT/table.md" && cat "$OUT/table.md"
}

case "${1:-}" in
  bundle) bundle ;;
  prepare) prepare ;;
  run) run ;;
  profile) unpack && profile && cat "$OUT/profile.txt" ;;
  all) prepare && run ;;
  *) echo "usage: $0 bundle|prepare|run|profile|all" >&2; exit 2 ;;
esac
