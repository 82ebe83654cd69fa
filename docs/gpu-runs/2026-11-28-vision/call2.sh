#!/bin/bash
# GPU call 2: (1) the bf16 expert fixture's first decode step four ways (host-position eager,
# device-position eager, replayed graph, f32 model); (2) Gemma 3's vision fixture on CUDA after
# its patch embedding and projector moved off Burn's matmul (TF32 on CUDA: 1.23e-3 in call 1);
# (3) the 128K prompt on the 4B shape after the tuner shares one class past 16K keys.
set -u
cd "$(dirname "$0")/../../../.gpu-bench"
for b in integration bench; do gzip -dc $b.gz > /tmp/$b; chmod +x /tmp/$b; done
LT=$(find /usr/local /usr/lib -name 'libcublasLt.so*' 2>/dev/null | head -1); export LD_LIBRARY_PATH=$(dirname $LT)
export BURN_GEMMA_TEST_SEED=20261130 BURN_GEMMA_FIXTURES=$PWD/../tests/fixtures
timeout 120 /tmp/integration --test-threads 1 --nocapture --exact cuda_graph::gemma4_moe_bf16_decode_paths \
  vision::gemma3_images_match_hf_on_cuda vision::gemma4_images_match_hf_on_cuda > $OUT/tests.txt 2>&1
echo "rc $?" >> $OUT/tests.txt
grep -E "^test |rc |test result|panicked|within|first decode|from HF" $OUT/tests.txt | head -30
BURN_GEMMA_CACHE=/tmp/cache128k /usr/bin/time -v timeout 360 /tmp/bench --model synthetic:gemma3-4b --backend cuda \
  --dtype bf16 --prompt-len 131071 --gen 1 --reps 1 > $OUT/long128k.txt 2>&1; echo "rc $?" >> $OUT/long128k.txt
grep -E "prefill pp|tuning|first token|peak device|Maximum resident|Elapsed|rc " $OUT/long128k.txt
