#!/bin/bash
# GPU call 4 (issue 35): the real Gemma 3 270M Q4_K_M (carried in nine 29 MiB chunks by the
# calls before, appended to /tmp/m.gguf and checked by SHA-256), prompt lookup against plain
# decoding with spec_bench on the prompts of scripts/spec-prompts (copying a passage, editing
# code, free text), in the chat template, 128 tokens, a warm-up and 3 timed rounds.
set -u
cd "$(dirname "$0")/../../.."
cat .gpu-model-9/part >> /tmp/m.gguf
sha256sum /tmp/m.gguf | tee $OUT/sha256.txt
gzip -dc .gpu-bench/spec_bench.gz > /tmp/spec_bench; chmod +x /tmp/spec_bench
LT=$(find /usr/local /usr/lib -name 'libcublasLt.so*' 2>/dev/null | head -1); export LD_LIBRARY_PATH=$(dirname $LT)
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $OUT/env.txt
for p in copy code free; do
  echo "== $p" >> $OUT/log.txt
  timeout 120 /tmp/spec_bench --backend cuda --model /tmp/m.gguf --drafts ngram --draft-tokens 4 --prompt-file scripts/spec-prompts/$p.txt --chat --gen 128 --reps 3 > $OUT/270m-$p.md 2>> $OUT/log.txt; echo "rc $?" >> $OUT/270m-$p.md
done
tail -n 6 $OUT/*.md; grep -E "round 3" $OUT/log.txt | cut -c1-300
