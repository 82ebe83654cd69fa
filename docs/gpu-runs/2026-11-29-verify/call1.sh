#!/bin/bash
# GPU call 1 (issue 35): the recorded verify step's tests on CUDA. Kernel tests of the
# consecutive rows (decode attention, qkv append) and their neighbours, then the integration
# tests: the recorded verify step against the eager one, drafts keeping greedy output on a
# random 1B (now verified on recorded graphs), and plain CUDA-graph decode as before.
set -u
cd "$(dirname "$0")/../../.."
B=.gpu-bench
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $OUT/env.txt
gzip -dc $B/kernel_tests.gz > /tmp/kernel_tests; chmod +x /tmp/kernel_tests
gzip -dc $B/integration.gz > /tmp/integration; chmod +x /tmp/integration
export BURN_GEMMA_FIXTURES=$PWD/tests/fixtures
timeout 140 /tmp/kernel_tests --test-threads 1 consecutive qkv_rope_append decode_per_sequence decode_at_position > $OUT/kernel-tests.txt 2>&1; echo "rc $?" >> $OUT/kernel-tests.txt
grep -E "^test |test result|rc " $OUT/kernel-tests.txt
for spec in cuda_graph::verify_steps_graph_equals_eager:150 speculative::random_1b_drafts_keep_greedy_output_on_cuda:150 cuda_graph::tiny_models_graph_equals_eager:60 cuda_graph::random_1b_graph_equals_eager:80; do
  t=${spec%:*}; limit=${spec##*:}; name=${t//::/-}
  timeout $limit /tmp/integration --test-threads 1 --nocapture --exact $t > $OUT/$name.txt 2>&1; echo "rc $?" >> $OUT/$name.txt
  grep -E "^test |test result|equal|random 1B with|panicked|rc " $OUT/$name.txt | cut -c1-300
done
