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
#   bash .gpu-bench/bench-gpu.sh quant     decode on quantized files: llama-bench tg128 (F16 and q8_0
#                                          KV) and ours (bf16 and int8 KV, one load per file) on
#                                          $QSTEMS (default $QMODELS x $QFILES) at depths $QDEPTHS
#                                          ("512 8192"), the table in $OUT/quant.md
#   bash .gpu-bench/bench-gpu.sh prepare3  Gemma 3 files $G3MODELS x $G3QUANTS written directly
#                                          (gen_gguf4.py g3-*), no F16 file or llama-quantize
#   bash .gpu-bench/bench-gpu.sh hostprof  where the host's time goes while issuing decode work
#                                          (sampled stacks, synthetic models, $HOSTPROF)
#   bash .gpu-bench/bench-gpu.sh tests     the kernel tests with the cuda feature (f32 and bf16), the
#                                          tiny-model parity tests through CUDA, then CUDA-graph decode
#                                          against eager decode (tests/integration/cuda_graph.rs, generation.rs),
#                                          and drafts on a random 1B keeping greedy output (speculative.rs)
#   bash .gpu-bench/bench-gpu.sh ab        a previous build's bench (.gpu-bench/prev/bench.gz, see
#                                          `bundle`) against this one, alternating, on each $AB
#                                          entry (model:weights[@layers], GGUF files from `prepare`
#                                          by name or synthetic:<shape>; @16 keeps the first 16
#                                          layers), $AB_ROUNDS times (1)
#   bash .gpu-bench/bench-gpu.sh llama     only builds llama.cpp in /tmp/lcpp
#   bash .gpu-bench/bench-gpu.sh prepare4  Gemma 4 files: $G4MODELS ("e2b e4b") written as Q8_0 by
#                                          gen_gguf4.py, requantized to $G4QUANTS by llama-quantize
#   bash .gpu-bench/bench-gpu.sh gemma4    their decode side by side (llama-bench, F16 KV; ours, bf16
#                                          KV), then our synthetic $G4SYNTH (model:weights, none by default)
#   bash .gpu-bench/bench-gpu.sh prefill   prompts of $PLENS tokens ("512,4096") side by side on
#                                          $PSTEMS or $PMODELS x $PFILES (files from `prepare` with
#                                          QUANTS="Q8_0 Q4_K_M"), and the time to first token of a
#                                          2k-token prompt on the real 270M
#   bash .gpu-bench/bench-gpu.sh accuracy  the accuracy table on the real 270M model
#                                          ($MODEL_FILE, see `chunks`) against the HF fixture
# The real model (253 MB) does not fit one call (64 MiB with the working tree, which is 33 MiB):
# `scripts/bench-gpu.sh chunks` here
# splits it into .gpu-model-1 .. .gpu-model-N ($CHUNK, 28M), calls carrying them in turn, each within 30 s
# of the previous one, run `cat .gpu-model-K/part >> $MODEL_FILE` there.
#
# Knobs (environment): MODELS="270m 1b 4b", QUANTS="Q8_0" (F16 is always written), REPS=5,
# DEPTH_RUNS="1b:Q8_0:8192" (extra tg128/pp512 runs at depth; "none" for none), PROFILE="270m 4b"
# (ncu decode profile of the F16 file; "none" for none), HF=1 (0 skips transformers), OUT (results folder, default ./bench-out).
set -uo pipefail

MODELS=${MODELS:-"270m 1b 4b"}
QUANTS=${QUANTS:-"Q8_0"}
REPS=${REPS:-5}
DEPTH_RUNS=${DEPTH_RUNS:-"1b:Q8_0:8192"}
QMODELS=${QMODELS:-"1b 4b"}
QFILES=${QFILES:-"Q8_0 Q4_K_M"}
QDEPTHS=${QDEPTHS:-"512 8192"}
MODEL_FILE=${MODEL_FILE:-/tmp/gemma3-270m-q4_k_m.gguf}
PROFILE=${PROFILE:-"270m 4b"}
HOSTPROF=${HOSTPROF:-"1b:bf16 1b:q4 4b:q8"}
HF=${HF:-1}
PMODELS=${PMODELS:-"1b 4b"}
PFILES=${PFILES:-"F16 Q8_0 Q4_K_M"}
PLENS=${PLENS:-"512,4096"}
G3MODELS=${G3MODELS:-"1b 4b 12b"}
G3QUANTS=${G3QUANTS:-"Q4_K_M Q8_0"}
G4MODELS=${G4MODELS:-"e2b e4b"}
G4QUANTS=${G4QUANTS:-"Q8_0 Q4_K_M"}
G4DEPTH=${G4DEPTH:-0}
G4SYNTH=${G4SYNTH:-""}
LCPP=${LCPP:-/tmp/lcpp}
GGUF=${GGUF:-/tmp/gguf}

