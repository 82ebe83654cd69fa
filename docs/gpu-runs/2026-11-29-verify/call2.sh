#!/bin/bash
# GPU call 2 (issue 35): spec_bench with the verify step and the draft model's steps replayed
# as CUDA graphs. Random q4 weights of the published shapes, 512-token prompts (a 40-id phrase
# repeated: what prompt lookup finds; or random ids), 128 tokens, 4 drafts a round, a warm-up
# round then 3 timed rounds alternating the configurations.
set -u
cd "$(dirname "$0")/../../.."
gzip -dc .gpu-bench/spec_bench.gz > /tmp/spec_bench; chmod +x /tmp/spec_bench
LT=$(find /usr/local /usr/lib -name 'libcublasLt.so*' 2>/dev/null | head -1); export LD_LIBRARY_PATH=$(dirname $LT)
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $OUT/env.txt
run() { # name, limit, args...
  local name=$1 limit=$2; shift 2
  echo "== $name: $*" >> $OUT/log.txt
  timeout $limit /tmp/spec_bench --backend cuda "$@" > $OUT/$name.md 2>> $OUT/log.txt; echo "rc $?" >> $OUT/$name.md
}
run 1b-copy 190 --model synthetic:gemma3-1b --weights q4 --drafts ngram,self,model:synthetic:gemma3-270m --draft-tokens 4 --prompt copy --prompt-len 512 --gen 128 --reps 3
run 1b-random 130 --model synthetic:gemma3-1b --weights q4 --drafts ngram,model:synthetic:gemma3-270m --keep-drafting --draft-tokens 4 --prompt random --prompt-len 512 --gen 128 --reps 3
run 4b-copy 200 --model synthetic:gemma3-4b --weights q4 --drafts ngram,self --draft-tokens 4 --prompt copy --prompt-len 512 --gen 128 --reps 3
tail -n 8 $OUT/*.md; grep -E "round 3" $OUT/log.txt | cut -c1-300
