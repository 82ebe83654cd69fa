#!/bin/bash
# GPU call 2 (call 1's machine was released, its files gone): llama.cpp rebuilt and the files
# rewritten in the background while ours runs the 12B F16 prompts; then llama-bench and ours
# side by side on 12B Q8_0 and Gemma 4 E2B / E4B Q4_K_M (pp512,4096,16384, -r 3 / medians of 3).
# Everything lands in $OUT/w and comes back as one archive (a call returns at most 8 files).
set -u
cd "$(dirname "$0")/../../../.gpu-bench"
T0=$(date +%s)
mkdir -p $OUT/w; export OUT=$OUT/w
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $OUT/gpu.txt
LT=$(find /usr/local /usr/lib -name 'libcublasLt.so*' 2>/dev/null | head -1)
export LD_LIBRARY_PATH=$(dirname $LT) PYTHONPATH=/tmp/lcpp/gguf-py BURN_GEMMA_CACHE=/tmp/prefill-cache
mkdir -p /tmp/lcpp /tmp/gguf && tar xzf kit/llama.cpp-src.tgz -C /tmp/lcpp
(
  cd /tmp/lcpp && cmake -B build -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DLLAMA_BUILD_TESTS=OFF \
    -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_CURL=OFF -DLLAMA_BUILD_SERVER=OFF > $OUT/llama-build.txt 2>&1 &&
    cmake --build build -j14 --target llama-bench llama-quantize >> $OUT/llama-build.txt 2>&1
  echo "llama.cpp built at $(( $(date +%s) - T0 )) s" >> $OUT/prepare.txt
) &
python3 kit/gen_gguf.py 12b kit/gemma3-vocab.json.gz /tmp/gguf/12b-F16.gguf >> $OUT/gen.txt 2>&1
echo "12b F16 written at $(( $(date +%s) - T0 )) s" >> $OUT/prepare.txt
(
  for m in e2b e4b; do
    python3 gen_gguf4.py $m kit/gemma3-vocab.json.gz /tmp/gguf/g4-$m-Q8_0.gguf >> $OUT/gen.txt 2>&1
  done
  echo "g4 Q8_0 written at $(( $(date +%s) - T0 )) s" >> $OUT/prepare.txt
  while [ ! -x /tmp/lcpp/build/bin/llama-quantize ] && [ $(( $(date +%s) - T0 )) -lt 450 ]; do sleep 2; done
  sleep 3
  /tmp/lcpp/build/bin/llama-quantize /tmp/gguf/12b-F16.gguf /tmp/gguf/12b-Q8_0.gguf Q8_0 16 > /dev/null 2>&1
  echo "12b-Q8_0 ready at $(( $(date +%s) - T0 )) s" >> $OUT/prepare.txt
  for m in e2b e4b; do
    /tmp/lcpp/build/bin/llama-quantize --allow-requantize /tmp/gguf/g4-$m-Q8_0.gguf /tmp/gguf/g4-$m-Q4_K_M.gguf Q4_K_M 16 > /dev/null 2>&1
    echo "g4-$m-Q4_K_M ready at $(( $(date +%s) - T0 )) s" >> $OUT/prepare.txt
  done
) &
PREP=$!
gzip -dc bench.gz > /tmp/burn-gemma-bench; chmod +x /tmp/burn-gemma-bench
echo "ours 12b-F16 at $(( $(date +%s) - T0 )) s" >> $OUT/prepare.txt
timeout 200 /tmp/burn-gemma-bench --model /tmp/gguf/12b-F16.gguf --backend cuda --dtype bf16 --prompt-len 512,4096,16384 \
  --gen 1 --reps 3 >> $OUT/prefill-ours.txt 2>&1
echo "ours 12b-F16 done at $(( $(date +%s) - T0 )) s" >> $OUT/prepare.txt
while [ ! -x /tmp/lcpp/build/bin/llama-bench ] && [ $(( $(date +%s) - T0 )) -lt 450 ]; do sleep 2; done
sleep 2
L=/tmp/lcpp/build/bin/llama-bench
export LD_LIBRARY_PATH=/tmp/lcpp/build/bin:$LD_LIBRARY_PATH
timeout 60 $L -m /tmp/gguf/12b-F16.gguf -p 512,4096,16384 -n 0 -fa 1 -ngl 99 -r 3 -o jsonl >> $OUT/prefill-llama.jsonl 2>> $OUT/log.txt
for stem in 12b-Q8_0 g4-e2b-Q4_K_M g4-e4b-Q4_K_M; do
  f=/tmp/gguf/$stem.gguf
  while ! grep -q "$stem ready" $OUT/prepare.txt 2>/dev/null && [ $(( $(date +%s) - T0 )) -lt 520 ]; do sleep 2; done
  left=$(( 575 - ($(date +%s) - T0) )); [ $left -gt 20 ] || break
  timeout 40 $L -m $f -p 512,4096,16384 -n 0 -fa 1 -ngl 99 -r 3 -o jsonl >> $OUT/prefill-llama.jsonl 2>> $OUT/log.txt
  left=$(( 580 - ($(date +%s) - T0) )); [ $left -gt 20 ] || break
  echo "ours $stem at $(( $(date +%s) - T0 )) s" >> $OUT/prepare.txt
  [ $left -gt 110 ] && left=110
  timeout $left /tmp/burn-gemma-bench --model $f --backend cuda --dtype bf16 --prompt-len 512,4096,16384 --gen 1 --reps 3 \
    >> $OUT/prefill-ours.txt 2>&1
done
cat $OUT/prepare.txt; ls -la /tmp/gguf > $OUT/files.txt
grep -E "^model|prefill pp|first token|JSON" $OUT/prefill-ours.txt | cut -c1-200
python3 -c '
import json,sys
for l in open(sys.argv[1]):
  r=json.loads(l); print(r["model_filename"], r["n_prompt"], round(r["avg_ts"],1))' $OUT/prefill-llama.jsonl
cd $OUT/.. && tar czf results.tgz w && rm -rf w
