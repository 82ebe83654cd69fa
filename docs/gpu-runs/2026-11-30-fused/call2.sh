#!/bin/bash
# Call 2 (issue 34, commit fd2b19a): the kernel tests on CUDA with a fresh seed (the fused
# add + norm + GEMV, the quantized GEMV after the block_product mend, the routed-expert GEMV),
# then the integration tests through CUDA: tiny models and the quantized kernels against their
# references, a random 1B against the CPU, CUDA-graph decode against eager decode.
set -u
cd "$(dirname "$0")"
R=$(cd .. && pwd)
for b in kernel_tests integration; do gzip -dc $b.gz > /tmp/$b; chmod +x /tmp/$b; done
LT=$(find /usr/local /usr/lib -name 'libcublasLt.so*' 2>/dev/null | head -1); export LD_LIBRARY_PATH=$(dirname $LT)
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $OUT/env.txt
SEED=${SEED:-$(date +%s)}
BURN_GEMMA_TEST_SEED=$SEED timeout 200 /tmp/kernel_tests --test-threads 2 normed_gemv::gpu quant::check::gpu experts::gemv > $OUT/kernel-tests.txt 2>&1; echo "rc $?" >> $OUT/kernel-tests.txt
grep -E "^test |rc |test result|panicked" $OUT/kernel-tests.txt | head -20
export BURN_GEMMA_FIXTURES=$R/tests/fixtures BURN_GEMMA_TEST_SEED=20261130
for spec in tiny_models::quantized_kernels_match_their_reference_on_cuda:90 tiny_models::tiny_models_match_reference_on_cuda:60 \
  tiny_models::gemma4_decode_path_matches_reference_on_cuda:60 tiny_models::random_gemma3_1b_matches_cpu_on_cuda:90 \
  cuda_graph::tiny_models_graph_equals_eager:60 cuda_graph::random_1b_graph_equals_eager:80 cuda_graph::gemma4_graph_equals_eager:60 \
  cuda_graph::verify_steps_graph_equals_eager:120; do
  t=${spec%:*}; limit=${spec##*:}; name=${t//::/-}
  timeout $limit /tmp/integration --test-threads 1 --nocapture --exact $t > $OUT/$name.txt 2>&1; echo "rc $? at $(date +%T)" >> $OUT/$name.txt
  grep -E "^test |test result|panicked|rc " $OUT/$name.txt | cut -c1-300
done
date +%T
