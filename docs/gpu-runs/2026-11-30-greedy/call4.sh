#!/bin/bash
# Call 4 (right after call 3, same warm machine): the Gemma 4 31B Q4_K_M row beside llama.cpp,
# as call 3's E4B row (this call measures the copy rate, bench-gpu.sh copy_bandwidth).
set -u
cd "$(dirname "$0")"
ls -la /tmp/gguf
QSTEMS="g4-31b-Q4_K_M" REPS=3 QDEPTHS="512 8192" timeout ${Q_LIMIT:-400} bash bench-gpu.sh quant > /dev/null 2>&1
tail -6 $OUT/quant.md 2>/dev/null; tail -3 $OUT/log.txt; date +%T
