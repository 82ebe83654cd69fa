#!/bin/bash
# GPU call 5 (issue 35): why call 4's free-text run gave other greedy tokens with drafts. The
# real 270M again (nine chunks, SHA-256 checked), attention of a verify step's rows now split
# as a one-row step's (kernels/src/attention/decode.rs), spec_bench printing the first token
# that differs: free text in bf16 and in f32, copying in f32.
set -u
cd "$(dirname "$0")/../../.."
cat .gpu-model-9/part >> /tmp/m.gguf
sha256sum /tmp/m.gguf | tee $OUT/sha256.txt
gzip -dc .gpu-bench/spec_bench.gz > /tmp/spec_bench; chmod +x /tmp/spec_bench
LT=$(find /usr/local /usr/lib -name 'libcublasLt.so*' 2>/dev/null | head -1); export LD_LIBRARY_PATH=$(dirname $LT)
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $OUT/env.txt
run() { # name, prompt, args...
  local name=$1 p=$2; shift 2
  echo "== $name" >> $OUT/log.txt
  timeout 150 /tmp/spec_bench --backend cuda --model /tmp/m.gguf --drafts ngram --draft-tokens 4 --prompt-file scripts/spec-prompts/$p.txt --chat --gen 128 --reps 3 "$@" > $OUT/270m-$name.md 2>> $OUT/log.txt; echo "rc $?" >> $OUT/270m-$name.md
}
run free-bf16 free
run free-f32 free --dtype f32
run copy-f32 copy --dtype f32
tail -n 6 $OUT/*.md; grep -E "round 3|token [0-9]+ is" $OUT/log.txt | cut -c1-300
