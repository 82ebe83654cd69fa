#!/usr/bin/env bash
# Call 4: the same two builds as call 3 (prev/bench.gz: before the split GEMV and the add-norm
# change) on whole Gemma 3 1B and 4B shapes (random weights), tg128 after a 1-token prompt,
# alternating.
set -u
B=/tmp/b; mkdir -p $B
gunzip -c .gpu-bench/bench.gz > $B/new; gunzip -c .gpu-bench/prev/bench.gz > $B/old; chmod +x $B/*
for run in old:1b:q4 new:1b:q4 old:1b:q4 new:1b:q4 old:1b:q8 new:1b:q8 old:4b:q4 new:4b:q4; do
  IFS=: read -r v m w <<< "$run"
  echo "== $v $m $w" >> $OUT/ab.txt
  timeout 90 $B/$v --model synthetic:gemma3-$m --backend cuda --dtype bf16 --weights $w \
    --prompt-len 1 --gen 128 --reps 3 2>&1 | grep -E "JSON|decode time|error|Error" >> $OUT/ab.txt
done
