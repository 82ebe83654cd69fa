#!/bin/bash
# GPU call 3: one k-quant format at a time. Gemma 3 12B shapes with 16 layers (every matrix, the
# embedding table and LM head too, Q4_K, or every one Q6_K: random blocks, gen_gguf_kquant.py),
# tg128 after a 1-token prompt, the file's blocks kept (native) against converted to Q4 / Q8
# (converted), alternating, median of 3 after a warm-up each.
set -u
cd "$(dirname "$0")/../../../.gpu-bench"
export OUT PYTHONPATH=$PWD/gguf-py
LT=$(find /usr/local /usr/lib -name 'libcublasLt.so*' 2>/dev/null | head -1)
export LD_LIBRARY_PATH=$(dirname $LT) BURN_GEMMA_CACHE=/tmp/bg-cache
gzip -dc bench.gz > /tmp/bench; chmod +x /tmp/bench
mkdir -p /tmp/gguf
for k in q4_k q6_k; do
  python3 gen_gguf_kquant.py 12b $k 16 kit/gemma3-vocab.json.gz /tmp/gguf/12b16-$k.gguf >> $OUT/gen.txt 2>&1
  echo "$k written at $SECONDS s" >> $OUT/gen.txt
  for w in native converted native converted; do
    echo "== ours 12b16 $k $w" >> $OUT/ours.txt
    timeout 100 /tmp/bench --model /tmp/gguf/12b16-$k.gguf --backend cuda --dtype bf16 --weights $w --prompt-len 1 \
      --gen 128 --reps 3 >> $OUT/ours.txt 2>&1
  done
  rm -f /tmp/gguf/12b16-$k.gguf
done
grep -E "^==|decode tg|weights on" $OUT/ours.txt | cut -c1-200; cat $OUT/gen.txt
