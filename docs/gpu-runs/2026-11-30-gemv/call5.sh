#!/bin/bash
# Call 5: Q4 codes two per shift (pair_code), the dense and k-quant GEMVs launched unchecked
# (k-quant with 1.0's bits in a register) against the previous commit's build (prev/bench.gz:
# f0d206b, the Q4/Q8 GEMV unchecked), alternating; the GEMV kernels against their references
# on CUDA (f32, bf16).
set -u
cd "$(dirname "$0")"
for b in bench kernel_tests; do gzip -dc $b.gz > /tmp/$b; chmod +x /tmp/$b; done
gzip -dc prev/bench.gz > /tmp/prev-bench; chmod +x /tmp/prev-bench
LT=$(find /usr/local /usr/lib -name 'libcublasLt.so*' 2>/dev/null | head -1); export LD_LIBRARY_PATH=$(dirname $LT)
export BURN_GEMMA_TEST_SEED=20261130 BURN_GEMMA_CACHE=/tmp/cache-ab
timeout 120 /tmp/kernel_tests --test-threads 2 quant::check::gpu quant::kquant::check linear::gpu > $OUT/kernel-tests.txt 2>&1; echo "rc $?" >> $OUT/kernel-tests.txt
grep -E "^test |rc |test result" $OUT/kernel-tests.txt | head
SPECS=${SPECS:-"gemma3-12b:q4:16 gemma3-1b:q4:0 gemma3-1b:bf16:0"}
for round in 1; do
  for spec in $SPECS; do
    IFS=: read model w layers <<< "$spec"
    la=(); [ "$layers" != 0 ] && la=(--layers $layers)
    for b in prev new; do
      exe=/tmp/bench; [ $b = prev ] && exe=/tmp/prev-bench
      echo "== round $round $b $model $w ${la[*]}" >> $OUT/ab.txt
      timeout 70 $exe --model synthetic:$model --backend cuda --dtype bf16 --weights $w "${la[@]}" --prompt-len 512 --gen 128 --reps 3 >> $OUT/ab.txt 2>&1 || echo "failed rc $?" >> $OUT/ab.txt
    done
  done
done
grep -E "^==|decode tg|failed" $OUT/ab.txt
