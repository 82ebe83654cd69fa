#!/bin/bash
# Call 4: the quantized GEMV launched unchecked with 1.0's bits in a register (one LOP3 per
# code) against the previous build (prev/bench.gz), alternating; the quant kernels against the
# host on CUDA; the 12B decode kernel table.
set -u
cd "$(dirname "$0")"
for b in bench; do gzip -dc $b.gz > /tmp/$b; chmod +x /tmp/$b; done
gzip -dc prev/bench.gz > /tmp/prev-bench; chmod +x /tmp/prev-bench
LT=$(find /usr/local /usr/lib -name 'libcublasLt.so*' 2>/dev/null | head -1); export LD_LIBRARY_PATH=$(dirname $LT)
export BURN_GEMMA_TEST_SEED=20261130 BURN_GEMMA_CACHE=/tmp/cache-ab
[ -x /tmp/kernel_tests ] && timeout 100 /tmp/kernel_tests --test-threads 1 quant::check::gpu > $OUT/kernel-tests.txt 2>&1; echo "rc $?" >> $OUT/kernel-tests.txt
grep -E "^test |rc |test result" $OUT/kernel-tests.txt | head
[ -x /tmp/kernel_bench ] && timeout 150 /tmp/kernel_bench --backend cuda --dtype bf16 --section decode --models 12b --reps 10 > $OUT/kb-new.txt 2>&1; echo "rc $?" >> $OUT/kb-new.txt
grep -E "^\| q[48] .*\| 1 x|^\| q[48] \||rc " $OUT/kb-new.txt
for round in 1 2; do
  SPECS=${SPECS:-"gemma3-1b:q4:0 gemma3-12b:q4:16 gemma3-4b:q8:0"}
  for spec in $SPECS; do
    IFS=: read model w layers <<< "$spec"
    la=(); [ "$layers" != 0 ] && la=(--layers $layers)
    order="prev new"; [ $round = 2 ] && order="new prev"
    for b in $order; do
      exe=/tmp/bench; [ $b = prev ] && exe=/tmp/prev-bench
      echo "== round $round $b $model $w ${la[*]}" >> $OUT/ab.txt
      timeout 80 $exe --model synthetic:$model --backend cuda --dtype bf16 --weights $w "${la[@]}" --prompt-len 512 --gen 128 --reps 3 >> $OUT/ab.txt 2>&1 || echo "failed rc $?" >> $OUT/ab.txt
    done
  done
done
grep -E "^==|decode tg|failed" $OUT/ab.txt
