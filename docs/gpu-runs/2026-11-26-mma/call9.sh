#!/usr/bin/env bash
# Call 9 (right after call 8, same machine): Gemma 3 12B Q4_K_M and Q8_0 through
# llama-batched-bench and our engine (1, 8, 32 and 64 streams, prompt 512, 128 new tokens, one
# run after a warm-up), each file through both in this call.
set -u
here=$PWD/.gpu-bench
LCPP=/tmp/lcpp; GGUF=/tmp/gguf
export LD_LIBRARY_PATH=$LCPP/build/bin
gzip -dc $here/serve_bench.gz > /tmp/serve_bench && chmod +x /tmp/serve_bench
for q in Q4_K_M Q8_0; do
  f=$GGUF/12b-$q.gguf
  $LCPP/build/bin/llama-batched-bench -m $f -c 50000 -b 2048 -ub 512 -npp 512 -ntg 128 -npl 1,8,32,64 -fa on -ngl 99 > $OUT/llama-12b-$q.txt 2>&1
  echo "llama 12b $q rc $?"; grep "^|" $OUT/llama-12b-$q.txt; date
  /tmp/serve_bench --model $f --backend cuda --dtype bf16 --weights native --streams 1,8,32,64 --prompt-len 512 --gen 128 --reps 1 > $OUT/ours-12b-$q.txt 2>&1
  echo "ours 12b $q rc $?"; grep "^streams" $OUT/ours-12b-$q.txt; date
done
