#!/usr/bin/env bash
# Call 1: llama.cpp (llama-server, llama-quantize) built and Gemma 3 4B written (random weights
# of the published shape) and quantized to Q4_K_M in the background; meanwhile on CUDA the
# engine against each request alone (graphs under Auto, and eager; the prefix cache on, its
# default). Then the prefix cache on the 4B: 32 prompts of 1024 tokens sharing their first 768,
# cache on and off, in this call.
set -u
here=$PWD/gpu-bundle
LCPP=/tmp/lcpp; GGUF=/tmp/gguf; mkdir -p $LCPP $GGUF
unxz() { xz -dc "$1" 2>/dev/null || python3 -c 'import lzma,shutil,sys; shutil.copyfileobj(lzma.open(sys.argv[1]), sys.stdout.buffer)' "$1"; }
for b in engine_test serve serve_bench; do unxz $here/$b.xz > /tmp/$b && chmod +x /tmp/$b; done
date
tar xzf $here/kit/llama.cpp-src.tgz -C $LCPP
( PYTHONPATH=$LCPP/gguf-py python3 $here/kit/gen_gguf.py 4b $here/kit/gemma3-vocab.json.gz $GGUF/4b-F16.gguf > $OUT/gen-4b.txt 2>&1; echo "gen rc $?" >> $OUT/gen-4b.txt ) &
( cd $LCPP && cmake -B build -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
    -DLLAMA_CURL=OFF -DLLAMA_BUILD_SERVER=ON > $OUT/llama-build.txt 2>&1 && cmake --build build -j12 --target llama-server llama-quantize >> $OUT/llama-build.txt 2>&1; echo "build rc $?" >> $OUT/llama-build.txt ) &
BURN_GEMMA_FIXTURES=$PWD/tests/fixtures /tmp/engine_test --test-threads 1 --nocapture > $OUT/engine-test.txt 2>&1
echo "engine test rc $?"; grep -E "test result|FAILED|panicked|prefix hits|^test " $OUT/engine-test.txt | head -30; date
wait
tail -1 $OUT/llama-build.txt; tail -1 $OUT/gen-4b.txt
export LD_LIBRARY_PATH=$LCPP/build/bin
$LCPP/build/bin/llama-quantize $GGUF/4b-F16.gguf $GGUF/4b-Q4_K_M.gguf Q4_K_M 12 > /dev/null 2>&1; echo "quantize rc $?"; date
rm -f $GGUF/4b-F16.gguf
f=$GGUF/4b-Q4_K_M.gguf
for pc in on off; do
  /tmp/serve_bench --model $f --backend cuda --dtype bf16 --weights native --streams 32 --prompt-len 1024 --shared-prefix 768 --gen 64 --reps 3 --prefix-cache $pc > $OUT/prefix-4b-$pc.txt 2>&1
  echo "prefix cache $pc rc $?"; grep -E "^streams|^JSON" $OUT/prefix-4b-$pc.txt; date
done
