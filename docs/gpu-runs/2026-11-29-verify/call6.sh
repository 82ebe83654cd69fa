#!/bin/bash
# GPU call 6 (issue 35): the tests again after the verify rows' attention split as a one-row
# step's and the draft model's catch-up on recorded rows, and the sampled-decoding
# distribution test on CUDA (the verify step's and draft steps' logits read back from graphs).
set -u
cd "$(dirname "$0")/../../.."
B=.gpu-bench
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $OUT/env.txt
gzip -dc $B/kernel_tests.gz > /tmp/kernel_tests; chmod +x /tmp/kernel_tests
gzip -dc $B/integration.gz > /tmp/integration; chmod +x /tmp/integration
export BURN_GEMMA_FIXTURES=$PWD/tests/fixtures
timeout 100 /tmp/kernel_tests --test-threads 1 consecutive decode_per_sequence decode_at_position > $OUT/kernel-tests.txt 2>&1; echo "rc $?" >> $OUT/kernel-tests.txt
grep -E "^test |test result|rc " $OUT/kernel-tests.txt
for spec in cuda_graph::verify_steps_graph_equals_eager:120 speculative::random_1b_drafts_keep_greedy_output_on_cuda:100 speculative::sampled_output_keeps_the_model_distribution_on_cuda:200; do
  t=${spec%:*}; limit=${spec##*:}; name=${t//::/-}
  timeout $limit /tmp/integration --test-threads 1 --nocapture --exact $t > $OUT/$name.txt 2>&1; echo "rc $?" >> $OUT/$name.txt
  grep -E "^test |test result|equal|random 1B with|chi-square|fresh seed|panicked|rc " $OUT/$name.txt | cut -c1-300
done
