#!/bin/bash
# Usage there (with .gpu-bench from `scripts/bench-gpu.sh bundle`, PREV_BENCH set, and this file copied in):
#   OUT=... ROUNDS="1 2 3" MODELS="4b 1b" bash .gpu-bench/ab-alternating.sh
# Each round runs both builds on synthetic Gemma 3 models with Q8 weights (pp512 + tg128, 3 reps).
# Alternating A/B, new build first in odd rounds and previous first in even ones.
here=$(cd "$(dirname "$0")" && pwd)
gzip -dc "$here/bench.gz" > /tmp/new-bench && chmod +x /tmp/new-bench
gzip -dc "$here/prev/bench.gz" > /tmp/prev-bench && chmod +x /tmp/prev-bench
for round in $ROUNDS; do
  order="new prev"; [ $((round % 2)) = 0 ] && order="prev new"
  for m in $MODELS; do
    for build in $order; do
      echo "== round $round $build synthetic:gemma3-$m q8" >> "$OUT/ab2.txt"
      /tmp/$build-bench --model synthetic:gemma3-$m --backend cuda --dtype bf16 --weights q8 --prompt-len 512 --gen 128 --reps 3 >> "$OUT/ab2.txt" 2>&1
    done
  done
done
grep -E "^==|decode tg|host time" "$OUT/ab2.txt"
