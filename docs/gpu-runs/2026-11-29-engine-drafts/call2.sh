#!/bin/bash
# GPU call 2 (issue 35, drafts in the batched engine): after call 1 showed steps of more rows
# than the model's products record (Q4 products record up to 64 rows) turning every later step
# eager, a failed count now only bounds the rows of later recorded steps and drafts are cut to
# stay within it. The engine's CUDA tests (drafts keeping greedy tokens with graphs on; many
# requests against each alone), then serve_bench as in call 1 (random q4 weights, bf16,
# 512-token prompts, 128 tokens, a warm-up then 3 timed runs, medians) on the 1B with 32
# requests (what call 1 could not time), and the 1B with dense bf16 weights (products record up
# to 8 rows: drafts cut for 8 requests).
set -u
cd "$(dirname "$0")/../../.."
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $OUT/env.txt
gzip -dc .gpu-bench/integration.gz > /tmp/integration; chmod +x /tmp/integration
gzip -dc .gpu-bench/serve_bench.gz > /tmp/serve_bench; chmod +x /tmp/serve_bench
LT=$(find /usr/local /usr/lib -name 'libcublasLt.so*' 2>/dev/null | head -1); export LD_LIBRARY_PATH=$(dirname $LT)
export BURN_GEMMA_FIXTURES=$PWD/tests/fixtures
for spec in engine::drafts_in_the_engine_keep_each_requests_greedy_tokens_on_cuda:120 engine::many_requests_at_once_match_each_alone_on_cuda:120; do
  t=${spec%:*}; limit=${spec##*:}; name=${t//::/-}
  timeout $limit /tmp/integration --test-threads 1 --nocapture --exact $t > $OUT/$name.txt 2>&1; echo "rc $?" >> $OUT/$name.txt
  grep -E "^test |test result|drafts kept|panicked|rc " $OUT/$name.txt | cut -c1-300
done
bench() { # name, limit, args...
  local name=$1 limit=$2; shift 2
  echo "== $name: $*" >> $OUT/log.txt
  timeout $limit /tmp/serve_bench --backend cuda --dtype bf16 --gen 128 --prompt-len 512 --reps 3 "$@" > $OUT/$name.txt 2>> $OUT/log.txt; echo "rc $?" >> $OUT/$name.txt
  grep -E "^streams|rc " $OUT/$name.txt | sed -E 's/; [0-9]+ prompt tokens cached so far//' | cut -c1-400
}
for draft in off ngram; do
  bench 1b-q4-copy32-$draft 90 --model synthetic:gemma3-1b --weights q4 --streams 32 --prompt copy --draft $draft
done
for draft in off ngram; do
  bench 1b-bf16-copy-$draft 90 --model synthetic:gemma3-1b --weights bf16 --streams 1,8 --prompt copy --draft $draft
done
