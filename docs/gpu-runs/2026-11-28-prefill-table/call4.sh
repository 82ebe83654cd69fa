#!/bin/bash
# GPU call 4: the 128K context of Gemma 3 4B (random bf16 weights, the whole model), after the
# tuning key classed the blocked attention's key lengths (call 3's 131,071-token prompt spent
# its 120 s timing a new GEMM class for each chunk): one timed pass after a warm-up pass,
# chunks of 2,048 tokens, peak device memory.
set -u
cd "$(dirname "$0")/../../../.gpu-bench"
gzip -dc bench.gz > /tmp/bench; chmod +x /tmp/bench
LT=$(find /usr/local /usr/lib -name 'libcublasLt.so*' 2>/dev/null | head -1); export LD_LIBRARY_PATH=$(dirname $LT)
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/gpu.txt
BURN_GEMMA_CACHE=/tmp/cache128k timeout 200 /tmp/bench --model synthetic:gemma3-4b --backend cuda --dtype bf16 \
  --prompt-len 131071 --gen 1 --reps 1 > $OUT/long128k.txt 2>&1; echo "rc $?" >> $OUT/long128k.txt
cat $OUT/long128k.txt | cut -c1-400
