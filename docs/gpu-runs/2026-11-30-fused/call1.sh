#!/bin/bash
# Call 1 (issue 34): the add + RMSNorm fused into the q|k|v and gate|up GEMVs' prologue
# (quant::normed_gemv, commit 0fe2b85) against the build before it (prev/bench.gz, commit
# 5ac677d: add_rms_norm then the quantized GEMV): bench, alternating builds, random weights,
# bf16, tg128 after a 512-token prompt, medians of 3 per run.
set -u
cd "$(dirname "$0")"
gzip -dc bench.gz > /tmp/bench; chmod +x /tmp/bench
gzip -dc prev/bench.gz > /tmp/prev-bench; chmod +x /tmp/prev-bench
LT=$(find /usr/local /usr/lib -name 'libcublasLt.so*' 2>/dev/null | head -1); export LD_LIBRARY_PATH=$(dirname $LT)
export BURN_GEMMA_CACHE=/tmp/cache-ab
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $OUT/env.txt
SPECS=${SPECS:-"gemma3-12b:q4:16 gemma3-4b:q8:0 gemma3-1b:q4:0"}
for round in ${ROUNDS:-1}; do
for spec in $SPECS; do
  IFS=: read model w layers <<< "$spec"
  la=(); [ "$layers" != 0 ] && la=(--layers $layers)
  for b in prev new; do
    exe=/tmp/bench; [ $b = prev ] && exe=/tmp/prev-bench
    echo "== $b $model $w ${la[*]} round $round $(date +%T)" >> $OUT/ab.txt
    timeout 75 $exe --model synthetic:$model --backend cuda --dtype bf16 --weights $w "${la[@]}" --prompt-len 512 --gen 128 --reps 3 >> $OUT/ab.txt 2>&1 || echo "failed rc $?" >> $OUT/ab.txt
  done
done
done
grep -E "^==|decode tg|failed" $OUT/ab.txt; date +%T
