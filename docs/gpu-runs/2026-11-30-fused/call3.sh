#!/bin/bash
# Call 3 (right after call 2, same warm machine): decode beside llama.cpp on the 1B, 4B and 12B
# Q8_0 files written in call 2 (llama-bench tg128, F16 and q8_0 KV; ours bf16 and int8 KV;
# depths 512 and 8192; medians of 3), ours the build of commit 5ac677d (prev/bench.gz).
set -u
cd "$(dirname "$0")"
cp prev/bench.gz bench.gz
QSTEMS=${QSTEMS:-"1b-Q8_0 4b-Q8_0 12b-Q8_0"} REPS=3 QDEPTHS="512 8192" timeout ${Q_LIMIT:-520} bash bench-gpu.sh quant > /dev/null 2>&1
tail -16 $OUT/quant.md 2>/dev/null; tail -3 $OUT/log.txt; date +%T
