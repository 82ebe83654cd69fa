#!/usr/bin/env bash
# Call 4: the engine again after its steps run power-of-two rows (9-15 generating requests step
# as 16, and so on: call 3 found 9 rows at 125 ms a step, 16 at 14-17 ms). Gemma 3 4B with our Q4
# blocks quantized at load from the F16 file (llama-quantize is not built in this call; call 1
# ran the Q4_K_M file: 703 / 1190 / 2133 tok/s at 8 / 32 / 64 streams).
set -u
here=$PWD/.gpu-bench
mkdir -p /tmp/lcpp /tmp/gguf
tar xzf $here/kit/llama.cpp-src.tgz -C /tmp/lcpp --wildcards '*gguf-py*'
PYTHONPATH=$(dirname $(find /tmp/lcpp -type d -name gguf-py | head -1))/gguf-py python3 $here/kit/gen_gguf.py 4b $here/kit/gemma3-vocab.json.gz /tmp/gguf/4b-F16.gguf > $OUT/gen.txt 2>&1 || tail -3 $OUT/gen.txt
gzip -dc $here/serve_bench.gz > /tmp/serve_bench && chmod +x /tmp/serve_bench
date
/tmp/serve_bench --model /tmp/gguf/4b-F16.gguf --backend cuda --dtype bf16 --weights q4 --streams 8,32,64 --prompt-len 512 --gen 128 --reps 1 > $OUT/engine-q4.txt 2>&1
echo "engine q4 rc $?"; grep "^streams" $OUT/engine-q4.txt; date