bundle() {
  set -e
  cd "$(dirname "$0")/.."
  local kit=${GPU_BENCH_KIT:-../shared/gpu-bench}
  rm -rf .gpu-bench && mkdir -p .gpu-bench/kit
  # Ignored by git (in a worktree, .git is a file: the main checkout's exclude applies).
  if [ -d .git ]; then
    mkdir -p .git/info
    grep -qxF "/.gpu-bench/" .git/info/exclude 2>/dev/null || echo "/.gpu-bench/" >> .git/info/exclude
  fi
  cargo build --release --features cuda,host-profile,tools --example bench --example kernel_bench --example accuracy
  # The bench keeps its symbol table: `hostprof` names the functions the host spends time in.
  strip --strip-debug -o .gpu-bench/bench target/release/examples/bench && gzip -9 .gpu-bench/bench
  for exe in kernel_bench accuracy; do
    strip -o .gpu-bench/$exe target/release/examples/$exe && gzip -9 .gpu-bench/$exe
  done
  local tests
  tests=$(cargo test --release -p burn-gemma-kernels --features cuda --no-run --message-format=json 2>/dev/null |
    python3 -c 'import json,sys; print([m["executable"] for m in map(json.loads, sys.stdin) if m.get("executable") and m["target"]["kind"] == ["lib"]][0])')
  strip -o .gpu-bench/kernel_tests "$tests" && gzip -9 .gpu-bench/kernel_tests
  # The integration tests' binary (tests/integration): its CUDA tests of the tiny models, and
  # CUDA-graph decode against eager decode (tiny models, a random 1B; the generator's chat turns).
  tests=$(cargo test --release -p burn-gemma --test integration --features cuda --no-run --message-format=json 2>/dev/null |
    python3 -c 'import json,sys; print([m["executable"] for m in map(json.loads, sys.stdin) if m.get("executable")][-1])')
  strip -o .gpu-bench/integration "$tests" && gzip -9 .gpu-bench/integration
  cp -r tests/fixtures/tiny-gemma .gpu-bench/
  # A previous build's bench, for `ab` (PREV_BENCH: its gzipped, stripped executable).
  if [ -n "${PREV_BENCH:-}" ]; then mkdir -p .gpu-bench/prev && cp "$PREV_BENCH" .gpu-bench/prev/bench.gz; fi
  cp scripts/bench-gpu.sh scripts/bench_table.py scripts/quant_table.py scripts/prefill_table.py scripts/decode_profile.py scripts/host_profile.py scripts/kernel_bandwidth.py \
    scripts/gen_gguf4.py .gpu-bench/
  cp tests/fixtures/gemma3-270m-reference.json .gpu-bench/
  cp "$kit"/gen_gguf.py "$kit"/gemma3-vocab.json.gz "$kit"/hf_bench.py "$kit"/llama.cpp-src.tgz .gpu-bench/kit/
  du -sh .gpu-bench
  # A device call carries at most 64 MiB with the rest of the working tree.
  if [ "$(du -sm .gpu-bench | cut -f1)" -gt 60 ]; then
    echo "warning: .gpu-bench is over 60 MiB; remove what the call does not run (e.g. accuracy.gz)" >&2
  fi
}

here=$(cd "$(dirname "$0")" && pwd)
# cuBLASLt (a candidate of our prefill GEMM tuning) is loaded at run time: its folder on the path.
cublaslt=$(find /usr/local /usr/lib /opt "$(python3 -c 'import site; print(site.getsitepackages()[0])' 2>/dev/null)" \
  -name 'libcublasLt.so*' 2>/dev/null | head -1)
[ -n "$cublaslt" ] && export LD_LIBRARY_PATH=$(dirname "$cublaslt")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
OUT=${OUT:-$PWD/bench-out}
mkdir -p "$OUT"
log() { echo "[$(date +%T)] $*" | tee -a "$OUT/log.txt" >&2; }

