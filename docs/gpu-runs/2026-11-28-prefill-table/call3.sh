#!/bin/bash
# GPU call 3: the 12B Q4_K_M file (call 1 lacked gguf-py on the path), then long prompts: pp32768 side by side (4B Q8_0, 12B Q4_K_M;
# 2 reps after a warm-up), then the 128K context of the Gemma 3 4B+ configs: a 131,071-token
# prompt on each (one timed pass after a warm-up pass; ours chunked by 2,048 as `generate`
# does; peak device memory reported), llama.cpp's pp131072 beside it.
set -u
cd "$(dirname "$0")/../../../.gpu-bench"
export OUT
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/gpu.txt
export PYTHONPATH=/tmp/lcpp/gguf-py LD_LIBRARY_PATH=/tmp/lcpp/build/bin
if [ ! -s /tmp/gguf/12b-Q4_K_M.gguf ]; then
  python3 kit/gen_gguf.py 12b kit/gemma3-vocab.json.gz /tmp/gguf/12b-F16.tmp > $OUT/gen12b.txt 2>&1 &&
    /tmp/lcpp/build/bin/llama-quantize /tmp/gguf/12b-F16.tmp /tmp/gguf/12b-Q4_K_M.tmp Q4_K_M 16 > /dev/null 2>&1 &&
    mv /tmp/gguf/12b-Q4_K_M.tmp /tmp/gguf/12b-Q4_K_M.gguf
  rm -f /tmp/gguf/12b-F16.tmp; echo "12b written at $SECONDS s" | tee -a $OUT/gpu.txt
fi
REPS=2 PLENS=32768 PSTEMS="4b-Q8_0 12b-Q4_K_M" timeout 300 bash bench-gpu.sh prefill
export LD_LIBRARY_PATH=/tmp/lcpp/build/bin:$LD_LIBRARY_PATH BURN_GEMMA_CACHE=/tmp/prefill-cache
for stem in 4b-Q8_0 12b-Q4_K_M; do
  echo "== ours $stem pp131071" | tee -a $OUT/long.txt
  /usr/bin/time -v timeout 120 /tmp/burn-gemma-bench --model /tmp/gguf/$stem.gguf --backend cuda --dtype bf16 \
    --prompt-len 131071 --gen 1 --reps 1 >> $OUT/long.txt 2>&1
  echo "== llama.cpp $stem pp131072" | tee -a $OUT/long.txt
  timeout 150 /tmp/lcpp/build/bin/llama-bench -m /tmp/gguf/$stem.gguf -p 131072 -n 0 -fa 1 -ngl 99 -r 1 -o md >> $OUT/long.txt 2>&1
done
grep -E "^==|prefill pp|first token|peak device|Maximum resident|\| gemma|t/s" $OUT/long.txt
