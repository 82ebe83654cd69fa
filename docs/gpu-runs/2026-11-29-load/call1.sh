#!/bin/bash
# GPU call 1: llama.cpp built in the background; load times of this build (float conversions
# and quantization on every core, see src/floats.rs) on a random Gemma 3 12B F16 GGUF and
# Gemma 4 E2B / E4B Q8_0 files; then the E2B/E4B files requantized to Q4_K_M and their 16,384-token
# prompts beside llama-bench (same call, same files).
# Everything lands in $OUT/w and comes back as one archive.
set -u
cd "$(dirname "$0")/../../../.gpu-bench"
T0=$(date +%s)
el() { echo $(( $(date +%s) - T0 )); }
mkdir -p $OUT/w; R=$OUT; export OUT=$OUT/w
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $OUT/gpu.txt
nproc >> $OUT/gpu.txt; df -h /tmp | tail -1 >> $OUT/gpu.txt; free -g | head -2 >> $OUT/gpu.txt
LT=$(find /usr/local /usr/lib -name 'libcublasLt.so*' 2>/dev/null | head -1)
export LD_LIBRARY_PATH=$(dirname $LT) PYTHONPATH=/tmp/lcpp/gguf-py BURN_GEMMA_CACHE=/tmp/prefill-cache
mkdir -p /tmp/lcpp /tmp/gguf && tar xzf kit/llama.cpp-src.tgz -C /tmp/lcpp
(
  cd /tmp/lcpp && cmake -B build -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DLLAMA_BUILD_TESTS=OFF \
    -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_CURL=OFF -DLLAMA_BUILD_SERVER=OFF > $OUT/llama-build.txt 2>&1 &&
    cmake --build build -j12 --target llama-bench llama-quantize >> $OUT/llama-build.txt 2>&1
  echo "llama.cpp built at $(el) s" >> $OUT/prepare.txt
) &
gzip -dc bench.gz > /tmp/burn-gemma-bench; chmod +x /tmp/burn-gemma-bench
B=/tmp/burn-gemma-bench
python3 kit/gen_gguf.py 12b kit/gemma3-vocab.json.gz /tmp/gguf/12b-F16.gguf >> $OUT/gen.txt 2>&1
echo "12b F16 written at $(el) s" >> $OUT/prepare.txt
# The file read once so the page cache holds it, as it did for the earlier loads.
cat /tmp/gguf/12b-F16.gguf > /dev/null
echo "== 12b-F16 at $(el) s" >> $OUT/load.txt
timeout 200 $B --model /tmp/gguf/12b-F16.gguf --backend cuda --dtype bf16 --prompt-len 512 --gen 16 --reps 1 >> $OUT/load.txt 2>&1
rm -f /tmp/gguf/12b-F16.gguf
for m in e2b e4b; do
  python3 gen_gguf4.py $m kit/gemma3-vocab.json.gz /tmp/gguf/g4-$m-Q8_0.gguf >> $OUT/gen.txt 2>&1
  echo "g4 $m Q8_0 written at $(el) s" >> $OUT/prepare.txt
done
for m in e2b e4b; do
  echo "== g4-$m-Q8_0 at $(el) s" >> $OUT/load.txt
  timeout 120 $B --model /tmp/gguf/g4-$m-Q8_0.gguf --backend cuda --dtype bf16 --prompt-len 512 --gen 16 --reps 1 >> $OUT/load.txt 2>&1
done
while [ ! -x /tmp/lcpp/build/bin/llama-quantize ] && [ $(el) -lt 420 ]; do sleep 2; done
sleep 2
for m in e2b e4b; do
  /tmp/lcpp/build/bin/llama-quantize --allow-requantize /tmp/gguf/g4-$m-Q8_0.gguf /tmp/gguf/g4-$m-Q4_K_M.gguf Q4_K_M 16 > /dev/null 2>&1
  echo "g4 $m Q4_K_M at $(el) s" >> $OUT/prepare.txt
  rm -f /tmp/gguf/g4-$m-Q8_0.gguf
done
for m in e2b e4b; do
  f=/tmp/gguf/g4-$m-Q4_K_M.gguf
  [ $(el) -lt 480 ] || break
  echo "== llama $m pp16384 at $(el) s" >> $OUT/rows.txt
  timeout $(( 585 - $(el) )) /tmp/lcpp/build/bin/llama-bench -m $f -p 16384 -n 0 -fa 1 -ngl 99 -r 3 -o jsonl >> $OUT/rows-llama.jsonl 2>> $OUT/rows.txt
  echo "== ours $m pp16384 at $(el) s" >> $OUT/rows.txt
  timeout $(( 588 - $(el) )) $B --model $f --backend cuda --dtype bf16 --prompt-len 16384 --gen 1 --reps 3 >> $OUT/rows.txt 2>&1
done
echo "end at $(el) s" >> $OUT/prepare.txt; ls -la /tmp/gguf >> $OUT/prepare.txt
cd $R && tar czf w.tgz w && rm -rf w