build_llama() {
  if [ ! -x "$LCPP/build/bin/llama-bench" ]; then
    log "building llama.cpp in $LCPP"
    mkdir -p "$LCPP" && tar xzf "$here/kit/llama.cpp-src.tgz" -C "$LCPP" || return 1
    (cd "$LCPP" && cmake -B build -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DLLAMA_BUILD_TESTS=OFF \
        -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_CURL=OFF -DLLAMA_BUILD_SERVER=OFF > "$OUT/llama-build.txt" 2>&1 &&
      cmake --build build -j"$(nproc)" --target llama-bench llama-quantize >> "$OUT/llama-build.txt" 2>&1) ||
      { log "llama.cpp build failed (see llama-build.txt)"; return 1; }
  fi
  export LD_LIBRARY_PATH=$LCPP/build/bin${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH} PYTHONPATH=$LCPP/gguf-py
}

prepare() {
  build_llama || return 1
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

# The executables carried in $here, unpacked into /tmp; one not carried this call keeps the copy an
# earlier call of this warm machine left there (calls that carry model chunks have no room for them).
unpack() {
  bin=/tmp/burn-gemma-bench
  local name
  for name in bench kernel_bench accuracy kernel_tests; do
    [ -s "$here/$name.gz" ] || continue
    gzip -dc "$here/$name.gz" > "/tmp/burn-gemma-${name//_/-}" && chmod +x "/tmp/burn-gemma-${name//_/-}"
  done
}

copy_bandwidth() {
  [ -s "$OUT/env.txt" ] && return
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
}

# Quantized weights (the files' own Q8_0 / Q4_K blocks on the device) with bf16 and int8 KV,
# against llama.cpp with F16 and q8_0 KV, at each depth of $QDEPTHS.
quant() {
  export LD_LIBRARY_PATH=$LCPP/build/bin${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH} PYTHONPATH=$LCPP/gguf-py
  [ -x "$LCPP/build/bin/llama-bench" ] || { log "no llama.cpp build: run 'prepare' first"; return 1; }
  unpack
  copy_bandwidth
  local stems=${QSTEMS:-}
  if [ -z "$stems" ]; then
    for m in $QMODELS; do for q in $QFILES; do stems="$stems $m-$q"; done; done
  fi
  local depths=${QDEPTHS// /,}
  for stem in $stems; do
    f=$GGUF/$stem.gguf
    [ -s "$f" ] || { log "missing $f"; continue; }
    for kv in f16 q8_0; do
      log "llama-bench $stem tg128 depths $depths KV $kv"
      "$LCPP/build/bin/llama-bench" -m "$f" -p 0 -n 128 -d "$depths" -fa 1 -ngl 99 -r "$REPS" -ctk $kv -ctv $kv -o jsonl \
        >> "$OUT/quant-llama.jsonl" 2>> "$OUT/log.txt" || log "llama-bench failed on $f KV $kv"
    done
    # One load for every depth and both KV formats (the weights as the GPU backends keep them
    # by default); a 16-token prompt, as the table reports decode only.
    log "ours $stem tg128 depths $depths KV bf16,int8"
    "$bin" --model "$f" --backend cuda --dtype bf16 --kv-caches bf16,int8 --prompt-len 16 --gen 128 \
      --depth "$depths" --reps "$REPS" >> "$OUT/quant-ours.txt" 2>&1 || log "our bench failed on $f"
  done
  python3 "$here/quant_table.py" "$OUT" > "$OUT/quant.md" && cat "$OUT/quant.md"
}

# Gemma 3 files of the $G3MODELS shapes in each of $G3QUANTS (Q8_0, Q4_K_M), written directly by
# gen_gguf4.py (Q4_K_M with llama-quantize's per-tensor types) as $GGUF/<model>-<quant>.gguf:
# no F16 file first (a 27B one would be 54 GB).
prepare3() {
  mkdir -p "$GGUF"
  export PYTHONPATH=${PYTHONPATH:-$LCPP/gguf-py}
  for m in $G3MODELS; do
    for q in $G3QUANTS; do
      local f=$GGUF/$m-$q.gguf
      [ -s "$f" ] && continue
      log "writing $f"
      python3 "$here/gen_gguf4.py" "g3-$m" "$here/kit/gemma3-vocab.json.gz" "$f" "${q,,}" >> "$OUT/log.txt" 2>&1 || return 1
    done
  done
  log "prepared: $(ls -s "$GGUF" | tr '\n' ' ')"
}

# Gemma 4: random-weight GGUFs of the $G4MODELS shapes in each of $G4QUANTS: Q8_0 and Q4_K_M
# written directly by gen_gguf4.py (Q4_K_M with the types llama-quantize gives each matrix; minutes
# faster on 31B), other types requantized from the Q8_0 file by llama-quantize.
prepare4() {
  build_llama || return 1
  mkdir -p "$GGUF"
  for m in $G4MODELS; do
    for q in $G4QUANTS; do
      local f=$GGUF/g4-$m-$q.gguf
      [ -s "$f" ] && continue
      case $q in
        Q8_0 | Q4_K_M)
          log "writing $f"
          python3 "$here/gen_gguf4.py" "$m" "$here/kit/gemma3-vocab.json.gz" "$f" "${q,,}" >> "$OUT/log.txt" 2>&1 || return 1 ;;
        *)
          if [ ! -s "$GGUF/g4-$m-Q8_0.gguf" ]; then
            log "writing $GGUF/g4-$m-Q8_0.gguf"
            python3 "$here/gen_gguf4.py" "$m" "$here/kit/gemma3-vocab.json.gz" "$GGUF/g4-$m-Q8_0.gguf" >> "$OUT/log.txt" 2>&1 || return 1
          fi
          log "requantizing g4-$m to $q"
          "$LCPP/build/bin/llama-quantize" --allow-requantize "$GGUF/g4-$m-Q8_0.gguf" "$f" "$q" "$(nproc)" \
            > /dev/null 2>&1 || return 1 ;;
      esac
    done
  done
  log "prepared: $(ls -s "$GGUF" | tr '\n' ' ')"
}

