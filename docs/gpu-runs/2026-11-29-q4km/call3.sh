#!/bin/bash
# GPU call 3 (carries the second chunk): the 12B shape's 128K-token prompt timed, its GEMM classes
# tuned in call 1 (/tmp/cache128k).
set -u
cd "$(dirname "$0")/../../.."
bash docs/gpu-runs/2026-11-29-q4km/chunk.sh
LT=$(find /usr/local /usr/lib -name 'libcublasLt.so*' 2>/dev/null | head -1); export LD_LIBRARY_PATH=$(dirname $LT)
BURN_GEMMA_CACHE=/tmp/cache128k /usr/bin/time -v timeout 300 /tmp/burn-gemma-bench --model synthetic:gemma3-12b --backend cuda \
  --dtype bf16 --prompt-len 131071 --gen 1 --reps 1 > $OUT/long128k.txt 2>&1; echo "rc $?" >> $OUT/long128k.txt
grep -E "prefill pp|tuning|first token|peak device|Maximum resident|Elapsed|rc " $OUT/long128k.txt
