#!/usr/bin/env bash
# Call 4 (right after call 3): on 12B Q4_K_M and 4B Q8_0, the step (rows, paged, paged graph),
# llama-batched-bench and our engine (graphs), 1, 8, 32, 64 streams, prompt 512, 128 new
# tokens; then 4B Q8_0 with an int8 KV cache through our engine (graphs).
set -u
LCPP=/tmp/lcpp; GGUF=/tmp/gguf
export LD_LIBRARY_PATH=$LCPP/build/bin
for m in 12b-Q4_K_M 4b-Q8_0; do
  f=$GGUF/$m.gguf
  # (no step-only run: the machine had under 8 minutes of its 30 left)
  $LCPP/build/bin/llama-batched-bench -m $f -c 50000 -b 2048 -ub 512 -npp 512 -ntg 128 -npl 1,8,32,64 -fa on -ngl 99 > $OUT/llama-$m.txt 2>&1
  echo "$m llama rc $?"; grep "^|" $OUT/llama-$m.txt; date
  /tmp/serve_bench --model $f --backend cuda --dtype bf16 --weights native --streams 1,8,32,64 --prompt-len 512 --gen 128 --reps 1 > $OUT/ours-$m-graph.txt 2>&1
  echo "$m ours (graphs) rc $?"; grep "^streams" $OUT/ours-$m-graph.txt; date
done
f=$GGUF/4b-Q8_0.gguf
/tmp/serve_bench --model $f --backend cuda --dtype bf16 --weights native --kv-cache int8 --streams 1,8,32,64 --prompt-len 512 --gen 128 --reps 1 > $OUT/ours-4b-Q8_0-int8kv-graph.txt 2>&1
echo "4b-Q8_0 int8 KV ours (graphs) rc $?"; grep "^streams" $OUT/ours-4b-Q8_0-int8kv-graph.txt; date
