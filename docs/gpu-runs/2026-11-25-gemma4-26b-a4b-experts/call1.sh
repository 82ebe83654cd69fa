#!/usr/bin/env bash
# Call 1: the expert kernels' tests, HF parity and graph == eager through CUDA, while llama.cpp
# builds and the 26B-A4B GGUFs are written.
set -u
here=$PWD/.gpu-bench
mkdir -p $OUT/prep
( OUT=$OUT/prep G4MODELS=26b-a4b G4QUANTS="Q8_0 Q4_K_M" bash $here/bench-gpu.sh prepare4 > $OUT/prep/prepare.txt 2>&1; echo "prepare rc $?" >> $OUT/prep/prepare.txt ) &
prep=$!
for t in kernel_tests tiny_models cuda_graph; do gzip -dc $here/$t.gz > /tmp/bg-$t && chmod +x /tmp/bg-$t; done
export BURN_GEMMA_FIXTURES=$PWD/tests/fixtures
BURN_GEMMA_TEST_SEED=20261125 /tmp/bg-kernel_tests --test-threads 2 --nocapture experts > $OUT/kernel-experts-fixed.txt 2>&1; echo "kernel experts fixed rc $?"
/tmp/bg-kernel_tests --test-threads 2 --nocapture experts > $OUT/kernel-experts-fresh.txt 2>&1; echo "kernel experts fresh rc $?"
grep -E "^test |test result|max scaled" $OUT/kernel-experts-fixed.txt | grep -E "test|1 tokens, 128|8 tokens" | head -40
/tmp/bg-tiny_models --test-threads 1 --nocapture cuda > $OUT/tiny-models.txt 2>&1; echo "tiny rc $?"
grep -E "^test |test result|moe" $OUT/tiny-models.txt | head -40
/tmp/bg-cuda_graph --test-threads 1 --nocapture gemma4 > $OUT/cuda-graph-gemma4.txt 2>&1; echo "graph rc $?"
grep -E "^test |test result|steps equal|panicked" $OUT/cuda-graph-gemma4.txt
wait $prep
tail -5 $OUT/prep/prepare.txt; cat $OUT/prep/log.txt 2>/dev/null | tail -5; ls -la /tmp/gguf
