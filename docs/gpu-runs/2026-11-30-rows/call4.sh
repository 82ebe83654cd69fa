#!/bin/bash
# Call D (issue 34): the Q4/Q8 GEMV with up to eight output features per plane for one
# activation row (work_split's MOST_PER_PLANE) against the build before it (prev/bench.gz, commit
# d6c4e88: at most four). (1) The quantized GEMV's tests on CUDA (f32, bf16: eight features per
# plane with one, two and eight planes per row group, and the GELU pairs epilogue); (2) bench,
# alternating builds, random weights, bf16, tg128 after a 512-token prompt, medians of 3.
set -u
cd "$(dirname "$0")"
for b in bench kernel_tests; do gzip -dc $b.gz > /tmp/$b; chmod +x /tmp/$b; done
gzip -dc prev/bench.gz > /tmp/prev-bench; chmod +x /tmp/prev-bench
LT=$(find /usr/local /usr/lib -name 'libcublasLt.so*' 2>/dev/null | head -1); export LD_LIBRARY_PATH=$(dirname $LT)
export BURN_GEMMA_CACHE=/tmp/cache-ab
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $OUT/env.txt
SEED=${SEED:-$(date +%s)}
BURN_GEMMA_TEST_SEED=20261130 timeout 110 /tmp/kernel_tests --test-threads 2 quant::check::gpu > $OUT/kernel-tests.txt 2>&1; echo "rc $?" >> $OUT/kernel-tests.txt
echo "== seed $SEED" >> $OUT/kernel-tests.txt
BURN_GEMMA_TEST_SEED=$SEED timeout 110 /tmp/kernel_tests --test-threads 2 quant::check::gpu >> $OUT/kernel-tests.txt 2>&1; echo "rc $?" >> $OUT/kernel-tests.txt
grep -E "^test |rc |test result|panicked|seed" $OUT/kernel-tests.txt | head
SPECS=${SPECS:-"gemma3-12b:q4:16 gemma3-4b:q8:0 gemma3-1b:q4:0"}
for spec in $SPECS; do
  IFS=: read model w layers <<< "$spec"
  la=(); [ "$layers" != 0 ] && la=(--layers $layers)
  for b in prev new; do
    exe=/tmp/bench; [ $b = prev ] && exe=/tmp/prev-bench
    echo "== $b $model $w ${la[*]} $(date +%T)" >> $OUT/ab.txt
    timeout 75 $exe --model synthetic:$model --backend cuda --dtype bf16 --weights $w "${la[@]}" --prompt-len 512 --gen 128 --reps 3 >> $OUT/ab.txt 2>&1 || echo "failed rc $?" >> $OUT/ab.txt
  done
done
grep -E "^==|decode tg|failed" $OUT/ab.txt; date +%T
