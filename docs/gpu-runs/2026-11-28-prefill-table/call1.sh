#!/bin/bash
# GPU call 1: llama.cpp built and the GGUF files written in the background (1B and 4B as F16,
# Q8_0, Q4_K_M; Gemma 4 E2B and E4B as Q8_0; 12B as Q4_K_M), while the flash-attention tests
# run after 28e3441's review mend: bf16 over every layout (alone), then f16, the dispatcher's
# attention tests, the blocked path and the cuBLASLt tests.
set -u
cd "$(dirname "$0")/../../../.gpu-bench"
T0=$(date +%s)
gzip -dc kernel_tests.gz > /tmp/kernel_tests; chmod +x /tmp/kernel_tests
LT=$(find /usr/local /usr/lib -name 'libcublasLt.so*' 2>/dev/null | head -1); export LD_LIBRARY_PATH=$(dirname $LT)
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/gpu.txt
df -h /tmp | tail -1 | tee -a $OUT/gpu.txt
(
  export OUT=$OUT/prepare
  MODELS="1b 4b" QUANTS="Q8_0 Q4_K_M" bash bench-gpu.sh prepare
  G4MODELS="e2b e4b" G4QUANTS="Q8_0" bash bench-gpu.sh prepare4
  if [ ! -s /tmp/gguf/12b-Q4_K_M.gguf ]; then
    python3 kit/gen_gguf.py 12b kit/gemma3-vocab.json.gz /tmp/gguf/12b-F16.tmp >> $OUT/log.txt 2>&1 &&
      /tmp/lcpp/build/bin/llama-quantize /tmp/gguf/12b-F16.tmp /tmp/gguf/12b-Q4_K_M.tmp Q4_K_M 16 > /dev/null 2>&1 &&
      mv /tmp/gguf/12b-Q4_K_M.tmp /tmp/gguf/12b-Q4_K_M.gguf
    rm -f /tmp/gguf/12b-F16.tmp
  fi
  echo "prepare done at $(( $(date +%s) - T0 )) s: $(ls -s /tmp/gguf | tr '\n' ' ')" >> $OUT/log.txt
) > $OUT/prepare.txt 2>&1 &
PREP=$!
export BURN_GEMMA_TEST_SEED=20261128
timeout 480 /tmp/kernel_tests --test-threads 1 --exact attention::flash::tests::flash_attention_matches_reference_bf16 \
  > $OUT/flash-bf16.txt 2>&1 &
A=$!
timeout 400 /tmp/kernel_tests --test-threads 2 attention:: cublas --skip flash_attention_matches_reference_bf16 \
  > $OUT/tests.txt 2>&1; echo "tests rc $?" >> $OUT/tests.txt
wait $A; echo "flash bf16 rc $? at $(( $(date +%s) - T0 )) s" >> $OUT/flash-bf16.txt
grep -E "^test |rc |result|panicked" $OUT/flash-bf16.txt $OUT/tests.txt | tail -40
while kill -0 $PREP 2>/dev/null && [ $(( $(date +%s) - T0 )) -lt 570 ]; do sleep 5; done
tail -5 $OUT/prepare/log.txt; ls -la /tmp/gguf
