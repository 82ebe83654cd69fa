#!/bin/bash
# GPU call 4 (same machine, the session's last 150 s of device time): ours on Gemma 4 E4B Q4_K_M
# at 4,096 and 16,384 tokens (cut by call 3's limit). Run as one command line from the repo root:
cd .gpu-bench && LT=$(find /usr/local /usr/lib -name 'libcublasLt.so*' 2>/dev/null | head -1); export LD_LIBRARY_PATH=$(dirname $LT) BURN_GEMMA_CACHE=/tmp/prefill-cache; timeout 120 /tmp/burn-gemma-bench --model /tmp/gguf/g4-e4b-Q4_K_M.gguf --backend cuda --dtype bf16 --prompt-len 4096,16384 --gen 1 --reps 3 > $OUT/e4b.txt 2>&1
