#!/bin/bash
# GPU call 2: the prefill table, llama.cpp (llama-bench -fa 1) and ours (the defaults: cuBLASLt
# among the tuner's candidates, flash attention for prompts) on the same files of call 1, at
# 512, 4,096 and 16,384 prompt tokens, 3 reps each after a warm-up.
set -u
cd "$(dirname "$0")/../../../.gpu-bench"
export OUT
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/gpu.txt
ls -s /tmp/gguf | tee -a $OUT/gpu.txt
REPS=3 PLENS=512,4096,16384 PSTEMS="1b-F16 1b-Q8_0 1b-Q4_K_M 4b-F16 4b-Q8_0 4b-Q4_K_M 12b-Q4_K_M g4-e2b-Q8_0 g4-e4b-Q8_0" \
  timeout 580 bash bench-gpu.sh prefill
grep -E "loaded in|tuning" $OUT/prefill-ours.txt | cut -c1-160
