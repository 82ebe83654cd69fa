#!/bin/bash
# GPU call 2: decode tg128 at depth 512 on the Q4_K_M files, llama.cpp (llama-bench, F16 KV,
# flash attention) and ours (bf16 KV, CUDA graph) with the file's k-quants kept (native) and
# converted to Q4/Q8 as before (converted), alternating, median of 3 after a warm-up each.
set -u
cd "$(dirname "$0")/../../../.gpu-bench"
export OUT
LT=$(find /usr/local /usr/lib -name 'libcublasLt.so*' 2>/dev/null | head -1)
export LD_LIBRARY_PATH=$(dirname $LT):/tmp/lcpp/build/bin BURN_GEMMA_CACHE=/tmp/bg-cache
gzip -dc bench.gz > /tmp/bench; chmod +x /tmp/bench
for m in 1b 4b 12b; do
  f=/tmp/gguf/$m-Q4_K_M.gguf
  echo "== llama.cpp $m" >> $OUT/llama.txt
  timeout 120 /tmp/lcpp/build/bin/llama-bench -m $f -p 0 -n 128 -d 512 -fa 1 -ngl 99 -r 3 -o md >> $OUT/llama.txt 2>&1
  for w in native converted native; do
    echo "== ours $m $w" >> $OUT/ours.txt
    timeout 150 /tmp/bench --model $f --backend cuda --dtype bf16 --weights $w --prompt-len 512 --gen 128 \
      --depth 512 --reps 3 >> $OUT/ours.txt 2>&1
  done
  echo "$m done at $SECONDS s" >> $OUT/ours.txt
done
grep -E "^==|t/s|tg128|decode|weights|JSON" $OUT/llama.txt $OUT/ours.txt | cut -c1-300
