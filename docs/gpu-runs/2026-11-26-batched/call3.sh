#!/usr/bin/env bash
# Call 3: where a batched decode step's time goes. The model's step alone (no engine, no
# sampling; logits read back each step) over 1-64 sequences of Gemma 3 4B (random weights, the
# F16 file of call 1 written again), with dense bf16 weights, and with our Q8 and Q4 blocks
# (quantized at load): which rows counts take the quantized GEMV (at most 8) and which
# dequantize whole matrices for the GEMM.
set -u
here=$PWD/.gpu-bench
mkdir -p /tmp/lcpp /tmp/gguf
tar xzf $here/kit/llama.cpp-src.tgz -C /tmp/lcpp --wildcards '*gguf-py*'
PYTHONPATH=$(dirname $(find /tmp/lcpp -type d -name gguf-py | head -1))/gguf-py python3 $here/kit/gen_gguf.py 4b $here/kit/gemma3-vocab.json.gz /tmp/gguf/4b-F16.gguf > $OUT/gen.txt 2>&1 || tail -3 $OUT/gen.txt
gzip -dc $here/serve_bench.gz > /tmp/serve_bench && chmod +x /tmp/serve_bench
date
for w in native q8 q4; do
  /tmp/serve_bench --model /tmp/gguf/4b-F16.gguf --backend cuda --dtype bf16 --weights $w --step-only --streams 1,4,8,9,16,32,64 --prompt-len 512 > $OUT/step-$w.txt 2>&1
  echo "weights $w rc $?"; grep "^step" $OUT/step-$w.txt; date
done
