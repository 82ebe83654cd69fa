#!/bin/bash
# GPU call 1 (issue 37, tensor parallelism), nvidia-h200-x2: tp_bench (NCCL all-reduce through
# CubeCL, one thread per GPU, eager steps) on random-weight Gemma 3 1B, 27B and Gemma 4 31B in
# bf16: 1 GPU then 2 GPUs, prefill of 512 tokens and 64 greedy decode tokens, medians of 2 after
# a warm-up; each split's prompt logits and greedy tokens against the 1-GPU model's.
set -u
cd "$(dirname "$0")/../../.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader > $OUT/env.txt
nvidia-smi topo -m >> $OUT/env.txt 2>&1
gzip -dc .gpu-bench/tp_bench.gz > /tmp/tp_bench; chmod +x /tmp/tp_bench
LT=$(find /usr/local /usr/lib -name 'libcublasLt.so*' 2>/dev/null | head -1)
NC=$(python3 -c "import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], 'lib'))" 2>/dev/null)
mkdir -p /tmp/ncclib; ln -sf $(ls $NC/libnccl.so* | head -1) /tmp/ncclib/libnccl.so
export LD_LIBRARY_PATH=$(dirname $LT):/tmp/ncclib:$NC
echo "nccl: $NC $(ls $NC)" >> $OUT/env.txt
cat $OUT/env.txt | head -3
run() { # name, limit, args...
  local name=$1 limit=$2; shift 2
  echo "== $name: $*" >> $OUT/log.txt
  timeout $limit /tmp/tp_bench --backend cuda --dtype bf16 --weights bf16 "$@" > $OUT/$name.txt 2>> $OUT/$name.err; echo "rc $?" >> $OUT/$name.txt
  cat $OUT/$name.txt | cut -c1-330; tail -3 $OUT/$name.err | cut -c1-300
}
run 1b 90 --model synthetic:gemma3-1b --tensor-parallel 1,2 --prompt-len 512 --gen 64 --reps 2
run 27b 240 --model synthetic:gemma3-27b --tensor-parallel 1,2 --prompt-len 512 --gen 64 --reps 2
run 31b 240 --model synthetic:gemma4-31b --tensor-parallel 1,2 --prompt-len 512 --gen 64 --reps 2
