#!/bin/bash
# Call 2 (issue 34): the fused lm_head + greedy choice (this build, bench.gz) against the build
# before (prev/bench.gz, commit 651ed46), bench alternating, random weights, bf16, tg128 after a
# 512-token prompt, medians of 3 per run (bench-gpu.sh ab).
set -u
cd "$(dirname "$0")"
LT=$(find /usr/local /usr/lib -name 'libcublasLt.so*' 2>/dev/null | head -1); export LD_LIBRARY_PATH=$(dirname $LT)
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $OUT/env.txt
export BURN_GEMMA_CACHE=/tmp/cache-ab
AB="${AB:-synthetic:gemma3-1b:q4 synthetic:gemma4-e4b:q4 synthetic:gemma3-4b:q8 synthetic:gemma3-12b:q4@16}" AB_ROUNDS=${AB_ROUNDS:-1} REPS=3 timeout ${AB_LIMIT:-540} bash bench-gpu.sh ab > /dev/null 2>&1
grep -E "^==|decode tg|failed" $OUT/ab.txt; date +%T
