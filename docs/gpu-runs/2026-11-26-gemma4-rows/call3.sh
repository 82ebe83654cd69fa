#!/usr/bin/env bash
# Call 3 (right after call 2, on the same warm machine: llama.cpp built, the files written):
# 31B Q8_0 ours, then llama-bench on E2B, E4B and 31B (same files as ours in calls 2 and 3).
set -u
here=$PWD/.gpu-bench
export BURN_GEMMA_CACHE=/tmp/bgcache
LCPP=/tmp/lcpp; GGUF=/tmp/gguf; mkdir -p $OUT/r
ls -la $GGUF; cat /tmp/gen-done; tail -1 /tmp/llama-build.txt; date
[ -x /tmp/bench ] || { gzip -dc $here/bench.gz > /tmp/bench && chmod +x /tmp/bench; }
/tmp/bench --model $GGUF/g4-31b-Q8_0.gguf --backend cuda --dtype bf16 --weights native --prompt-len 512 --gen 128 --reps 3 > $OUT/r/ours-31b.txt 2>&1
date; echo "ours 31b:"; grep -h "loaded in\|^JSON" $OUT/r/ours-31b.txt | cut -c1-700
while ! grep -q "build rc" /tmp/llama-build.txt; do sleep 5; done; tail -1 /tmp/llama-build.txt
for m in e2b e4b 31b; do
  LD_LIBRARY_PATH=$LCPP/build/bin $LCPP/build/bin/llama-bench -m $GGUF/g4-$m-Q8_0.gguf -p 512 -n 128 -fa 1 -ngl 99 -r 3 -o jsonl > $OUT/r/llama-$m.jsonl 2>> $OUT/r/llama-err.txt
  python3 -c '
import json,sys
for l in open(sys.argv[1]):
    r=json.loads(l); print("llama.cpp", sys.argv[2], r["n_prompt"], r["n_gen"], "%.1f tok/s" % r["avg_ts"])' $OUT/r/llama-$m.jsonl $m
done
date
tar czf $OUT/logs.tgz -C $OUT r
