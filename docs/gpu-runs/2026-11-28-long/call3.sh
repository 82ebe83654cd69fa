#!/bin/bash
# GPU call 3 (issue 34), right after call 2 on the same warm machine: decode replayed with
# programmatic dependent launch (this build, bench.gz) against the build before it (stream
# order, prev/bench.gz), alternating, tg128 after a 512-token prompt (medians of 3 after a
# warm-up): random-weight 1B q4, 4B q8, 12B q4 (8 of 48 layers: every matrix shape), and the
# whole 12B Q4_K_M file of call 2 with llama-bench's tg128 at depth 512 beside it where the
# machine still holds it (it did not: a fresh machine).
set -u
cd "$(dirname "$0")/../../../.gpu-bench"
export OUT
gzip -dc bench.gz > /tmp/bench-new; gzip -dc prev/bench.gz > /tmp/bench-prev
chmod +x /tmp/bench-new /tmp/bench-prev
LT=$(find /usr/local /usr/lib -name 'libcublasLt.so*' 2>/dev/null | head -1); export LD_LIBRARY_PATH=$(dirname $LT):/tmp/lcpp/build/bin
export BURN_GEMMA_CACHE=/tmp/prefill-cache
run() { # build, model, extra args
  echo "== $1 $2 ${*:3}" >> $OUT/ab.txt
  timeout 150 /tmp/bench-$1 --model "$2" --backend cuda --dtype bf16 --prompt-len 512 --gen 128 --reps 3 "${@:3}" >> $OUT/ab.txt 2>&1 ||
    echo "failed rc $?" >> $OUT/ab.txt
}
for round in 1 2; do
  for build in prev new; do
    run $build synthetic:gemma3-1b --weights q4
    run $build synthetic:gemma3-4b --weights q8
    run $build synthetic:gemma3-12b --weights q4 --layers 8
  done
done
grep -E "^==|decode tg|GPU busy|failed" $OUT/ab.txt
if [ -s /tmp/gguf/12b-Q4_K_M.gguf ]; then
  for build in prev new; do run $build /tmp/gguf/12b-Q4_K_M.gguf; done
  timeout 60 /tmp/lcpp/build/bin/llama-bench -m /tmp/gguf/12b-Q4_K_M.gguf -p 0 -n 128 -d 512 -fa 1 -ngl 99 -r 3 -o md >> $OUT/ab.txt 2>&1
  grep -E "^==|decode tg|\| gemma" $OUT/ab.txt | tail -6
fi
