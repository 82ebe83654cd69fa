#!/usr/bin/env bash
# Call 2 (right after call 1): the 4B Q4_K_M step over rows, paged, and paged replayed as a CUDA
# graph; then llama-batched-bench and our engine with graphs (auto) and eager, 1, 8, 32, 64
# streams, prompt 512, 128 new tokens, all on the same file in this call.
set -u
LCPP=/tmp/lcpp; GGUF=/tmp/gguf
export LD_LIBRARY_PATH=$LCPP/build/bin
f=$GGUF/4b-Q4_K_M.gguf
/tmp/serve_bench --model $f --backend cuda --dtype bf16 --weights native --step-only --streams 1,2,8,32,64 --prompt-len 512 > $OUT/step-q4.txt 2>&1
echo "step rc $?"; grep "^step" $OUT/step-q4.txt; date
$LCPP/build/bin/llama-batched-bench -m $f -c 50000 -b 2048 -ub 512 -npp 512 -ntg 128 -npl 1,8,32,64 -fa on -ngl 99 > $OUT/llama-4b-Q4_K_M.txt 2>&1
echo "llama rc $?"; grep "^|" $OUT/llama-4b-Q4_K_M.txt; date
/tmp/serve_bench --model $f --backend cuda --dtype bf16 --weights native --streams 1,8,32,64 --prompt-len 512 --gen 128 --reps 1 > $OUT/ours-4b-Q4_K_M-graph.txt 2>&1
echo "ours (graphs) rc $?"; grep "^streams" $OUT/ours-4b-Q4_K_M-graph.txt; date
/tmp/serve_bench --model $f --backend cuda --dtype bf16 --weights native --streams 1,8,32,64 --prompt-len 512 --gen 128 --reps 1 --cuda-graph off > $OUT/ours-4b-Q4_K_M-eager.txt 2>&1
echo "ours (eager) rc $?"; grep "^streams" $OUT/ours-4b-Q4_K_M-eager.txt; date
