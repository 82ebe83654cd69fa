#!/bin/bash
# Call 3 (issue 34): llama.cpp built; Gemma 4 E4B and 31B Q4_K_M written by gen_gguf4.py (random
# weights, published shapes), in parallel; then the E4B row beside llama.cpp with this build
# (bench.gz: the fused lm_head + greedy choice): llama-bench tg128 (F16 and q8_0 KV), ours (bf16
# and int8 KV), depths 512 and 8192, medians of 3 (bench-gpu.sh quant).
set -u
cd "$(dirname "$0")"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $OUT/env.txt
mkdir -p /tmp/gpy /tmp/gguf $OUT/bg && tar xzf kit/llama.cpp-src.tgz -C /tmp/gpy --wildcards './gguf-py/*'
( OUT=$OUT/bg bash bench-gpu.sh llama > $OUT/build-llama.txt 2>&1; echo "rc $? at $(date +%T)" >> $OUT/build-llama.txt ) &
( export PYTHONPATH=/tmp/gpy/gguf-py
  for m in e4b 31b; do
    python3 gen_gguf4.py $m kit/gemma3-vocab.json.gz /tmp/gguf/g4-$m-Q4_K_M.gguf q4_k_m > $OUT/gen-$m.txt 2>&1
    echo "rc $? at $(date +%T)" >> $OUT/gen-$m.txt
  done ) &
wait
tail -1 $OUT/build-llama.txt $OUT/gen-*.txt; ls -la /tmp/gguf; date +%T
QSTEMS="g4-e4b-Q4_K_M" REPS=3 QDEPTHS="512 8192" timeout $((560 - SECONDS)) bash bench-gpu.sh quant > /dev/null 2>&1
tail -6 $OUT/quant.md 2>/dev/null; tail -3 $OUT/log.txt; date +%T
