#!/bin/bash
# GPU call 5 (issue 35): the decode attention's splits sized by at most the window (a store keeping
# every position of a sliding window read its positions' span; call 4: 0.91x/0.96x at 16/32 not drafting). serve_bench on random q4
# weights of Gemma 3 1B, bf16, 512-token prompts (a 40-id phrase of each request's own
# repeated), 128 tokens, 8/16/32 requests at once, drafts off and prompt lookup (4 tokens),
# a warm-up then 3 timed runs, medians.
set -u
cd "$(dirname "$0")/../../.."
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $OUT/env.txt
gzip -dc .gpu-bench/serve_bench.gz > /tmp/serve_bench; chmod +x /tmp/serve_bench
LT=$(find /usr/local /usr/lib -name 'libcublasLt.so*' 2>/dev/null | head -1); export LD_LIBRARY_PATH=$(dirname $LT)
bench() { # name, limit, args...
  local name=$1 limit=$2; shift 2
  echo "== $name: $*" >> $OUT/log.txt
  timeout $limit /tmp/serve_bench --backend cuda --dtype bf16 --gen 128 --prompt-len 512 --reps 3 "$@" > $OUT/$name.txt 2>> $OUT/log.txt; echo "rc $?" >> $OUT/$name.txt
  grep -E "^streams|rc " $OUT/$name.txt | sed -E 's/; [0-9]+ prompt tokens cached so far//' | cut -c1-400
}
for draft in off ngram; do
  bench 1b-q4-copy-$draft 150 --model synthetic:gemma3-1b --weights q4 --streams 8,16,32 --prompt copy --draft $draft
done
