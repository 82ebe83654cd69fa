#!/usr/bin/env bash
# Call 8: llama.cpp built (llama-batched-bench, llama-quantize); Gemma 3 12B F16 written (random
# weights of the published shape), quantized to Q4_K_M and Q8_0. Call 9 runs both sides on them.
set -u
here=$PWD/.gpu-bench
LCPP=/tmp/lcpp; GGUF=/tmp/gguf; mkdir -p $LCPP $GGUF
date
tar xzf $here/kit/llama.cpp-src.tgz -C $LCPP
PYTHONPATH=$LCPP/gguf-py python3 $here/kit/gen_gguf.py 12b $here/kit/gemma3-vocab.json.gz $GGUF/12b-F16.gguf > $OUT/gen-12b.txt 2>&1 &
gen=$!
( cd $LCPP && cmake -B build -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
    -DLLAMA_CURL=OFF -DLLAMA_BUILD_SERVER=OFF > $OUT/llama-build.txt 2>&1 && cmake --build build -j14 --target llama-batched-bench llama-quantize >> $OUT/llama-build.txt 2>&1; echo "build rc $?" >> $OUT/llama-build.txt )
tail -1 $OUT/llama-build.txt; wait $gen; echo "gen rc $?"; date
export LD_LIBRARY_PATH=$LCPP/build/bin
$LCPP/build/bin/llama-quantize $GGUF/12b-F16.gguf $GGUF/12b-Q4_K_M.gguf Q4_K_M 8 > /dev/null 2>&1 &
$LCPP/build/bin/llama-quantize $GGUF/12b-F16.gguf $GGUF/12b-Q8_0.gguf Q8_0 8 > /dev/null 2>&1
wait
ls -la $GGUF; date
