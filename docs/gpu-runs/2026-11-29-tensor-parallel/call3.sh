#!/bin/bash
# GPU call 3 (issue 37), nvidia-h200-x2: Gemma 4 31B bf16 split over 2 GPUs again, after the
# GEMM tuner stopped holding its lock while it times (call 2's run hung there: shard 0 timed a
# shape new at the first full-attention layer while its GPU waited in an all-reduce for shard 1,
# which waited for the lock); the split first, then one GPU, compared with it.
set -u
cd "$(dirname "$0")/../../.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader > $OUT/env.txt
gzip -dc .gpu-bench/tp_bench.gz > /tmp/tp_bench; chmod +x /tmp/tp_bench
LT=$(find /usr/local /usr/lib -name 'libcublasLt.so*' 2>/dev/null | head -1)
NC=$(python3 -c "import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], 'lib'))" 2>/dev/null)
mkdir -p /tmp/ncclib; ln -sf $(ls $NC/libnccl.so* | head -1) /tmp/ncclib/libnccl.so
export LD_LIBRARY_PATH=$(dirname $LT):/tmp/ncclib:$NC
run() { # name, limit, args...
  local name=$1 limit=$2; shift 2
  echo "== $name: $*" >> $OUT/log.txt
  timeout $limit /tmp/tp_bench --backend cuda --dtype bf16 --weights bf16 "$@" > $OUT/$name.txt 2>> $OUT/$name.err; echo "rc $?" >> $OUT/$name.txt
  cat $OUT/$name.txt | cut -c1-330; tail -2 $OUT/$name.err | cut -c1-300
}
run 31b-tp2 330 --model synthetic:gemma4-31b --tensor-parallel 2,1 --prompt-len 512 --gen 64 --reps 2
