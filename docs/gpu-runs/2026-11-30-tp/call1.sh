#!/bin/bash
# GPU call 1 (issue 37), nvidia-h200-x2: (a) NCCL's all-reduce latency inside a CUDA graph as a
# split 31B token sees it (scripts/nccl_latency.py: 120 bf16 sums of 5,376 values, PyTorch's
# NCCL, one process a GPU) under NCCL's protocol/algorithm/channel settings; (b) the Gemma 4 31B
# Q8_0 file (gen_gguf4.py 31b, written meanwhile) on two GPUs and one with tp_bench: the run that
# hung on 2026-11-29 (calls 4-5), now with the shards meeting before the first NCCL call of a
# capture and a failed shard's error given after 5 s.
set -u
cd "$(dirname "$0")/../../.."
here=$PWD/.gpu-bench
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
log() { echo "[$(date +%T)] $*" | tee -a $OUT/log.txt; }
nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader > $OUT/env.txt
LCPP=/tmp/lcpp; GGUF=/tmp/gguf; mkdir -p $LCPP $GGUF
[ -d $LCPP/gguf-py ] || tar xzf $here/kit/llama.cpp-src.tgz -C $LCPP gguf-py 2>/dev/null || tar xzf $here/kit/llama.cpp-src.tgz -C $LCPP
export PYTHONPATH=$LCPP/gguf-py
F=$GGUF/31b-Q8_0.gguf
( [ -s $F ] || python3 $here/gen_gguf4.py 31b $here/kit/gemma3-vocab.json.gz $F q8_0 > $OUT/gen.txt 2>&1 ) &
writer=$!
for s in "" "NCCL_PROTO=LL" "NCCL_PROTO=LL128" "NCCL_PROTO=Simple" "NCCL_ALGO=Tree" "NCCL_MAX_NCHANNELS=1" "NCCL_MAX_NCHANNELS=2 NCCL_PROTO=LL" "NCCL_GRAPH_MIXING_SUPPORT=0"; do
  env $s timeout 60 python3 scripts/nccl_latency.py --elems 5376 --count 120 --reps 20 >> $OUT/nccl.txt 2>> $OUT/nccl.err || echo "$s failed rc $?" >> $OUT/nccl.txt
done
cat $OUT/nccl.txt; grep -iE "error|warn" $OUT/nccl.err | sort | uniq -c | head -5
wait $writer; log "file: $(ls -s $F)"; tail -2 $OUT/gen.txt
gzip -dc $here/tp_bench.gz > /tmp/tp_bench; chmod +x /tmp/tp_bench
LT=$(find /usr/local /usr/lib -name 'libcublasLt.so*' 2>/dev/null | head -1)
NC=$(python3 -c "import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], 'lib'))" 2>/dev/null)
mkdir -p /tmp/ncclib; ln -sf $(ls $NC/libnccl.so* | head -1) /tmp/ncclib/libnccl.so
export LD_LIBRARY_PATH=$(dirname $LT):/tmp/ncclib:$NC
log "tp_bench 31B Q8_0, 2 GPUs then 1"
timeout 330 /tmp/tp_bench --backend cuda --dtype bf16 --model $F --tensor-parallel 2,1 --prompt-len 512 --gen 64 --reps 2 > $OUT/ours.txt 2> $OUT/ours.err; echo "rc $?" >> $OUT/ours.txt
cat $OUT/ours.txt | cut -c1-400; grep -vE "^\s*$" $OUT/ours.err | tail -4 | cut -c1-600
log "done"
