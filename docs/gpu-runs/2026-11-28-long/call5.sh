#!/bin/bash
# GPU call 5 (not run: the session's device time ran out). Needs .gpu-bench/ with bench.gz and
# integration.gz of this session's last build (carry: [".gpu-bench"]).
# 1. The bf16 expert fixture's graph-against-eager comparison, now run in stream order and then
#    overlapped in one test (call 4 failed it overlapped; it last passed in stream order on
#    2026-11-25): which order fails says whether programmatic dependent launch is the cause.
# 2. The 128K prompt on the 4B after the tuner shares one class past 16K keys (call 1: 155 s of
#    tuning in the warm-up pass).
set -u
cd "$(dirname "$0")/../../../.gpu-bench"
gzip -dc bench.gz > /tmp/bench; gzip -dc integration.gz > /tmp/integration; chmod +x /tmp/bench /tmp/integration
LT=$(find /usr/local /usr/lib -name 'libcublasLt.so*' 2>/dev/null | head -1); export LD_LIBRARY_PATH=$(dirname $LT)
export BURN_GEMMA_TEST_SEED=20261129 BURN_GEMMA_FIXTURES=$PWD/../tests/fixtures
timeout 200 /tmp/integration --test-threads 1 --nocapture --exact cuda_graph::gemma4_graph_equals_eager > $OUT/tests.txt 2>&1
echo "integration rc $?" >> $OUT/tests.txt
grep -E "^test |rc |test result|panicked|steps equal|differ" $OUT/tests.txt
BURN_GEMMA_CACHE=/tmp/cache128k /usr/bin/time -v timeout 300 /tmp/bench --model synthetic:gemma3-4b --backend cuda \
  --dtype bf16 --prompt-len 131071 --gen 1 --reps 1 > $OUT/long128k.txt 2>&1; echo "rc $?" >> $OUT/long128k.txt
grep -E "prefill pp|tuning|first token|peak device|Maximum resident|Elapsed|rc " $OUT/long128k.txt
