#!/bin/bash
# GPU call 4: the measured default layouts (8x64 for heads of 256, 8x32 prefetching for 512)
# and the Auto rule (blocked for global layers from 32G multiply-adds per block): the flash
# tests (default layout in f16 and bf16, the other layouts in bf16), then whole prompts on
# Gemma 3 4B (random bf16 weights) at 4,096 tokens: flash (auto) against the blocked path
# with a bf16 cache, flash against the tiled kernel with an int8 cache.
set -u
cd "$(dirname "$0")/../../../.gpu-bench"
for f in bench kernel_tests; do gzip -dc $f.gz > /tmp/$f; chmod +x /tmp/$f; done
LT=$(find /usr/local /usr/lib -name 'libcublasLt.so*' 2>/dev/null | head -1); export LD_LIBRARY_PATH=$(dirname $LT)
export BURN_GEMMA_TEST_SEED=20261128
timeout 170 /tmp/kernel_tests --test-threads 3 attention::flash attention::gpu::attention_matches > $OUT/flash.txt 2>&1; echo "flash rc $?" >> $OUT/flash.txt
grep -E "^test |rc |panicked|result" $OUT/flash.txt | head -30
run() { # kv attention
  echo "== gemma3-4b pp4096 kv $1 attention $2"
  BURN_GEMMA_CACHE=/tmp/cache timeout 100 /tmp/bench --model synthetic:gemma3-4b --backend cuda --dtype bf16 --kv-cache $1 \
    --prompt-len 4096 --gen 2 --reps 3 --prefill-attention $2 2>&1 | grep -E "prefill pp|first token|rror"
}
{ run bf16 auto; run bf16 blocked; run int8 auto; run int8 tiled; } 2>&1 | tee $OUT/prompts.txt