# Gemma 4 decode side by side on the prepared files (tg128 after a 512-token prompt at depth
# $G4DEPTH): llama-bench with an F16 KV cache, ours with bf16 KV and the files' own blocks; then
# our synthetic presets of $G4SYNTH (model:weights) where no file was written.
gemma4() {
  export LD_LIBRARY_PATH=$LCPP/build/bin${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH} PYTHONPATH=$LCPP/gguf-py
  unpack
  copy_bandwidth
  for m in $G4MODELS; do
    for q in $G4QUANTS; do
      f=$GGUF/g4-$m-$q.gguf
      [ -s "$f" ] || { log "missing $f"; continue; }
      if [ -x "$LCPP/build/bin/llama-bench" ]; then
        log "llama-bench g4-$m $q"
        "$LCPP/build/bin/llama-bench" -m "$f" -p 512 -n 128 -d "$G4DEPTH" -fa 1 -ngl 99 -r "$REPS" -o jsonl \
          >> "$OUT/g4-llama.jsonl" 2>> "$OUT/log.txt" || log "llama-bench failed on $f"
      fi
      log "ours g4-$m $q"
      "$bin" --model "$f" --backend cuda --dtype bf16 --weights native --prompt-len 512 --gen 128 --depth "$G4DEPTH" \
        --reps "$REPS" >> "$OUT/g4-ours.txt" 2>&1 || log "our bench failed on $f"
    done
  done
  for entry in $G4SYNTH; do
    log "ours synthetic:${entry%%:*} ${entry##*:}"
    "$bin" --model "synthetic:${entry%%:*}" --backend cuda --dtype bf16 --weights "${entry##*:}" --prompt-len 512 \
      --gen 128 --depth "$G4DEPTH" --reps "$REPS" >> "$OUT/g4-ours.txt" 2>&1 || log "our bench failed on $entry"
  done
  grep -h '"n_gen": 128' "$OUT/g4-llama.jsonl" 2>/dev/null | python3 -c '
import json, sys
for l in sys.stdin:
    r = json.loads(l); print("llama.cpp", r["model_filename"].split("/")[-1], "tg128 %.1f tok/s" % r["avg_ts"])'
  grep -h "^JSON" "$OUT/g4-ours.txt" | sed "s/^JSON //" | python3 -c '
import json, sys
for l in sys.stdin:
    r = json.loads(l); print("ours", r["model"].split("/")[-1], r["weights"], "tg%d %.1f tok/s" % (r["gen"], r["tg"]), "graph", r["cuda_graph"])'
}

