#!/bin/bash
# GPU call 4 (right after call 3): Gemma 4 31B and E4B Q4_K_M written directly (gen_gguf4.py) and
# their rows, as calls 2 and 3.
set -u
cd "$(dirname "$0")/../../.."
rm -f /tmp/gguf/12b-*.gguf
export PYTHONPATH=/tmp/gpy/gguf-py
for m in 31b e4b; do
  python3 .gpu-bench/gen_gguf4.py $m .gpu-bench/kit/gemma3-vocab.json.gz /tmp/gguf/g4-$m-Q4_K_M.gguf q4_k_m > $OUT/gen-$m.txt 2>&1
done
QSTEMS="g4-e4b-Q4_K_M g4-31b-Q4_K_M" REPS=3 QDEPTHS="512 8192" timeout 560 bash .gpu-bench/bench-gpu.sh quant
tail -4 $OUT/log.txt
