#!/bin/bash
# GPU call 3 (issue 34): decode of the two largest dense shapes with random q4 weights (Gemma 3
# 27B, Gemma 4 31B), tg128 after a 512-token prompt, our side only (no GGUF of these shapes was
# written in this session's calls), with the bytes a token reads.
set -u
cd "$(dirname "$0")/../../../.gpu-bench"
gzip -dc bench.gz > /tmp/bench; chmod +x /tmp/bench
LT=$(find /usr/local /usr/lib -name 'libcublasLt.so*' 2>/dev/null | head -1); export LD_LIBRARY_PATH=$(dirname $LT)
for m in gemma3-27b gemma4-31b; do
  timeout 270 /tmp/bench --model synthetic:$m --backend cuda --weights q4 --prompt-len 512 --gen 128 --reps 3 > $OUT/$m-q4.txt 2>&1
  echo "rc $?" >> $OUT/$m-q4.txt
done
grep -hE "model |decode|tg|time to first|JSON|rc " $OUT/*.txt | cut -c1-400
