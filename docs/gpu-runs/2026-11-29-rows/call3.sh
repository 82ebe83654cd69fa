#!/bin/bash
# GPU call 3 (right after call 2): the 12B Q8_0 rows; then, the smaller files removed for disk
# room, Gemma 3 27B Q4_K_M written directly and its rows.
set -u
cd "$(dirname "$0")/../../.."
QSTEMS="12b-Q8_0" REPS=3 QDEPTHS="512 8192" timeout 200 bash .gpu-bench/bench-gpu.sh quant
rm -f /tmp/gguf/1b-*.gguf /tmp/gguf/4b-*.gguf /tmp/gguf/12b-Q8_0.gguf
PYTHONPATH=/tmp/gpy/gguf-py G3MODELS="27b" G3QUANTS="Q4_K_M" /usr/bin/time -v bash .gpu-bench/bench-gpu.sh prepare3 > $OUT/prepare3-27b.txt 2>&1
grep -E "Elapsed" $OUT/prepare3-27b.txt
QSTEMS="27b-Q4_K_M" REPS=3 QDEPTHS="512 8192" timeout 360 bash .gpu-bench/bench-gpu.sh quant
tail -4 $OUT/log.txt; df -h /tmp | tail -1
