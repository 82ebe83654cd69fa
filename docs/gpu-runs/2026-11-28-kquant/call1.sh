#!/bin/bash
# GPU call 1: the k-quant kernel tests on CUDA (f32, bf16; fixed and fresh seeds) while llama.cpp
# builds and the Q4_K_M files of Gemma 3 1B, 4B and 12B shapes (random weights) are written:
# gen_gguf.py's F16 file, then llama-quantize.
set -u
cd "$(dirname "$0")/../../../.gpu-bench"
export OUT
T0=$(date +%s)
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/gpu.txt
LT=$(find /usr/local /usr/lib -name 'libcublasLt.so*' 2>/dev/null | head -1)
mkdir -p /tmp/lcpp /tmp/gguf && tar xzf kit/llama.cpp-src.tgz -C /tmp/lcpp
export PYTHONPATH=/tmp/lcpp/gguf-py
(
  cd /tmp/lcpp && cmake -B build -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DLLAMA_BUILD_TESTS=OFF \
    -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_CURL=OFF -DLLAMA_BUILD_SERVER=OFF > $OUT/llama-build.txt 2>&1 &&
    cmake --build build -j16 --target llama-bench llama-quantize >> $OUT/llama-build.txt 2>&1
  echo "llama.cpp built at $(( $(date +%s) - T0 )) s" >> $OUT/prepare.txt
) &
BUILD=$!
(
  for m in 12b 4b 1b; do
    python3 kit/gen_gguf.py $m kit/gemma3-vocab.json.gz /tmp/gguf/$m-F16.gguf >> $OUT/gen.txt 2>&1
    echo "$m F16 written at $(( $(date +%s) - T0 )) s" >> $OUT/prepare.txt
  done
  wait $BUILD 2>/dev/null
  while [ ! -x /tmp/lcpp/build/bin/llama-quantize ] && [ $(( $(date +%s) - T0 )) -lt 560 ]; do sleep 2; done
  for m in 1b 4b 12b; do
    /tmp/lcpp/build/bin/llama-quantize /tmp/gguf/$m-F16.gguf /tmp/gguf/$m-Q4_K_M.tmp Q4_K_M 16 > /dev/null 2>&1 &&
      mv /tmp/gguf/$m-Q4_K_M.tmp /tmp/gguf/$m-Q4_K_M.gguf && rm -f /tmp/gguf/$m-F16.gguf
    echo "$m Q4_K_M at $(( $(date +%s) - T0 )) s" >> $OUT/prepare.txt
  done
) &
PREP=$!
gzip -dc kernel_tests.gz > /tmp/kernel_tests; chmod +x /tmp/kernel_tests
export LD_LIBRARY_PATH=$(dirname $LT)
BURN_GEMMA_TEST_SEED=20261128 timeout 300 /tmp/kernel_tests --test-threads 2 kquant quant::check gelu \
  > $OUT/tests.txt 2>&1; echo "tests rc $? at $(( $(date +%s) - T0 )) s" >> $OUT/tests.txt
timeout 120 /tmp/kernel_tests --test-threads 2 kquant > $OUT/tests-fresh.txt 2>&1
echo "fresh rc $? at $(( $(date +%s) - T0 )) s" >> $OUT/tests-fresh.txt
grep -E "^test |rc |result|panicked|seed" $OUT/tests.txt $OUT/tests-fresh.txt | tail -30
while kill -0 $PREP 2>/dev/null && [ $(( $(date +%s) - T0 )) -lt 575 ]; do sleep 3; done
cat $OUT/prepare.txt; ls -la /tmp/gguf; tail -3 $OUT/llama-build.txt
