#!/bin/bash
# GPU call 4 (issue 37), nvidia-h200-x2, on call 3's warm machine (llama.cpp built in /tmp/lcpp):
# Gemma 4 31B Q8_0 (random weights, gen_gguf4.py 31b) as call 3 did 27B; llama-bench's
# --split-mode row, which failed to load in call 3, run once with its log kept.
set -u
cd "$(dirname "$0")/../../.."
here=$PWD/.gpu-bench
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
log() { echo "[$(date +%T)] $*" | tee -a $OUT/log.txt; }
LCPP=/tmp/lcpp; GGUF=/tmp/gguf
export PYTHONPATH=$LCPP/gguf-py
F=$GGUF/31b-Q8_0.gguf
rm -f $GGUF/g3-27b-Q8_0.gguf
log "writing $F"
python3 $here/gen_gguf4.py 31b $here/kit/gemma3-vocab.json.gz $F q8_0 >> $OUT/log.txt 2>&1
log "written: $(ls -s $F)"
LT=$(find /usr/local /usr/lib -name 'libcublasLt.so*' 2>/dev/null | head -1)
NC=$(python3 -c "import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], 'lib'))" 2>/dev/null)
export LD_LIBRARY_PATH=$(dirname $LT):/tmp/ncclib:$NC
log "ours"
timeout 260 /tmp/tp_bench --backend cuda --dtype bf16 --model $F --tensor-parallel 2,1 --prompt-len 512 --gen 64 --reps 2 > $OUT/ours.txt 2> $OUT/ours.err; echo "rc $?" >> $OUT/ours.txt
cat $OUT/ours.txt | cut -c1-400; grep -vE "^\s*$" $OUT/ours.err | tail -3 | cut -c1-300
export LD_LIBRARY_PATH=$LCPP/build/bin:$LD_LIBRARY_PATH
for sm in none layer; do
  log "llama-bench -sm $sm"
  timeout 120 $LCPP/build/bin/llama-bench -m $F -p 512 -n 64 -fa 1 -ngl 99 -r 2 -sm $sm -mg 0 -o md >> $OUT/llama.md 2>> $OUT/llama.err
done
cat $OUT/llama.md
log "llama-bench -sm row -v"
timeout 60 $LCPP/build/bin/llama-bench -m $F -p 512 -n 64 -fa 1 -ngl 99 -r 1 -sm row -v > $OUT/row.txt 2>&1
grep -iE "error|fail|split|not supported|row" $OUT/row.txt | head -12 | cut -c1-300
log "done"
