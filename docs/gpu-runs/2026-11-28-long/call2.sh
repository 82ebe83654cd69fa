#!/bin/bash
# GPU call 2 (issue 33), right after call 1 on the same warm machine (llama.cpp and
# /tmp/gguf/12b-Q4_K_M.gguf from call 1): the 12B Q4_K_M file side by side at 512, 4,096, 16,384
# and 32,768 prompt tokens (llama-bench -fa 1 -r 3; ours medians of 3 after a warm-up), then the
# 128K context on the 12B (a 131,071-token prompt, one timed pass after a warm-up pass; llama.cpp
# pp131072 beside it).
set -u
cd "$(dirname "$0")/../../../.gpu-bench"
export OUT
ls -la /tmp/gguf /tmp/lcpp/build/bin/llama-bench | tee $OUT/files.txt
# Call 1's background job did not reach the 12B (its `prepare` wrote the default files first).
rm -f /tmp/gguf/270m-* /tmp/gguf/4b-F16.gguf
if [ ! -s /tmp/gguf/12b-Q4_K_M.gguf ]; then
  PYTHONPATH=/tmp/lcpp/gguf-py python3 kit/gen_gguf.py 12b kit/gemma3-vocab.json.gz /tmp/gguf/12b-F16.tmp > $OUT/gen12b.txt 2>&1 &&
    LD_LIBRARY_PATH=/tmp/lcpp/build/bin /tmp/lcpp/build/bin/llama-quantize /tmp/gguf/12b-F16.tmp /tmp/gguf/12b-Q4_K_M.tmp Q4_K_M 16 > /dev/null 2>&1 &&
    mv /tmp/gguf/12b-Q4_K_M.tmp /tmp/gguf/12b-Q4_K_M.gguf
  rm -f /tmp/gguf/12b-F16.tmp; echo "12b written at $SECONDS s" | tee -a $OUT/files.txt
fi
export BURN_GEMMA_CACHE=/tmp/prefill-cache
REPS=3 PLENS=512,4096,16384,32768 PSTEMS="12b-Q4_K_M" timeout 270 bash bench-gpu.sh prefill
export LD_LIBRARY_PATH=/tmp/lcpp/build/bin:$LD_LIBRARY_PATH
left=$((575 - SECONDS - 90))
echo "== ours 12b-Q4_K_M pp131071 (limit $left s)" | tee -a $OUT/long.txt
/usr/bin/time -v timeout $left /tmp/burn-gemma-bench --model /tmp/gguf/12b-Q4_K_M.gguf --backend cuda --dtype bf16 \
  --prompt-len 131071 --gen 1 --reps 1 >> $OUT/long.txt 2>&1; echo "rc $?" >> $OUT/long.txt
echo "== llama.cpp 12b-Q4_K_M pp131072" | tee -a $OUT/long.txt
timeout 90 /tmp/lcpp/build/bin/llama-bench -m /tmp/gguf/12b-Q4_K_M.gguf -p 131072 -n 0 -fa 1 -ngl 99 -r 1 -o md >> $OUT/long.txt 2>&1
grep -E "^==|prefill pp|tuning|first token|peak device|Maximum resident|Elapsed|\| gemma|rc " $OUT/long.txt
