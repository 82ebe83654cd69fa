#!/bin/bash
# GPU call 2 (issue 37), nvidia-h200-x2: Gemma 4 31B bf16 split over 2 GPUs (tp_bench, eager
# steps; call 1 ran out of time after its 1-GPU figure), then the 1-GPU bench of 27B and 31B
# bf16 with decode replayed as a CUDA graph (what one GPU does today), same lengths.
set -u
cd "$(dirname "$0")/../../.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader > $OUT/env.txt
gzip -dc .gpu-bench/tp_bench.gz > /tmp/tp_bench; chmod +x /tmp/tp_bench
gzip -dc .gpu-bench/bench.gz > /tmp/bench; chmod +x /tmp/bench
LT=$(find /usr/local /usr/lib -name 'libcublasLt.so*' 2>/dev/null | head -1)
NC=$(python3 -c "import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], 'lib'))" 2>/dev/null)
mkdir -p /tmp/ncclib; ln -sf $(ls $NC/libnccl.so* | head -1) /tmp/ncclib/libnccl.so
export LD_LIBRARY_PATH=$(dirname $LT):/tmp/ncclib:$NC
run() { # name, limit, program, args...
  local name=$1 limit=$2 program=$3; shift 3
  echo "== $name: $program $*" >> $OUT/log.txt
  timeout $limit $program --backend cuda --dtype bf16 --weights bf16 "$@" > $OUT/$name.txt 2>> $OUT/$name.err; echo "rc $?" >> $OUT/$name.txt
  grep -vE "^\s*$" $OUT/$name.txt | tail -6 | cut -c1-330; tail -2 $OUT/$name.err | cut -c1-300
}
run 31b-tp2 260 /tmp/tp_bench --model synthetic:gemma4-31b --tensor-parallel 2 --prompt-len 512 --gen 64 --reps 2
run 27b-graph 150 /tmp/bench --model synthetic:gemma3-27b --prompt-len 512 --gen 64 --reps 2
run 31b-graph 150 /tmp/bench --model synthetic:gemma4-31b --prompt-len 512 --gen 64 --reps 2
