#!/usr/bin/env bash
# Call 5 (after the review mend: block tables written only after they changed, the step's
# dtypes checked before recording): the engine against each request alone on CUDA (graphs and
# eager) and the random 1B's batched step (replay == eager) again.
set -u
here=$PWD/gpu-bundle
unxz() { xz -dc "$1" 2>/dev/null || python3 -c 'import lzma,shutil,sys; shutil.copyfileobj(lzma.open(sys.argv[1]), sys.stdout.buffer)' "$1"; }
for b in engine_test bstest; do unxz $here/$b.xz > /tmp/$b && chmod +x /tmp/$b; done
BURN_GEMMA_FIXTURES=$PWD/tests/fixtures /tmp/engine_test --test-threads 1 --nocapture cuda > $OUT/call5-engine-test.txt 2>&1
echo "engine test rc $?"; grep -E "test result|FAILED|panicked|replayed" $OUT/call5-engine-test.txt | head -20; date
/tmp/bstest --nocapture > $OUT/call5-batched-step-test.txt 2>&1
echo "batched step rc $?"; grep -E "test result|FAILED|panicked|replayed|no graph" $OUT/call5-batched-step-test.txt | head -20; date
