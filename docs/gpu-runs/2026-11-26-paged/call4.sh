#!/usr/bin/env bash
# Call 4 (a fresh machine: call 3 found /tmp empty): llama.cpp built, Gemma 3 4B written and
# quantized to Q4_K_M again. Call 5 runs the benches on it.
set -u
here=$PWD/.gpu-bench
LCPP=/tmp/lcpp; GGUF=/tmp/gguf; mkdir -p $LCPP $GGUF
unxz() { xz -dc "$1" 2>/dev/null || python3 -c 'import lzma,shutil,sys; shutil.copyfileobj(lzma.open(sys.argv[1]), sys.stdout.buffer)' "$1"; }
for b in serve_bench; do unxz $here/$b.xz > /tmp/$b && chmod +x /tmp/$b; done
date
tar xzf $here/kit/llama.cpp-src.tgz -C $LCPP
( PYTHONPATH=$LCPP/gguf-py python3 $here/kit/gen_gguf.py 4b $here/kit/gemma3-vocab.json.gz $GGUF/4b-F16.gguf > $OUT/gen-4b.txt 2>&1; echo "gen rc $?" >> $OUT/gen-4b.txt ) &
( cd $LCPP && cmake -B build -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
    -DLLAMA_CURL=OFF -DLLAMA_BUILD_SERVER=OFF > $OUT/llama-build.txt 2>&1 && cmake --build build -j16 --target llama-batched-bench llama-quantize >> $OUT/llama-build.txt 2>&1; echo "build rc $?" >> $OUT/llama-build.txt )
wait
tail -1 $OUT/llama-build.txt; tail -1 $OUT/gen-4b.txt; date
export LD_LIBRARY_PATH=$LCPP/build/bin
$LCPP/build/bin/llama-quantize $GGUF/4b-F16.gguf $GGUF/4b-Q4_K_M.gguf Q4_K_M 16 > /dev/null 2>&1; echo "quantize rc $?"; date
