#!/bin/bash
# GPU call 3: where cuBLASLt (device-ordered) pays within a whole prompt: CubeCL's kernels alone
# against cuBLASLt timed for products of at least FLOOR million multiply-adds (0, 16000, 64000),
# 12B (16 of its 48 layers) first, then 4B and 1B; each configuration its own tuning cache.
set -u
cd "$(dirname "$0")"
gzip -dc bench.gz > /tmp/bench; chmod +x /tmp/bench
LT=$(find /usr/local /usr/lib -name 'libcublasLt.so*' 2>/dev/null | head -1); export LD_LIBRARY_PATH=$(dirname $LT)
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/gpu.txt
run() { # model len candidates floor [layers]
  local cache=/tmp/cache-$1-${3//,/-}-$4
  echo "== $1 pp$2 $3 floor ${4}M layers ${5:-all}"
  local t0=$(date +%s)
  BURN_GEMMA_CACHE=$cache timeout 120 /tmp/bench --model synthetic:$1 --backend cuda --dtype bf16 --prompt-len $2 --gen 2 --reps 3 \
    --gemm-candidates $3 --cublaslt-floor-m $4 ${5:+--layers $5} 2>&1 | grep -E "prefill pp|rror"
  echo "   ($(( $(date +%s) - t0 )) s)"
  { echo "== $cache pp$2"; cat $cache/gemm-tune.txt 2>/dev/null; } >> $OUT/tune.txt
}
{
for len in 512 4096; do run gemma3-12b $len tuned 0 16; run gemma3-12b $len tuned,cublaslt 0 16; done
for m in gemma3-4b gemma3-1b; do for len in 4096 512; do
  run $m $len tuned 0; run $m $len tuned,cublaslt 0; run $m $len tuned,cublaslt 16000; run $m $len tuned,cublaslt 64000
done; done
} 2>&1 | tee $OUT/prompts.txt
