#!/bin/bash
# GPU call 1: llama.cpp built and the GGUF files written in the background (Gemma 3 12B F16 and
# Q8_0; Gemma 4 E2B and E4B Q8_0 requantized to Q4_K_M), while the host's time in an eager step
# is profiled (random 1B q4, bf16: `--cuda-graph off`, 64 decode tokens after a 512-token
# prompt); then prompt rows side by side with llama.cpp (pp512,4096,16384) on the 12B files.
set -u
cd "$(dirname "$0")/../../../.gpu-bench"
export OUT
T0=$(date +%s)
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/gpu.txt
df -h /tmp | tail -1 | tee -a $OUT/gpu.txt
LT=$(find /usr/local /usr/lib -name 'libcublasLt.so*' 2>/dev/null | head -1)
export LD_LIBRARY_PATH=$(dirname $LT) PYTHONPATH=/tmp/lcpp/gguf-py BURN_GEMMA_CACHE=/tmp/prefill-cache
mkdir -p /tmp/lcpp /tmp/gguf && tar xzf kit/llama.cpp-src.tgz -C /tmp/lcpp
(
  cd /tmp/lcpp && cmake -B build -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DLLAMA_BUILD_TESTS=OFF \
    -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_CURL=OFF -DLLAMA_BUILD_SERVER=OFF > $OUT/llama-build.txt 2>&1 &&
    cmake --build build -j16 --target llama-bench llama-quantize >> $OUT/llama-build.txt 2>&1
  echo "llama.cpp built at $(( $(date +%s) - T0 )) s" >> $OUT/prepare.txt
) &
BUILD=$!
(
  python3 kit/gen_gguf.py 12b kit/gemma3-vocab.json.gz /tmp/gguf/12b-F16.gguf >> $OUT/gen.txt 2>&1
  echo "12b F16 written at $(( $(date +%s) - T0 )) s" >> $OUT/prepare.txt
  for m in e2b e4b; do
    python3 gen_gguf4.py $m kit/gemma3-vocab.json.gz /tmp/gguf/g4-$m-Q8_0.gguf >> $OUT/gen.txt 2>&1
    echo "g4 $m Q8_0 written at $(( $(date +%s) - T0 )) s" >> $OUT/prepare.txt
  done
  while [ ! -x /tmp/lcpp/build/bin/llama-quantize ] && [ $(( $(date +%s) - T0 )) -lt 500 ]; do sleep 2; done
  sleep 3
  /tmp/lcpp/build/bin/llama-quantize /tmp/gguf/12b-F16.gguf /tmp/gguf/12b-Q8_0.gguf Q8_0 16 > /dev/null 2>&1
  echo "12b Q8_0 at $(( $(date +%s) - T0 )) s" >> $OUT/prepare.txt
  for m in e2b e4b; do
    /tmp/lcpp/build/bin/llama-quantize --allow-requantize /tmp/gguf/g4-$m-Q8_0.gguf /tmp/gguf/g4-$m-Q4_K_M.gguf Q4_K_M 16 > /dev/null 2>&1
    echo "g4 $m Q4_K_M at $(( $(date +%s) - T0 )) s" >> $OUT/prepare.txt
  done
) &
PREP=$!
gzip -dc bench.gz > /tmp/burn-gemma-bench; chmod +x /tmp/burn-gemma-bench
# The host's share of an eager step: decode without the graph, profiled.
timeout 200 /tmp/burn-gemma-bench --model synthetic:gemma3-1b --weights q4 --backend cuda --dtype bf16 --prompt-len 512 \
  --gen 64 --reps 2 --cuda-graph off --host-profile $OUT/eager-1b.folded > $OUT/eager-1b.txt 2>&1
echo "eager rc $? at $(( $(date +%s) - T0 )) s" >> $OUT/eager-1b.txt
python3 host_profile.py $OUT/eager-1b.folded --top 45 > $OUT/eager-1b-profile.txt 2>&1
grep -E "prefill|decode|first token|rc " $OUT/eager-1b.txt | head
head -80 $OUT/eager-1b-profile.txt
while kill -0 $PREP 2>/dev/null && [ $(( $(date +%s) - T0 )) -lt 520 ]; do sleep 3; done
cat $OUT/prepare.txt; ls -la /tmp/gguf
[ -s /tmp/gguf/12b-Q8_0.gguf ] && rm -f /tmp/gguf/12b-F16.gguf.keep
# Whatever time is left: the 12B F16 rows.
REPS=3 PLENS=512,4096,16384 PSTEMS="12b-F16" timeout $(( 590 - ($(date +%s) - T0) )) bash bench-gpu.sh prefill > $OUT/prefill-run.txt 2>&1
tail -12 $OUT/prefill-run.txt
