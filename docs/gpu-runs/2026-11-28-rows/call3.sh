#!/bin/bash
# GPU call 3 (same machine, right after call 2): the rows call 2's time cut: Gemma 4 E4B Q4_K_M
# side by side, ours on E2B Q4_K_M at 4,096 and 16,384 and on 12B F16 at 16,384.
set -u
cd "$(dirname "$0")/../../../.gpu-bench"
T0=$(date +%s)
mkdir -p $OUT/w; export OUT=$OUT/w
LT=$(find /usr/local /usr/lib -name 'libcublasLt.so*' 2>/dev/null | head -1)
export LD_LIBRARY_PATH=/tmp/lcpp/build/bin:$(dirname $LT) BURN_GEMMA_CACHE=/tmp/prefill-cache
L=/tmp/lcpp/build/bin/llama-bench
B=/tmp/burn-gemma-bench
timeout 40 $L -m /tmp/gguf/g4-e4b-Q4_K_M.gguf -p 512,4096,16384 -n 0 -fa 1 -ngl 99 -r 3 -o jsonl >> $OUT/prefill-llama.jsonl 2>> $OUT/log.txt
timeout 110 $B --model /tmp/gguf/g4-e4b-Q4_K_M.gguf --backend cuda --dtype bf16 --prompt-len 512,4096,16384 --gen 1 --reps 3 >> $OUT/prefill-ours.txt 2>&1
timeout 100 $B --model /tmp/gguf/g4-e2b-Q4_K_M.gguf --backend cuda --dtype bf16 --prompt-len 4096,16384 --gen 1 --reps 3 >> $OUT/prefill-ours.txt 2>&1
left=$(( 390 - ($(date +%s) - T0) ))
timeout $left $B --model /tmp/gguf/12b-F16.gguf --backend cuda --dtype bf16 --prompt-len 16384 --gen 1 --reps 3 >> $OUT/prefill-ours.txt 2>&1
grep -E "^model|prefill pp|first token" $OUT/prefill-ours.txt | cut -c1-200
python3 -c '
import json,sys
for l in open(sys.argv[1]):
  r=json.loads(l); print(r["model_filename"], r["n_prompt"], round(r["avg_ts"],1))' $OUT/prefill-llama.jsonl
cd $OUT/.. && tar czf results.tgz w && rm -rf w
