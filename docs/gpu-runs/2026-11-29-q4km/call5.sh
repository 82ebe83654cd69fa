#!/bin/bash
# GPU call 5 (carries the eighth chunk, after calls carrying chunks 3-7 ran chunk.sh alone): the
# real Gemma 3 270M Q4_K_M assembled and checked, then its time to first token on a 2,048-token
# prompt (medians of 5 after a warm-up).
set -u
cd "$(dirname "$0")/../../.."
bash docs/gpu-runs/2026-11-29-q4km/chunk.sh assemble | tee $OUT/sha256.txt
M=/tmp/gemma3-270m-q4_k_m.gguf
LT=$(find /usr/local /usr/lib -name 'libcublasLt.so*' 2>/dev/null | head -1); export LD_LIBRARY_PATH=$(dirname $LT)
BURN_GEMMA_CACHE=/tmp/cache-270m timeout 200 /tmp/burn-gemma-bench --model $M --backend cuda --dtype bf16 --prompt-len 2048 \
  --gen 1 --reps 5 > $OUT/270m-ttft.txt 2>&1; echo "rc $?" >> $OUT/270m-ttft.txt
grep -E "prefill|first token|tuning|load:|rc " $OUT/270m-ttft.txt