# Prefill side by side: llama-bench and ours at each length of $PLENS (no generation; ours
# loads each file once for all lengths) on $PSTEMS (file names in $GGUF without `.gguf`; default
# $PMODELS x $PFILES), one tuning cache for the whole run ($BURN_GEMMA_CACHE), then the time to
# first token of a 2k-token prompt on the real 270M ($MODEL_FILE, if there).
prefill() {
  export LD_LIBRARY_PATH=$LCPP/build/bin${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH} PYTHONPATH=$LCPP/gguf-py
  export BURN_GEMMA_CACHE=${BURN_GEMMA_CACHE:-/tmp/prefill-cache}
  unpack
  local stems=${PSTEMS:-}
  if [ -z "$stems" ]; then
    for m in $PMODELS; do for q in $PFILES; do stems="$stems $m-$q"; done; done
  fi
  for stem in $stems; do
    f=$GGUF/$stem.gguf
    [ -s "$f" ] || { log "missing $f"; continue; }
    if [ -x "$LCPP/build/bin/llama-bench" ]; then
      log "llama-bench prefill $stem pp$PLENS"
      "$LCPP/build/bin/llama-bench" -m "$f" -p "$PLENS" -n 0 -fa 1 -ngl 99 -r "$REPS" -o jsonl \
        >> "$OUT/prefill-llama.jsonl" 2>> "$OUT/log.txt" || log "llama-bench failed on $f"
    fi
    log "ours prefill $stem pp$PLENS"
    "$bin" --model "$f" --backend cuda --dtype bf16 --prompt-len "$PLENS" --gen 1 --reps "$REPS" \
      >> "$OUT/prefill-ours.txt" 2>&1 || log "our bench failed on $f"
  done
  if [ -s "$MODEL_FILE" ]; then
    log "ours time to first token, real 270M, 2048-token prompt"
    "$bin" --model "$MODEL_FILE" --backend cuda --dtype bf16 --prompt-len 2048 --gen 1 --reps "$REPS" \
      >> "$OUT/prefill-ours.txt" 2>&1 || log "our bench failed on $MODEL_FILE"
  fi
  python3 "$here/prefill_table.py" "$OUT" > "$OUT/prefill.md" && cat "$OUT/prefill.md"
}

accuracy() {
  unpack
  [ -s "$MODEL_FILE" ] || { log "no $MODEL_FILE"; return 1; }
  sha256sum "$MODEL_FILE" | tee -a "$OUT/log.txt"
  /tmp/burn-gemma-accuracy --backend cuda --model "$MODEL_FILE" --fixture "$here/gemma3-270m-reference.json" --mode "${ACC_MODE:-decode}" \
    > "$OUT/accuracy-${ACC_MODE:-decode}.md" 2>> "$OUT/log.txt" || log "accuracy failed"
  cat "$OUT/accuracy-${ACC_MODE:-decode}.md"
}

kernel_tests() {
  unpack
  /tmp/burn-gemma-kernel-tests --test-threads 1 > "$OUT/kernel-tests.txt" 2>&1; local rc=$?
  grep -E "^test |test result" "$OUT/kernel-tests.txt"
  gzip -dc "$here/integration.gz" > /tmp/burn-gemma-integration && chmod +x /tmp/burn-gemma-integration
  # Each subject's tests by exact name: tiny_models' CUDA ones, cuda_graph's and generation's graph ones.
  local subject filter names
  for subject in tiny_models:cuda cuda_graph:graph generation:graph speculative:random_1b; do
    filter=${subject#*:}; subject=${subject%%:*}
    names=$(/tmp/burn-gemma-integration --list 2>/dev/null | sed -n "s/^\(${subject}::.*${filter}.*\): test$/\1/p")
    # shellcheck disable=SC2086
    BURN_GEMMA_FIXTURES=$here /tmp/burn-gemma-integration --test-threads 1 --nocapture --exact $names > "$OUT/$subject.txt" 2>&1 || rc=1
    grep -E "^test |test result|steps equal|turn" "$OUT/$subject.txt"
  done
  return $rc
}

# Previous build against this one on the same files, alternating per entry of $AB (model:weights,
# e.g. "1b-Q4_K_M:native synthetic:gemma3-1b:bf16"), pp512 + tg128, $REPS reps each.
ab() {
  unpack
  gzip -dc "$here/prev/bench.gz" > /tmp/burn-gemma-bench-prev && chmod +x /tmp/burn-gemma-bench-prev
  local round spec
  for round in $(seq "${AB_ROUNDS:-1}"); do
    for spec in ${AB:-"1b-Q4_K_M:native 4b-Q8_0:native"}; do
      # model:weights, then an optional @layers.
      local layers=() entry=${spec%@*}
      [ "$entry" != "$spec" ] && layers=(--layers "${spec##*@}")
      local w=${entry##*:} m=${entry%:*}
      case "$m" in synthetic:*) ;; *) m=$GGUF/$m.gguf ;; esac
      for build in prev new; do
        local exe=$bin; [ $build = prev ] && exe=/tmp/burn-gemma-bench-prev
        log "ab $build $m $w ${layers[*]} round $round"
        echo "== $build $m $w ${layers[*]} round $round" >> "$OUT/ab.txt"
        "$exe" --model "$m" --backend cuda --dtype bf16 --weights "$w" "${layers[@]}" --prompt-len 512 --gen 128 \
          --reps "$REPS" >> "$OUT/ab.txt" 2>&1 || log "ab $build failed on $m"
      done
    done
  done
  grep -E "^==|prefill|decode tg|host time" "$OUT/ab.txt"
}

