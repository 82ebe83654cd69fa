#!/usr/bin/env bash
# Call 5 (right after call 4): the 4B step rows vs paged, then 4B Q4_K_M through
# llama-batched-bench and our engine (paged), 1, 8, 32, 64 streams, prompt 512, 128 new tokens.
set -u
LCPP=/tmp/lcpp; GGUF=/tmp/gguf
export LD_LIBRARY_PATH=$LCPP/build/bin
f=$GGUF/4b-Q4_K_M.gguf
/tmp/serve_bench --model $f --backend cuda --dtype bf16 --weights native --step-only --streams 1,8,32,64 --prompt-len 512 > $OUT/step-q4.txt 2>&1
echo "step rc $?"; grep "^step" $OUT/step-q4.txt; date
$LCPP/build/bin/llama-batched-bench -m $f -c 50000 -b 2048 -ub 512 -npp 512 -ntg 128 -npl 1,8,32,64 -fa on -ngl 99 > $OUT/llama-4b-Q4_K_M.txt 2>&1
echo "llama rc $?"; grep "^|" $OUT/llama-4b-Q4_K_M.txt; date
/tmp/serve_bench --model $f --backend cuda --dtype bf16 --weights native --streams 1,8,32,64 --prompt-len 512 --gen 128 --reps 1 > $OUT/ours-4b-Q4_K_M.txt 2>&1
echo "ours rc $?"; grep "^streams" $OUT/ours-4b-Q4_K_M.txt; date
