#!/bin/bash
# GPU call 1 (carries .gpu-bench): Gemma 4 31B Q4_K_M written
# directly (gen_gguf4.py q4_k_m, llama-quantize's types) beside the llama.cpp build; on the idle
# GPU meanwhile, the untimed 128K-token prompt on the 12B shape, so its GEMM classes are tuned
# (cached in /tmp/cache128k) before call 3 times it.
set -u
cd "$(dirname "$0")/../../.."

for b in bench; do gzip -dc .gpu-bench/$b.gz > /tmp/burn-gemma-${b//_/-}; chmod +x /tmp/burn-gemma-${b//_/-}; done
LT=$(find /usr/local /usr/lib -name 'libcublasLt.so*' 2>/dev/null | head -1); export LD_LIBRARY_PATH=$(dirname $LT)
mkdir -p /tmp/gguf
mkdir -p /tmp/gpy && tar xzf .gpu-bench/kit/llama.cpp-src.tgz -C /tmp/gpy --wildcards './gguf-py/*'
(PYTHONPATH=/tmp/gpy/gguf-py /usr/bin/time -v python3 scripts/gen_gguf4.py 31b .gpu-bench/kit/gemma3-vocab.json.gz \
  /tmp/gguf/g4-31b-Q4_K_M.gguf q4_k_m > $OUT/gen31b.txt 2>&1; echo "rc $?" >> $OUT/gen31b.txt) &
(bash .gpu-bench/bench-gpu.sh llama > $OUT/build-llama.txt 2>&1; echo "rc $?" >> $OUT/build-llama.txt) &
sleep 20
BURN_GEMMA_CACHE=/tmp/cache128k /usr/bin/time -v timeout 500 /tmp/burn-gemma-bench --model synthetic:gemma3-12b --backend cuda \
  --dtype bf16 --prompt-len 131071 --gen 1 --reps 1 > $OUT/long128k-warm.txt 2>&1; echo "rc $?" >> $OUT/long128k-warm.txt
wait
grep -E "prefill pp|tuning|first token|peak device|Maximum resident|Elapsed|rc " $OUT/long128k-warm.txt
tail -3 $OUT/gen31b.txt; grep -E "Elapsed|Maximum res" $OUT/gen31b.txt; tail -3 $OUT/build-llama.txt
ls -la /tmp/gguf /tmp/lcpp/build/bin/llama-bench; df -h /tmp | tail -1
