#!/usr/bin/env bash
# Call 3 (a fresh machine): llama.cpp and the 4B Q4_K_M file again (background); then our server
# (prefix cache off) answering 12 prompts one at a time, twice the same 12: whether a prompt's
# first token waits for something per prompt length (the first pass meets new lengths, the
# second none).
set -u
here=$PWD/gpu-bundle
LCPP=/tmp/lcpp; GGUF=/tmp/gguf; mkdir -p $LCPP $GGUF
unxz() { xz -dc "$1" 2>/dev/null || python3 -c 'import lzma,shutil,sys; shutil.copyfileobj(lzma.open(sys.argv[1]), sys.stdout.buffer)' "$1"; }
for b in serve serve_bench; do unxz $here/$b.xz > /tmp/$b && chmod +x /tmp/$b; done
date
tar xzf $here/kit/llama.cpp-src.tgz -C $LCPP
( cd $LCPP && cmake -B build -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
    -DLLAMA_CURL=OFF -DLLAMA_BUILD_SERVER=ON > $OUT/llama-build.txt 2>&1 && cmake --build build -j10 --target llama-server llama-quantize >> $OUT/llama-build.txt 2>&1; echo "build rc $?" >> $OUT/llama-build.txt ) &
PYTHONPATH=$LCPP/gguf-py python3 $here/kit/gen_gguf.py 4b $here/kit/gemma3-vocab.json.gz $GGUF/4b-F16.gguf > $OUT/gen-4b.txt 2>&1; echo "gen rc $?"
wait
tail -1 $OUT/llama-build.txt
export LD_LIBRARY_PATH=$LCPP/build/bin
$LCPP/build/bin/llama-quantize $GGUF/4b-F16.gguf $GGUF/4b-Q4_K_M.gguf Q4_K_M 12 > /dev/null 2>&1; echo "quantize rc $?"; date
rm -f $GGUF/4b-F16.gguf
f=$GGUF/4b-Q4_K_M.gguf
up() { python3 -c 'import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=2)' "$1" 2>/dev/null; }
wait_up() { for i in $(seq 1 240); do up http://127.0.0.1:$1/health && return 0; sleep 0.5; done; return 1; }
/tmp/serve --model $f --backend cuda --dtype bf16 --weights native --port 8080 --max-running 64 --max-sequence-len 1024 --prefix-cache off > $OUT/ours-server-lengths.txt 2>&1 &
ours=$!
wait_up 8080; echo "ours up rc $?"; date
for pass in 1 2; do
  python3 scripts/serve_load.py --url http://127.0.0.1:8080 --streams 1 --requests 12 --prompt-words 512 --max-tokens 4 --label "pass $pass" --per-request | tee -a $OUT/lengths.txt
done
kill -INT $ours; wait $ours; date
