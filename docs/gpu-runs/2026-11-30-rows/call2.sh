#!/bin/bash
# Call B (right after call A, same warm machine; commit d6c4e88): the integration tests through
# CUDA with the committed kernels (tiny models and the quantized kernels against their references,
# a random 1B against the CPU, CUDA-graph decode against eager decode), then decode beside
# llama.cpp on the 1B and 4B Q4_K_M files written in call A (llama-bench tg128, F16 and q8_0 KV;
# ours bf16 and int8 KV; depths 512 and 8192; medians of 3).
set -u
cd "$(dirname "$0")"
R=$(cd .. && pwd)
gzip -dc integration.gz > /tmp/integration; chmod +x /tmp/integration
LT=$(find /usr/local /usr/lib -name 'libcublasLt.so*' 2>/dev/null | head -1); export LD_LIBRARY_PATH=$(dirname $LT)
export BURN_GEMMA_FIXTURES=$R/tests/fixtures BURN_GEMMA_TEST_SEED=20261130
for spec in tiny_models::tiny_models_match_reference_on_cuda:60 tiny_models::quantized_kernels_match_their_reference_on_cuda:90 \
  tiny_models::gemma4_decode_path_matches_reference_on_cuda:60 tiny_models::random_gemma3_1b_matches_cpu_on_cuda:90 \
  cuda_graph::tiny_models_graph_equals_eager:60 cuda_graph::random_1b_graph_equals_eager:80 cuda_graph::gemma4_graph_equals_eager:60 \
  cuda_graph::verify_steps_graph_equals_eager:120; do
  t=${spec%:*}; limit=${spec##*:}; name=${t//::/-}
  timeout $limit /tmp/integration --test-threads 1 --nocapture --exact $t > $OUT/$name.txt 2>&1; echo "rc $? at $(date +%T)" >> $OUT/$name.txt
  grep -E "^test |test result|panicked|rc " $OUT/$name.txt | cut -c1-300
done
QSTEMS=${QSTEMS:-"1b-Q4_K_M 4b-Q4_K_M"} REPS=3 QDEPTHS="512 8192" timeout ${Q_LIMIT:-250} bash bench-gpu.sh quant > /dev/null 2>&1
tail -12 $OUT/quant.md 2>/dev/null; tail -3 $OUT/log.txt; date +%T
