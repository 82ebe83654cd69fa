#!/usr/bin/env bash
# Call 4: the engine with our Q4 (quantized at load from the F16 file) at 1, 8, 32, 64 streams,
# with the window's tokens counted from their arrival times and the engine's time per decode step.
set -u
here=$PWD/.gpu-bench
mkdir -p /tmp/lcpp /tmp/gguf
cd /tmp
gzip -dc $here/serve_bench.gz > /tmp/serve_bench && chmod +x /tmp/serve_bench
tar xzf $here/kit/llama.cpp-src.tgz -C /tmp/lcpp --wildcards '*gguf-py*'
PYTHONPATH=$(dirname $(find /tmp/lcpp -type d -name gguf-py | head -1))/gguf-py python3 $here/kit/gen_gguf.py 4b $here/kit/gemma3-vocab.json.gz /tmp/gguf/4b-F16.gguf > $OUT/gen.txt 2>&1; echo "gen rc $?"
date
/tmp/serve_bench --model /tmp/gguf/4b-F16.gguf --backend cuda --dtype bf16 --weights q4 --streams 1,8,32,64 --prompt-len 512 --gen 128 --reps 1 > $OUT/engine-q4.txt 2>&1
echo "engine q4 rc $?"; grep "^streams" $OUT/engine-q4.txt; date
