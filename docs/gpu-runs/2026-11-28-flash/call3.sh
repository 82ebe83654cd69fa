#!/bin/bash
# GPU call 3: the flash kernel's loads issued together (registers, then shared memory) and an
# optional prefetch of the next tile; its tests over five layouts, then the attention table by
# layout (dense bf16, 8k and 16k tokens) beside the blocked path.
set -u
cd "$(dirname "$0")/../../../.gpu-bench"
for f in kernel_bench kernel_tests; do gzip -dc $f.gz > /tmp/$f; chmod +x /tmp/$f; done
LT=$(find /usr/local /usr/lib -name 'libcublasLt.so*' 2>/dev/null | head -1); export LD_LIBRARY_PATH=$(dirname $LT)
export BURN_GEMMA_CACHE=/tmp/cache BURN_GEMMA_TEST_SEED=20261128
timeout 200 /tmp/kernel_tests --test-threads 2 attention::flash > $OUT/flash.txt 2>&1; echo "flash rc $?" >> $OUT/flash.txt
grep -E "^test |rc |panicked|worst|flash " $OUT/flash.txt | head -30
KB="/tmp/kernel_bench --backend cuda --dtype bf16 --section attention --reps 3"
timeout 330 $KB --kv dense --attention-kernels flash,blocked --tokens 8192,16384 \
  --flash-layouts default,4x32,4x32p,4x64p,8x64,8x32p,2x64p 2>&1 | tee $OUT/attention.txt
