#!/bin/bash
# GPU call 8 (issue 35): after the review mend (the draft model's recorded steps through one helper,
# the verify ids padded without indexing), the same tests as call 7 plus the recorded verify
# step against the eager one: drafts keeping greedy output on a random 1B (prompt lookup fixed and
# adaptive, the model drafting for itself) and the sampled-decoding distribution test on CUDA.
set -u
cd "$(dirname "$0")/../../.."
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $OUT/env.txt
gzip -dc .gpu-bench/integration.gz > /tmp/integration; chmod +x /tmp/integration
export BURN_GEMMA_FIXTURES=$PWD/tests/fixtures
for spec in cuda_graph::verify_steps_graph_equals_eager:120 speculative::random_1b_drafts_keep_greedy_output_on_cuda:120 speculative::sampled_output_keeps_the_model_distribution_on_cuda:120; do
  t=${spec%:*}; limit=${spec##*:}; name=${t//::/-}
  timeout $limit /tmp/integration --test-threads 1 --nocapture --exact $t > $OUT/$name.txt 2>&1; echo "rc $?" >> $OUT/$name.txt
  grep -E "^test |test result|random 1B with|chi-square|equal|panicked|rc " $OUT/$name.txt | cut -c1-300
done
