#!/bin/bash
# GPU call 1 (carries .gpu-bench: bench, integration and kernel test binaries): the quantized GEMV
# issuing its first weight loads before it waits for the kernels before it (replayed graphs,
# programmatic dependent launch). (1) The quantized kernels against the host on CUDA (f32, bf16);
# (2) every CUDA-graph test (replayed decode equal to eager decode); (3) decode with the marked
# wait (`--dependent-launch auto`) against the wait in every kernel's first statement
# (`at-start`, the previous build's placement), alternating, on random weights of Gemma 3
# shapes: tg128 after a 512-token prompt, the bench's medians of 3 after a warm-up.
set -u
cd "$(dirname "$0")/../../../.gpu-bench"
for b in bench integration kernel_tests; do gzip -dc $b.gz > /tmp/$b; chmod +x /tmp/$b; done
LT=$(find /usr/local /usr/lib -name 'libcublasLt.so*' 2>/dev/null | head -1); export LD_LIBRARY_PATH=$(dirname $LT)
export BURN_GEMMA_TEST_SEED=20261129 BURN_GEMMA_FIXTURES=$PWD/../tests/fixtures BURN_GEMMA_CACHE=/tmp/cache-ab
timeout 120 /tmp/kernel_tests --test-threads 1 quant::check > $OUT/kernel-tests.txt 2>&1; echo "rc $?" >> $OUT/kernel-tests.txt
grep -E "^test |rc |test result" $OUT/kernel-tests.txt | head
timeout 200 /tmp/integration --test-threads 1 cuda_graph > $OUT/graph-tests.txt 2>&1; echo "rc $?" >> $OUT/graph-tests.txt
grep -E "^test |rc |test result|panicked" $OUT/graph-tests.txt | head -30
for round in 1 2 3; do
  order="auto at-start"; [ $round = 2 ] && order="at-start auto"
  for spec in "gemma3-1b q4 0" "gemma3-4b q8 0" "gemma3-12b q4 16"; do
    set -- $spec
    layers=(); [ "$3" != 0 ] && layers=(--layers "$3")
    for mode in $order; do
      echo "== round $round $mode $1 $2 ${layers[*]}" >> $OUT/ab.txt
      timeout 120 /tmp/bench --model synthetic:$1 --backend cuda --dtype bf16 --weights $2 "${layers[@]}" --prompt-len 512 \
        --gen 128 --reps 3 --dependent-launch $mode >> $OUT/ab.txt 2>&1 || echo "failed rc $?" >> $OUT/ab.txt
    done
  done
done
grep -E "^==|decode tg|failed" $OUT/ab.txt
