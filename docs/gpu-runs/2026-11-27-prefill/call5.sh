#!/bin/bash
# GPU call 5: the tail block through the tiled kernel (513 and other lengths), cuBLASLt opt-in on
# 4B, then the blocked-attention and cuBLASLt tests.
set -u
cd "$(dirname "$0")"
for f in bench kernel_tests; do gzip -dc $f.gz > /tmp/$f; chmod +x /tmp/$f; done
LT=$(find /usr/local -name 'libcublasLt.so*' 2>/dev/null | head -1); export LD_LIBRARY_PATH=$(dirname $LT)
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $OUT/lengths.txt
export BURN_GEMMA_CACHE=/tmp/cache
run() { # model len candidates
  echo "== $1 pp$2 $3"
  timeout 100 /tmp/bench --model synthetic:$1 --backend cuda --dtype bf16 --prompt-len $2 --gen 2 --reps 3 --gemm-candidates $3 2>&1 | grep -E "prefill pp|tuning|rror|JSON"
}
for len in 512 513 576 1000 4096 100 2048; do run gemma3-1b $len tuned; done >> $OUT/lengths.txt 2>&1
for len in 512 4096; do run gemma3-4b $len tuned; run gemma3-4b $len tuned,cublaslt; done >> $OUT/lengths.txt 2>&1
run gemma3-4b 513 tuned >> $OUT/lengths.txt 2>&1
grep -E "==|prefill pp" $OUT/lengths.txt
export BURN_GEMMA_TEST_SEED=20261127
timeout 150 /tmp/kernel_tests --nocapture blocked > $OUT/tests.txt 2>&1; echo "blocked rc $?" >> $OUT/tests.txt
timeout 60 /tmp/kernel_tests --nocapture cublaslt >> $OUT/tests.txt 2>&1; echo "cublaslt rc $?" >> $OUT/tests.txt
grep -E "^test |rc " $OUT/tests.txt
