#!/bin/bash
# GPU call 1: cuBLASLt ordered on the device (flags polled by one-thread kernels) — its tests
# first (each under a timeout: the earlier flag design hung), then prompts with CubeCL's kernels
# alone, cuBLASLt host-ordered and cuBLASLt device-ordered, each with its own tuning cache.
set -u
cd "$(dirname "$0")"
for f in bench kernel_tests; do gzip -dc $f.gz > /tmp/$f; chmod +x /tmp/$f; done
LT=$(find /usr/local /usr/lib -name 'libcublasLt.so*' 2>/dev/null | head -1); export LD_LIBRARY_PATH=$(dirname $LT)
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/gpu.txt
export BURN_GEMMA_TEST_SEED=20261127
timeout 120 /tmp/kernel_tests --test-threads 1 --nocapture cublaslt > $OUT/tests.txt 2>&1; echo "cublaslt rc $?" >> $OUT/tests.txt
grep -E "^test |rc |panicked|worst" $OUT/tests.txt | head -30
grep -q "cublaslt rc 0" $OUT/tests.txt || exit 1
run() { # model len candidates order [layers]
  local cache=/tmp/cache-${3//,/-}-$4
  echo "== $1 pp$2 $3 $4 ${5:-all}"
  BURN_GEMMA_CACHE=$cache timeout 150 /tmp/bench --model synthetic:$1 --backend cuda --dtype bf16 --prompt-len $2 --gen 2 --reps 3 \
    --gemm-candidates $3 --cublaslt-order $4 ${5:+--layers $5} 2>&1 | grep -E "prefill pp|rror"
}
{
for m in gemma3-1b gemma3-4b; do for len in 512 4096; do
  run $m $len tuned device; run $m $len tuned,cublaslt host; run $m $len tuned,cublaslt device
done; done
for len in 512 4096; do run gemma3-12b $len tuned device 16; run gemma3-12b $len tuned,cublaslt device 16; done
} > $OUT/prompts.txt 2>&1
cat $OUT/prompts.txt
for c in /tmp/cache-*; do echo "== $c"; cat $c/gemm-tune.txt 2>/dev/null; done > $OUT/tune.txt
