#!/bin/bash
# GPU call 5: the defaults as shipped (cuBLASLt among the tuner's candidates from 16G
# multiply-adds, no bench flags) against CubeCL's kernels alone (`--gemm-candidates tuned`):
# the GEMM, blocked-attention and cuBLASLt kernel tests, then 12B (16 of 48 layers) and 4B at 4,096 and 16,384 tokens.
set -u
cd "$(dirname "$0")"
for f in bench kernel_tests; do gzip -dc $f.gz > /tmp/$f; chmod +x /tmp/$f; done
LT=$(find /usr/local /usr/lib -name 'libcublasLt.so*' 2>/dev/null | head -1); export LD_LIBRARY_PATH=$(dirname $LT)
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/gpu.txt
export BURN_GEMMA_TEST_SEED=20261127
timeout 150 /tmp/kernel_tests --test-threads 1 gemm:: attention::blocked > $OUT/tests.txt 2>&1; echo "tests rc $?" >> $OUT/tests.txt
grep -E "^test |rc |result" $OUT/tests.txt
run() { # model len candidates [layers]
  echo "== $1 pp$2 $3 layers ${4:-all}"
  BURN_GEMMA_CACHE=/tmp/cache-$1-$3 timeout 120 /tmp/bench --model synthetic:$1 --backend cuda --dtype bf16 --prompt-len $2 --gen 2 --reps 3 \
    ${3:+--gemm-candidates $3} ${4:+--layers $4} 2>&1 | grep -E "prefill pp|rror"
}
{
for len in 4096 16384; do run gemma3-12b $len tuned 16; run gemma3-12b $len default 16; done
for len in 4096 16384; do run gemma3-4b $len tuned; run gemma3-4b $len default; done
} 2>&1 | tee $OUT/prompts.txt
