#!/bin/bash
# GPU call 4: cuBLASLt ordered from CubeCL's device thread (one round trip per product instead
# of four): its tests, then CubeCL's kernels alone against cuBLASLt (floor 0 and 16000 million
# multiply-adds) on 1B, 4B and 12B (16 of 48 layers), each configuration its own tuning cache.
set -u
cd "$(dirname "$0")"
for f in bench kernel_tests; do gzip -dc $f.gz > /tmp/$f; chmod +x /tmp/$f; done
LT=$(find /usr/local /usr/lib -name 'libcublasLt.so*' 2>/dev/null | head -1); export LD_LIBRARY_PATH=$(dirname $LT)
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/gpu.txt
export BURN_GEMMA_TEST_SEED=20261127
timeout 90 /tmp/kernel_tests --test-threads 1 --nocapture cublaslt > $OUT/tests.txt 2>&1; echo "cublaslt rc $?" >> $OUT/tests.txt
grep -E "^test |rc |panicked|result" $OUT/tests.txt | head
grep -q "cublaslt rc 0" $OUT/tests.txt || exit 1
run() { # model len candidates floor [layers]
  local cache=/tmp/cache-$1-${3//,/-}-$4
  echo "== $1 pp$2 $3 floor ${4}M layers ${5:-all}"
  local t0=$(date +%s)
  BURN_GEMMA_CACHE=$cache timeout 100 /tmp/bench --model synthetic:$1 --backend cuda --dtype bf16 --prompt-len $2 --gen 2 --reps 3 \
    --gemm-candidates $3 --cublaslt-floor-m $4 ${5:+--layers $5} 2>&1 | grep -E "prefill pp|rror"
  echo "   ($(( $(date +%s) - t0 )) s)"
  { echo "== $cache pp$2"; cat $cache/gemm-tune.txt 2>/dev/null; } >> $OUT/tune.txt
}
{
for len in 4096 512; do run gemma3-1b $len tuned 0; run gemma3-1b $len tuned,cublaslt 0; run gemma3-1b $len tuned,cublaslt 16000; done
for len in 4096 512; do run gemma3-4b $len tuned 0; run gemma3-4b $len tuned,cublaslt 0; run gemma3-4b $len tuned,cublaslt 16000; done
for len in 4096 512; do run gemma3-12b $len tuned 0 16; run gemma3-12b $len tuned,cublaslt 0 16; done
} 2>&1 | tee $OUT/prompts.txt
