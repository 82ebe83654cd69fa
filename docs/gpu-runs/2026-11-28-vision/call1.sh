#!/bin/bash
# GPU call 1 of 2026-11-28 (vision session). Needs .gpu-bench/ with integration.gz and
# vision_bench.gz of this build (carry: [".gpu-bench"]).
# 1. The bf16 expert fixture's graph-against-eager comparison (stream order, then overlapped):
#    which order fails says whether programmatic dependent launch is the cause.
# 2. The vision fixtures (Gemma 3, Gemma 4 dense and E) against HF on CUDA.
# 3. Time to first token with one 896x896 picture: Gemma 3 4B's shape (SigLIP tower + 4B text,
#    bf16) and Gemma 4 E4B's (HF's default tower + E4B text), 5 reps after a warm-up.
set -u
cd "$(dirname "$0")/../../../.gpu-bench"
for b in integration vision_bench; do gzip -dc $b.gz > /tmp/$b; chmod +x /tmp/$b; done
LT=$(find /usr/local /usr/lib -name 'libcublasLt.so*' 2>/dev/null | head -1); export LD_LIBRARY_PATH=$(dirname $LT)
export BURN_GEMMA_TEST_SEED=20261130 BURN_GEMMA_FIXTURES=$PWD/../tests/fixtures
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv > $OUT/gpu.txt
timeout 200 /tmp/integration --test-threads 1 --nocapture --exact cuda_graph::gemma4_graph_equals_eager > $OUT/graph.txt 2>&1
echo "rc $?" >> $OUT/graph.txt
grep -E "^test |rc |test result|panicked|steps equal|differ|order" $OUT/graph.txt | head -30
timeout 200 /tmp/integration --test-threads 1 --nocapture --exact vision::gemma3_images_match_hf_on_cuda \
  vision::gemma4_images_match_hf_on_cuda > $OUT/vision-tests.txt 2>&1
echo "rc $?" >> $OUT/vision-tests.txt
grep -E "^test |rc |test result|panicked|within" $OUT/vision-tests.txt | head -30
for run in "gemma3 gemma3-4b" "gemma4 gemma4-e4b"; do
  set -- $run
  timeout 150 /tmp/vision_bench --backend cuda --dtype bf16 --generation $1 --text $2 --reps 5 > $OUT/ttft-$1.txt 2>&1
  echo "rc $?" >> $OUT/ttft-$1.txt
  cat $OUT/ttft-$1.txt | tail -5
done
