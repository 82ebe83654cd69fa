#!/usr/bin/env bash
# Call 5 (fresh machine): is a prompt of 513 tokens much slower than one of 512? The random 1B
# (F16 GGUF, bf16 weights) through serve_bench at one stream, prompts of 512, 513 and 576, 2 new
# tokens, 3 runs after a warm-up; then the GEMM choices the tuning kept.
set -u
here=$PWD/gpu-bundle
GGUF=/tmp/gguf; mkdir -p $GGUF /tmp/gguf-py
unxz() { xz -dc "$1" 2>/dev/null || python3 -c 'import lzma,shutil,sys; shutil.copyfileobj(lzma.open(sys.argv[1]), sys.stdout.buffer)' "$1"; }
unxz $here/serve_bench.xz > /tmp/serve_bench && chmod +x /tmp/serve_bench
tar xzf $here/kit/llama.cpp-src.tgz -C /tmp/gguf-py --wildcards '*/gguf-py/*' 2>/dev/null || tar xzf $here/kit/llama.cpp-src.tgz -C /tmp/gguf-py
gp=$(dirname $(find /tmp/gguf-py -type d -name gguf -path '*gguf-py/gguf' | head -1))
PYTHONPATH=$gp python3 $here/kit/gen_gguf.py 1b $here/kit/gemma3-vocab.json.gz $GGUF/1b-F16.gguf > $OUT/gen-1b.txt 2>&1; echo "gen rc $?"; date
for len in 512 513 576; do
  /tmp/serve_bench --model $GGUF/1b-F16.gguf --backend cuda --dtype bf16 --streams 1 --prompt-len $len --gen 2 --reps 3 --prefix-cache off > $OUT/len-$len.txt 2>&1
  echo "prompt $len rc $?"; grep -E "^streams" $OUT/len-$len.txt; date
done
cat ~/.cache/burn-gemma/gemm-tune.txt > $OUT/gemm-tune.txt 2>&1; cat $OUT/gemm-tune.txt
