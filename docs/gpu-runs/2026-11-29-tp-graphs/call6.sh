#!/bin/bash
# GPU call 6 (issue 37), nvidia-h200-x2: call 5 found GPU 1 busy (an NCCL kernel waiting) and
# GPU 0 idle, both shard threads parked: shard 0 had answered, shard 1 never would. ShardedModel
# now gives a failed shard's error after 5 s instead of waiting for ever; the run again, for it.
set -u
cd "$(dirname "$0")/../../.."
here=$PWD/.gpu-bench
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
log() { echo "[$(date +%T)] $*" | tee -a $OUT/log.txt; }
LCPP=/tmp/lcpp; GGUF=/tmp/gguf; mkdir -p $LCPP $GGUF
[ -d $LCPP/gguf-py ] || tar xzf $here/kit/llama.cpp-src.tgz -C $LCPP
export PYTHONPATH=$LCPP/gguf-py
F=$GGUF/31b-Q8_0.gguf
[ -s $F ] || python3 $here/gen_gguf4.py 31b $here/kit/gemma3-vocab.json.gz $F q8_0 >> $OUT/log.txt 2>&1
log "file: $(ls -s $F)"
gzip -dc $here/tp_bench.gz > /tmp/tp_bench; chmod +x /tmp/tp_bench
LT=$(find /usr/local /usr/lib -name 'libcublasLt.so*' 2>/dev/null | head -1)
NC=$(python3 -c "import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], 'lib'))" 2>/dev/null)
mkdir -p /tmp/ncclib; ln -sf $(ls $NC/libnccl.so* | head -1) /tmp/ncclib/libnccl.so
export LD_LIBRARY_PATH=$(dirname $LT):/tmp/ncclib:$NC
timeout 170 /tmp/tp_bench --backend cuda --dtype bf16 --model $F --tensor-parallel 2 --prompt-len 512 --gen 64 --reps 2 > $OUT/ours.txt 2> $OUT/ours.err; echo "rc $?" >> $OUT/ours.txt
cat $OUT/ours.txt | cut -c1-400; tail -4 $OUT/ours.err | cut -c1-600
