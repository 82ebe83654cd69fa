#!/bin/bash
# GPU call 2 (carries the real 270M's first chunk): prompts of 512, 4,096 and 16,384 tokens on
# Gemma 4 31B Q4_K_M (written in call 1), llama-bench (-fa 1, 3 reps) and ours on the one file.
set -u
cd "$(dirname "$0")/../../.."
bash docs/gpu-runs/2026-11-29-q4km/chunk.sh
LT=$(find /usr/local /usr/lib -name 'libcublasLt.so*' 2>/dev/null | head -1); export LD_LIBRARY_PATH=$(dirname $LT)
PSTEMS=g4-31b-Q4_K_M PLENS=512,4096,16384 REPS=3 MODEL_FILE=/tmp/not-yet bash scripts/bench-gpu.sh prefill
grep -E "load:|tuning|first token|peak device" $OUT/prefill-ours.txt | head -20
tail -5 $OUT/log.txt
