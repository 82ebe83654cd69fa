#!/bin/bash
# Real Gemma 3 270M Q4_K_M, 2 threads: llama.cpp's CPU build (the kit's, built as
# scripts/bench-cpu.sh builds it) and ours before (cbde931) and after this stop's changes,
# alternating, two rounds; llama-bench -p 128 -n 64 -r 3, ours --prompt-len 128 --gen 64 --reps 3
# (Candle, the file's blocks). new4: after the host QK-norm + RoPE (same-run-2.txt; same-run.txt was new2, before it).
set -u
M=$HOME/.cache/burn-gemma/gemma-3-270m-q4_k_m.gguf
for round in 1 2; do
  echo "== round $round llama.cpp"
  LD_LIBRARY_PATH=/tmp/lcpp-cpu/build/bin /tmp/lcpp-cpu/build/bin/llama-bench -m $M -p 128 -n 64 -r 3 -t 2 -o md 2>/dev/null | grep -E "pp128|tg64"
  for b in base new4; do
    echo "== round $round ours $b"
    /tmp/bench-$b --model $M --backend candle --threads 2 --prompt-len 128 --gen 64 --reps 3 2>&1 | grep -E "prefill pp|decode tg"
  done
done
