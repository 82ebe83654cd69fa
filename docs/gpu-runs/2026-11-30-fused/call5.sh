#!/bin/bash
# Call 5 (issue 34, a fresh machine): the 27B Q8_0 row. llama.cpp built in the background while
# gen_gguf4.py writes the file and our bench (commit 5ac677d, prev/bench.gz) runs tg128 at depths
# 512 and 8192 with bf16 and int8 KV (medians of 3); then llama-bench on the same file (F16 and
# q8_0 KV) if its build is done, within the call's time.
set -u
cd "$(dirname "$0")"
T0=$SECONDS
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $OUT/env.txt
mkdir -p /tmp/gpy /tmp/gguf && tar xzf kit/llama.cpp-src.tgz -C /tmp/gpy --wildcards './gguf-py/*'
( OUT=$OUT/bg bash bench-gpu.sh llama > $OUT/build-llama.txt 2>&1; echo "rc $? at $(date +%T)" >> $OUT/build-llama.txt ) &
PYTHONPATH=/tmp/gpy/gguf-py python3 gen_gguf4.py g3-27b kit/gemma3-vocab.json.gz /tmp/gguf/27b-Q8_0.gguf q8_0 > $OUT/gen.txt 2>&1; echo "gen rc $? at $(date +%T)" >> $OUT/gen.txt
tail -1 $OUT/gen.txt
gzip -dc prev/bench.gz > /tmp/bench; chmod +x /tmp/bench
LT=$(find /usr/local /usr/lib -name 'libcublasLt.so*' 2>/dev/null | head -1); export LD_LIBRARY_PATH=$(dirname $LT)
timeout 300 /tmp/bench --model /tmp/gguf/27b-Q8_0.gguf --backend cuda --dtype bf16 --kv-caches bf16,int8 --prompt-len 16 --gen 128 \
  --depth 512,8192 --reps 3 > $OUT/quant-ours.txt 2>&1; echo "ours rc $? at $(date +%T)" >> $OUT/quant-ours.txt
grep -E "^/tmp|decode tg128|loaded in|rc " $OUT/quant-ours.txt
wait
tail -1 $OUT/build-llama.txt
export LD_LIBRARY_PATH=/tmp/lcpp/build/bin:$LD_LIBRARY_PATH
for kv in f16 q8_0; do
  left=$((530 - (SECONDS - T0))); [ $left -lt 30 ] && { echo "no time left for llama-bench $kv"; break; }
  timeout $left /tmp/lcpp/build/bin/llama-bench -m /tmp/gguf/27b-Q8_0.gguf -p 0 -n 128 -d 512,8192 -fa 1 -ngl 99 -r 3 -ctk $kv -ctv $kv -o jsonl >> $OUT/quant-llama.jsonl 2>> $OUT/llama-log.txt
  echo "llama-bench $kv rc $? at $(date +%T)"
done
python3 -c '
import json,sys
for l in open(sys.argv[1]):
    r=json.loads(l); print(r.get("type_k"), r.get("n_depth"), round(r.get("avg_ts",0),2))
' $OUT/quant-llama.jsonl 2>/dev/null
date +%T
