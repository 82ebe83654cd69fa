#!/bin/bash
# Call 2 (issue 34): llama.cpp built and the Gemma 3 files written for the rows of calls 3-4
# (gen_gguf4.py g3-*: 1B, 4B, 12B Q8_0; 27B Q4_K_M), in parallel.
set -u
cd "$(dirname "$0")"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $OUT/env.txt
mkdir -p /tmp/gpy $OUT/bg && tar xzf kit/llama.cpp-src.tgz -C /tmp/gpy --wildcards './gguf-py/*'
( OUT=$OUT/bg bash bench-gpu.sh llama > $OUT/build-llama.txt 2>&1; echo "rc $? at $(date +%T)" >> $OUT/build-llama.txt ) &
( export OUT=$OUT/bg PYTHONPATH=/tmp/gpy/gguf-py
  G3MODELS="1b 4b 12b" G3QUANTS="Q8_0" bash bench-gpu.sh prepare3 > $OUT/prepare3.txt 2>&1
  G3MODELS="27b" G3QUANTS="Q4_K_M" bash bench-gpu.sh prepare3 >> $OUT/prepare3.txt 2>&1; echo "rc $? at $(date +%T)" >> $OUT/prepare3.txt ) &
wait
tail -2 $OUT/build-llama.txt; tail -3 $OUT/prepare3.txt; ls -la /tmp/gguf; df -h /tmp | tail -1; date +%T
