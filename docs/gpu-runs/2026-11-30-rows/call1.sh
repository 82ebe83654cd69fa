#!/bin/bash
# Call A (issue 34, commit d6c4e88): in the background, llama.cpp built and the Gemma 3 files
# written (gen_gguf4.py g3-*: 1B, 4B Q4_K_M and Q8_0, 12B Q4_K_M) for the next calls; in the
# foreground, the committed GEMV kernels (Q4/Q8 unchecked with 1.0's bits as an argument, dense,
# k-quant, routed experts) against their references on CUDA (f32 and bf16).
set -u
cd "$(dirname "$0")"
here=$PWD
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,clocks.max.mem --format=csv > $OUT/env.txt
mkdir -p /tmp/gpy $OUT/bg && tar xzf kit/llama.cpp-src.tgz -C /tmp/gpy --wildcards './gguf-py/*'
( OUT=$OUT/bg bash bench-gpu.sh llama > $OUT/bg/build-llama.txt 2>&1; echo "rc $? at $(date +%T)" >> $OUT/bg/build-llama.txt ) &
( export OUT=$OUT/bg PYTHONPATH=/tmp/gpy/gguf-py
  G3MODELS="1b 4b" G3QUANTS="Q4_K_M Q8_0" bash bench-gpu.sh prepare3 > $OUT/prepare3.txt 2>&1
  G3MODELS="12b" G3QUANTS="Q4_K_M" bash bench-gpu.sh prepare3 >> $OUT/prepare3.txt 2>&1; echo "rc $? at $(date +%T)" >> $OUT/prepare3.txt ) &
gzip -dc kernel_tests.gz > /tmp/kernel_tests; chmod +x /tmp/kernel_tests
LT=$(find /usr/local /usr/lib -name 'libcublasLt.so*' 2>/dev/null | head -1); export LD_LIBRARY_PATH=$(dirname $LT)
SEED=${SEED:-$(date +%s)}
for seed in 20261130 $SEED; do
  echo "== seed $seed at $(date +%T)" >> $OUT/kernel-tests.txt
  BURN_GEMMA_TEST_SEED=$seed timeout ${KT_LIMIT:-170} /tmp/kernel_tests --test-threads 4 ${KT_FILTERS:-quant:: linear:: experts::} >> $OUT/kernel-tests.txt 2>&1; echo "rc $?" >> $OUT/kernel-tests.txt
done
grep -E "^== |^test .*(FAILED|ignored)|rc |test result|panicked" $OUT/kernel-tests.txt | head -30
wait
tail -2 $OUT/bg/build-llama.txt; tail -3 $OUT/prepare3.txt; ls -la /tmp/gguf; date +%T