chunks() {
  cd "$(dirname "$0")/.."
  local src=${1:-$HOME/.cache/burn-gemma/gemma-3-270m-q4_k_m.gguf}
  rm -rf .gpu-model-* && mkdir -p /tmp/gpu-model-split && rm -f /tmp/gpu-model-split/part*
  split -b "${CHUNK:-28M}" -d "$src" /tmp/gpu-model-split/part
  local i=1
  for p in /tmp/gpu-model-split/part*; do
    mkdir -p .gpu-model-$i && mv "$p" .gpu-model-$i/part
    mkdir -p .git/info
    grep -qxF "/.gpu-model-$i/" .git/info/exclude 2>/dev/null || echo "/.gpu-model-$i/" >> .git/info/exclude
    i=$((i + 1))
  done
  ls -la .gpu-model-*
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
      $bin --model "$model" --backend cuda --dtype bf16 --prompt-len 1 --gen 64 --depth 0 --reps 1 > /dev/null 2>> "$OUT/log.txt"
    python3 "$here/decode_profile.py" "/tmp/ncu-$m.csv" --label "$m ($model)" --ours "$OUT/ours.txt" --model "$model" \
      >> "$OUT/profile.txt" 2>> "$OUT/log.txt" || log "decode_profile failed for $m"
  done
}

# Where the host's time goes while it issues decode work: sampled stacks (bench --host-profile)
# of synthetic models, one file per HOSTPROF entry (model:weights), summarized by host_profile.py.
hostprof() {
  unpack
  for spec in $HOSTPROF; do
    IFS=: read -r m w <<< "$spec"
    log "host profile $m $w"
    "$bin" --model "synthetic:gemma3-$m" --backend cuda --dtype bf16 --weights "$w" --prompt-len 1 --gen 256 --reps 1 \
      --host-profile "$OUT/host-$m-$w.txt" > "$OUT/host-$m-$w.log" 2>&1 || { log "host profile $m $w failed"; continue; }
    python3 "$here/host_profile.py" "$OUT/host-$m-$w.txt" --top 60 > "$OUT/host-$m-$w.md"
    grep -E "decode (tg|host)" "$OUT/host-$m-$w.log" | tee -a "$OUT/host-$m-$w.md"
  done
}

run() {
  export LD_LIBRARY_PATH=$LCPP/build/bin${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH} PYTHONPATH=$LCPP/gguf-py
  [ -x "$LCPP/build/bin/llama-bench" ] || { log "no llama.cpp build: run 'prepare' first"; return 1; }
  unpack
  copy_bandwidth
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
  quant) quant ;;
  accuracy) accuracy ;;
  tests) kernel_tests ;;
  ab) ab ;;
  hostprof) hostprof ;;
  prepare3) prepare3 ;;
  prepare4) prepare4 ;;
  llama) build_llama ;;
  gemma4) gemma4 ;;
  prefill) prefill ;;
  chunks) shift; chunks "$@" ;;
  all) prepare && run ;;
  *) echo "usage: $0 bundle|prepare|run|profile|quant|accuracy|tests|ab|hostprof|chunks|prepare4|gemma4|prefill" >&2; exit 2 ;;
esac
