#!/bin/bash
# GPU call 2 (issue 37), nvidia-h200-x2: as call 1, after call 1's capture failed on NCCL's first
# call (each kind of collective now runs once before the capture, which is relaxed) and its
# one-GPU decode recorded its graph inside every timed rep (caches now emptied in place). Decode replayed as one CUDA graph per GPU with the
# shards' NCCL all-reduces and the vocabulary all-gather captured into it. First the two-GPU
# tests (graph tokens against eager split and one GPU; the eager split's logits), then tp_bench
# on Gemma 4 31B and Gemma 3 27B bf16 (random weights): two GPUs, then one, both replaying graphs.
set -u
cd "$(dirname "$0")/../../.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader > $OUT/env.txt
for b in integration tp_bench; do gzip -dc .gpu-bench/$b.gz > /tmp/$b; chmod +x /tmp/$b; done
LT=$(find /usr/local /usr/lib -name 'libcublasLt.so*' 2>/dev/null | head -1)
NC=$(python3 -c "import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], 'lib'))" 2>/dev/null)
mkdir -p /tmp/ncclib; ln -sf $(ls $NC/libnccl.so* | head -1) /tmp/ncclib/libnccl.so
export LD_LIBRARY_PATH=$(dirname $LT):/tmp/ncclib:$NC
export BURN_GEMMA_FIXTURES=$PWD/tests/fixtures
for t in graph_decode_split_over_two_gpus_picks_the_eager_tokens layouts_in_miniature_split_over_two_gpus; do
  timeout 150 /tmp/integration --ignored --test-threads 1 --nocapture --exact tensor_parallel::$t > $OUT/$t.txt 2>&1; echo "rc $?" >> $OUT/$t.txt
  grep -E "^test |test result|GPU|f32|bf16|panicked|rc |Error|error" $OUT/$t.txt | cut -c1-600
  # No benchmark while the graph test fails.
  grep -q "^rc 0" $OUT/$t.txt || exit 1
done
run() { # name, limit, args...
  local name=$1 limit=$2; shift 2
  echo "== $name: $*" >> $OUT/log.txt
  timeout $limit /tmp/tp_bench --backend cuda --dtype bf16 --weights bf16 "$@" > $OUT/$name.txt 2>> $OUT/$name.err; echo "rc $?" >> $OUT/$name.txt
  cat $OUT/$name.txt | cut -c1-400; grep -vE "^\s*$" $OUT/$name.err | tail -3 | cut -c1-300
}
run 31b 220 --model synthetic:gemma4-31b --tensor-parallel 2,1 --prompt-len 512 --gen 64 --reps 2
run 27b 200 --model synthetic:gemma3-27b --tensor-parallel 2,1 --prompt-len 512 --gen 64 --reps 2
