#!/bin/bash
# GPU call 4 (issue 37), nvidia-h200-x2: call 3's 31B split was 8.2 logits from the one-GPU
# model (27B: 0.08) with every greedy token equal. The two-GPU test of Gemma 3 27B's and Gemma 4
# 31B's layouts in miniature (random weights, f32 and bf16, one GPU against two joined by NCCL).
set -u
cd "$(dirname "$0")/../../.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
gzip -dc .gpu-bench/integration.gz > /tmp/integration; chmod +x /tmp/integration
LT=$(find /usr/local /usr/lib -name 'libcublasLt.so*' 2>/dev/null | head -1)
NC=$(python3 -c "import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], 'lib'))" 2>/dev/null)
mkdir -p /tmp/ncclib; ln -sf $(ls $NC/libnccl.so* | head -1) /tmp/ncclib/libnccl.so
export LD_LIBRARY_PATH=$(dirname $LT):/tmp/ncclib:$NC
export BURN_GEMMA_FIXTURES=$PWD/tests/fixtures
t=tensor_parallel::layouts_in_miniature_split_over_two_gpus
timeout 240 /tmp/integration --ignored --test-threads 1 --nocapture --exact $t > $OUT/two-gpus.txt 2>&1; echo "rc $?" >> $OUT/two-gpus.txt
grep -E "^test |test result|f32|bf16|panicked|rc " $OUT/two-gpus.txt | cut -c1-400
