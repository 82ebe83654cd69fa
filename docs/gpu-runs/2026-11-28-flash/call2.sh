#!/bin/bash
# GPU call 2: prompt attention by kernel (kernel_bench --section attention): flash against the
# blocked GEMM path on dense bf16 keys, 2k to 32k tokens; int8 keys by flash (and the tiled
# kernel, the path int8 prompts took before, at 2k).
set -u
cd "$(dirname "$0")/../../../.gpu-bench"
for f in kernel_bench; do gzip -dc $f.gz > /tmp/$f; chmod +x /tmp/$f; done
LT=$(find /usr/local /usr/lib -name 'libcublasLt.so*' 2>/dev/null | head -1); export LD_LIBRARY_PATH=$(dirname $LT)
export BURN_GEMMA_CACHE=/tmp/cache
KB="/tmp/kernel_bench --backend cuda --dtype bf16 --section attention --reps 3"
{
timeout 300 $KB --kv dense --attention-kernels flash,blocked --tokens 2048,8192,16384,32768
timeout 100 $KB --kv int8 --attention-kernels flash,tiled --tokens 2048
timeout 100 $KB --kv int8 --attention-kernels flash --tokens 16384
} 2>&1 | tee $OUT/attention.txt
