#!/bin/bash
# GPU call 2 (same warm machine, right after call 1; carries nothing new): decode beside
# llama.cpp on the 1B and 4B files and the 12B Q4_K_M (written in call 1): llama-bench tg128 at
# depths 512 and 8192 with F16 and q8_0 KV, ours with bf16 and int8 KV (one load per file),
# medians of 3.
set -u
cd "$(dirname "$0")/../../.."
QSTEMS="1b-Q4_K_M 1b-Q8_0 4b-Q4_K_M 4b-Q8_0 12b-Q4_K_M" REPS=3 QDEPTHS="512 8192" timeout 590 bash .gpu-bench/bench-gpu.sh quant
tail -4 $OUT/log.txt
