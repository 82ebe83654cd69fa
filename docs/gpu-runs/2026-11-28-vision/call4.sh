#!/bin/bash
# GPU call 4: SigLIP's heads of 72 padded to 96 for the flash kernel (kernel attention test with
# a head-72 case, f32/bf16/f16), the assistant drafts against HF after its masked logits left
# Burn's matmul (TF32 on CUDA: 1.20e-4 in call 3), the vision fixtures on CUDA, and the time to
# first token with one 896x896 picture again (Gemma 3 4B: 0.50 s in call 1, its tower 0.47 s).
set -u
cd "$(dirname "$0")/../../../.gpu-bench"
for b in integration vision_bench kernel_tests; do gzip -dc $b.gz > /tmp/$b; chmod +x /tmp/$b; done
LT=$(find /usr/local /usr/lib -name 'libcublasLt.so*' 2>/dev/null | head -1); export LD_LIBRARY_PATH=$(dirname $LT)
export BURN_GEMMA_TEST_SEED=20261131 BURN_GEMMA_FIXTURES=$PWD/../tests/fixtures
timeout 200 /tmp/kernel_tests --test-threads 1 attention > $OUT/kernel-attention.txt 2>&1; echo "rc $?" >> $OUT/kernel-attention.txt
grep -E "^test |rc |test result|panicked" $OUT/kernel-attention.txt | head -40
timeout 150 /tmp/integration --test-threads 1 --nocapture assistant_drafts_match_hf_on_cuda images_match_hf_on_cuda \
  > $OUT/tests.txt 2>&1; echo "rc $?" >> $OUT/tests.txt
grep -E "^test |rc |test result|panicked|within|worst|error" $OUT/tests.txt | head -30
for run in "gemma3 gemma3-4b" "gemma4 gemma4-e4b"; do
  set -- $run
  timeout 120 /tmp/vision_bench --backend cuda --dtype bf16 --generation $1 --text $2 --reps 5 > $OUT/ttft-$1.txt 2>&1
  echo "rc $?" >> $OUT/ttft-$1.txt; tail -3 $OUT/ttft-$1.txt
done
