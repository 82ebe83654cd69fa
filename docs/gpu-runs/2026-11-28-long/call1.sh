#!/bin/bash
# GPU call 1 (issue 33): the 128K context of Gemma 3 4B after the GEMM tuner classed the blocked
# attention's key lengths; the GPU tests of code changed since the last run (cuBLASLt after the
# layout logic moved to gemm::blas_layout, flash attention and the quantized mma kernel after
# their accumulators became one helper). Meanwhile
# on the CPU: llama.cpp built and the 12B Q4_K_M file written for call 2 (/tmp survives while
# the machine stays warm).
set -u
cd "$(dirname "$0")/../../../.gpu-bench"
for f in bench kernel_tests; do gzip -dc $f.gz > /tmp/$f; chmod +x /tmp/$f; done
cp /tmp/bench /tmp/burn-gemma-bench
LT=$(find /usr/local /usr/lib -name 'libcublasLt.so*' 2>/dev/null | head -1); export LD_LIBRARY_PATH=$(dirname $LT)
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/gpu.txt
( export OUT=$OUT/prep; mkdir -p $OUT; MODELS="" bash bench-gpu.sh prepare > /dev/null 2>&1
  export PYTHONPATH=/tmp/lcpp/gguf-py; mkdir -p /tmp/gguf
  python3 kit/gen_gguf.py 12b kit/gemma3-vocab.json.gz /tmp/gguf/12b-F16.tmp > $OUT/gen12b.txt 2>&1 &&
    /tmp/lcpp/build/bin/llama-quantize /tmp/gguf/12b-F16.tmp /tmp/gguf/12b-Q4_K_M.tmp Q4_K_M 16 > /dev/null 2>&1 &&
    mv /tmp/gguf/12b-Q4_K_M.tmp /tmp/gguf/12b-Q4_K_M.gguf
  rm -f /tmp/gguf/12b-F16.tmp; echo "12b written at $SECONDS s" >> $OUT/done.txt ) &
echo "== ours synthetic 4B pp131071 (bf16, chunks of 2,048)" > $OUT/long128k.txt
BURN_GEMMA_CACHE=/tmp/cache128k /usr/bin/time -v timeout 220 /tmp/bench --model synthetic:gemma3-4b --backend cuda \
  --dtype bf16 --prompt-len 131071 --gen 1 --reps 1 >> $OUT/long128k.txt 2>&1; echo "rc $?" >> $OUT/long128k.txt
grep -E "prefill pp|tuning|first token|peak device|Maximum resident|Elapsed|rc " $OUT/long128k.txt
export BURN_GEMMA_TEST_SEED=20261129
timeout 200 /tmp/kernel_tests --test-threads 1 gemm:: flash_attention mma_matches > $OUT/tests.txt 2>&1
echo "kernel tests rc $?" >> $OUT/tests.txt
grep -E "^test |rc |test result|panicked" $OUT/tests.txt
ls -la /tmp/gguf /tmp/lcpp/build/bin/llama-bench 2>&1 | tail -4; cat $OUT/prep/done.txt 2>/dev/null
