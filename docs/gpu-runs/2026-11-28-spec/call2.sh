#!/bin/bash
# GPU call 2 (issue 35): as call 1, every run from an empty context (call 1's runs continued one
# conversation, so every run met new positions and new prompt shapes), 64 tokens a run.
set -u
cd "$(dirname "$0")/../../../.gpu-bench"
gzip -dc spec_bench.gz > /tmp/spec_bench; chmod +x /tmp/spec_bench
LT=$(find /usr/local /usr/lib -name 'libcublasLt.so*' 2>/dev/null | head -1); export LD_LIBRARY_PATH=$(dirname $LT)
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $OUT/env.txt
run() { # name, limit, args...
  local name=$1 limit=$2; shift 2
  echo "== $name: $*" >> $OUT/log.txt
  timeout $limit /tmp/spec_bench --backend cuda "$@" > $OUT/$name.md 2>> $OUT/log.txt; echo "rc $?" >> $OUT/$name.md
}
run 1b-q4 220 --model synthetic:gemma3-1b --weights q4 --drafts ngram,self,model:synthetic:gemma3-270m --draft-tokens 4 --prompt-len 512 --gen 64 --reps 2
run 4b-q4 180 --model synthetic:gemma3-4b --weights q4 --drafts self,model:synthetic:gemma3-270m --draft-tokens 4 --prompt-len 512 --gen 64 --reps 2
run 1b-q4-keep 140 --model synthetic:gemma3-1b --weights q4 --drafts model:synthetic:gemma3-270m --keep-drafting --draft-tokens 4 --prompt-len 512 --gen 64 --reps 2
tail -n 8 $OUT/*.md; grep -E "round" $OUT/log.txt | cut -c1-260
