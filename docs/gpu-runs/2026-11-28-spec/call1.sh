#!/bin/bash
# GPU call 1 (issue 35, 33): speculative decoding on random-weight Gemma 3 1B and 4B (spec_bench:
# plain decoding as a replayed CUDA graph against prompt lookup, the target drafting for itself,
# and a random 270M drafting), then time to first token of 2,048-token prompts on the 270M shape.
set -u
cd "$(dirname "$0")/../../../.gpu-bench"
for b in spec_bench bench; do gzip -dc $b.gz > /tmp/$b; chmod +x /tmp/$b; done
LT=$(find /usr/local /usr/lib -name 'libcublasLt.so*' 2>/dev/null | head -1); export LD_LIBRARY_PATH=$(dirname $LT)
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $OUT/env.txt
run() { # name, args...
  local name=$1; shift
  echo "== $name: $*" >> $OUT/log.txt
  timeout 170 /tmp/spec_bench --backend cuda "$@" > $OUT/$name.md 2>> $OUT/log.txt; echo "rc $?" >> $OUT/$name.md
}
run 1b-q4 --model synthetic:gemma3-1b --weights q4 --drafts ngram,self,model:synthetic:gemma3-270m --draft-tokens 4 --prompt-len 512 --gen 128 --reps 3
run 1b-q4-keep --model synthetic:gemma3-1b --weights q4 --drafts ngram,model:synthetic:gemma3-270m --keep-drafting --draft-tokens 4 --prompt-len 512 --gen 128 --reps 3
run 4b-q4 --model synthetic:gemma3-4b --weights q4 --drafts self,model:synthetic:gemma3-270m --draft-tokens 4 --prompt-len 512 --gen 128 --reps 3
timeout 90 /tmp/bench --model synthetic:gemma3-270m --backend cuda --weights q4 --prompt-len 2048 --gen 16 --reps 5 > $OUT/270m-ttft.txt 2>&1; echo "rc $?" >> $OUT/270m-ttft.txt
tail -n 8 $OUT/*.md; grep -E "time to first|prefill|JSON" $OUT/270m-ttft.txt | head
