#!/bin/bash
# GPU call 1 (issue 35, drafts in the batched engine): the CUDA tests (each sequence's drafted
# positions as rows pointed at its KV blocks, the batched step replayed as a CUDA graph: greedy
# tokens of every request as alone; the engine's other CUDA tests unchanged), then serve_bench on
# random q4 weights of Gemma 3 1B and 4B, bf16, 512-token prompts (a 40-id phrase of each
# request's own repeated, or random ids), 128 tokens each, 1/8/32 requests at once, drafts off
# and prompt lookup (4 tokens), a warm-up run then 3 timed runs, medians.
set -u
cd "$(dirname "$0")/../../.."
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $OUT/env.txt
gzip -dc .gpu-bench/integration.gz > /tmp/integration; chmod +x /tmp/integration
gzip -dc .gpu-bench/serve_bench.gz > /tmp/serve_bench; chmod +x /tmp/serve_bench
LT=$(find /usr/local /usr/lib -name 'libcublasLt.so*' 2>/dev/null | head -1); export LD_LIBRARY_PATH=$(dirname $LT)
export BURN_GEMMA_FIXTURES=$PWD/tests/fixtures
for spec in engine::drafts_in_the_engine_keep_each_requests_greedy_tokens_on_cuda:150 engine::draft_rows_pointed_at_a_sequence_give_its_one_token_steps:60; do
  t=${spec%:*}; limit=${spec##*:}; name=${t//::/-}
  timeout $limit /tmp/integration --test-threads 1 --nocapture --exact $t > $OUT/$name.txt 2>&1; echo "rc $?" >> $OUT/$name.txt
  grep -E "^test |test result|drafts kept|panicked|rc " $OUT/$name.txt | cut -c1-300
done
timeout 150 /tmp/integration --test-threads 1 cuda engine:: > $OUT/engine-cuda.txt 2>&1; echo "rc $?" >> $OUT/engine-cuda.txt
grep -E "^test |test result|rc " $OUT/engine-cuda.txt | cut -c1-200
bench() { # name, limit, args...
  local name=$1 limit=$2; shift 2
  echo "== $name: $*" >> $OUT/log.txt
  timeout $limit /tmp/serve_bench --backend cuda --dtype bf16 --weights q4 --gen 128 --prompt-len 512 --reps 3 "$@" > $OUT/$name.txt 2>> $OUT/log.txt; echo "rc $?" >> $OUT/$name.txt
  grep -E "^streams|rc " $OUT/$name.txt | cut -c1-330
}
for prompt in copy random; do
  for draft in off ngram; do
    bench 1b-$prompt-$draft 70 --model synthetic:gemma3-1b --streams 1,8,32 --prompt $prompt --draft $draft
  done
done
for draft in off ngram; do
  bench 4b-copy-$draft 70 --model synthetic:gemma3-4b --streams 1,8 --prompt copy --draft $draft
done
