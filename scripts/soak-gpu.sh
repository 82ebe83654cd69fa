#!/usr/bin/env bash
# The server's soak (scripts/serve_soak.py) on a CUDA machine, on a random-weight Gemma 3 GGUF.
#
# Here:   scripts/soak-gpu.sh bundle   builds examples/serve with `cuda,server`, gathers it (xz),
#                                      llama.cpp's gguf-py, the vocabulary and the scripts into
#                                      .gpu-soak/ (ignored by git).
# There:  bash .gpu-soak/soak-gpu.sh run   writes $SHAPE ($SHAPE_Q, default 1b q4_k_m), serves it
#                                      and runs the soak at $CLIENTS clients, $REQUESTS requests;
#                                      results in $OUT.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
case ${1:-} in
  bundle)
    cd "$here/.."
    kit=${GPU_BENCH_KIT:-../shared/gpu-bench}
    rm -rf .gpu-soak && mkdir -p .gpu-soak
    grep -qxF "/.gpu-soak/" .git/info/exclude 2>/dev/null || echo "/.gpu-soak/" >> .git/info/exclude
    cargo build --release --features cuda,server --example serve
    strip -o .gpu-soak/serve target/release/examples/serve
    xz -1 -T2 .gpu-soak/serve
    tar xzf "$kit/llama.cpp-src.tgz" -C .gpu-soak --wildcards '*/gguf-py/*'
    cp "$kit/gemma3-vocab.json.gz" scripts/gen_gguf4.py scripts/serve_soak.py scripts/soak-gpu.sh .gpu-soak/
    du -sh .gpu-soak
    ;;
  run)
    OUT=${OUT:-${here}/out}
    mkdir -p "$OUT" /tmp/soak
    SHAPE=${SHAPE:-1b}
    SHAPE_Q=${SHAPE_Q:-q4_k_m}
    model=/tmp/soak/g3-$SHAPE-$SHAPE_Q.gguf
    [ -x /tmp/soak/serve ] || xz -dc "$here/serve.xz" > /tmp/soak/serve && chmod +x /tmp/soak/serve
    if [ ! -s "$model" ]; then
      PYTHONPATH="$here/gguf-py" python3 "$here/gen_gguf4.py" "g3-$SHAPE" "$here/gemma3-vocab.json.gz" "$model" "$SHAPE_Q" > "$OUT/gen.log" 2>&1
    fi
    port=8089
    /tmp/soak/serve --model "$model" --port $port --max-running ${MAX_RUNNING:-64} --max-sequence-len 2048 \
      ${SERVE_ARGS:-} > "$OUT/serve.log" 2>&1 &
    pid=$!
    for _ in $(seq 600); do
      curl -sf "http://127.0.0.1:$port/health" > /dev/null && break
      kill -0 $pid 2> /dev/null || { tail -20 "$OUT/serve.log"; exit 1; }
      sleep 0.5
    done
    status=0
    for round in ${ROUNDS:-1 2}; do
      python3 "$here/serve_soak.py" --url "http://127.0.0.1:$port" --clients ${CLIENTS:-64} --requests ${REQUESTS:-320} \
        --max-tokens ${MAX_TOKENS:-64} --pid $pid --label "$SHAPE-$SHAPE_Q round $round" | tee -a "$OUT/soak.txt" || status=1
    done
    curl -s "http://127.0.0.1:$port/metrics" | grep -E '^burn_gemma_(requests|worker|engine|http|generated)' > "$OUT/metrics.txt" || true
    kill -INT $pid; wait $pid || true
    tail -5 "$OUT/serve.log"
    exit $status
    ;;
  *) echo "usage: $0 bundle|run" >&2; exit 2 ;;
esac
