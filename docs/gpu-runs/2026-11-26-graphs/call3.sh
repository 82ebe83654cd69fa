#!/usr/bin/env bash
# Call 3: llama.cpp built, Gemma 3 4B and 12B written (random weights of the published shapes)
# and quantized (4B Q8_0, 12B Q4_K_M) in the background; meanwhile the random 1B's batched step
# test (rows, paged, paged replayed as a CUDA graph, which must equal the eager step exactly).
set -u
here=$PWD/gpu-bundle
LCPP=/tmp/lcpp; GGUF=/tmp/gguf; mkdir -p $LCPP $GGUF
unxz() { xz -dc "$1" 2>/dev/null || python3 -c 'import lzma,shutil,sys; shutil.copyfileobj(lzma.open(sys.argv[1]), sys.stdout.buffer)' "$1"; }
for b in bstest serve_bench; do unxz $here/$b.xz > /tmp/$b && chmod +x /tmp/$b; done
date
tar xzf $here/kit/llama.cpp-src.tgz -C $LCPP
for m in 4b 12b; do
  ( PYTHONPATH=$LCPP/gguf-py python3 $here/kit/gen_gguf.py $m $here/kit/gemma3-vocab.json.gz $GGUF/$m-F16.gguf > $OUT/gen-$m.txt 2>&1; echo "gen rc $?" >> $OUT/gen-$m.txt ) &
done
( cd $LCPP && cmake -B build -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
    -DLLAMA_CURL=OFF -DLLAMA_BUILD_SERVER=OFF > $OUT/llama-build.txt 2>&1 && cmake --build build -j12 --target llama-batched-bench llama-quantize >> $OUT/llama-build.txt 2>&1; echo "build rc $?" >> $OUT/llama-build.txt ) &
/tmp/bstest --nocapture > $OUT/batched-step-test.txt 2>&1
echo "batched step rc $?"; grep -E "test result|FAILED|panicked|sequences" $OUT/batched-step-test.txt | head -40; date
wait
tail -1 $OUT/llama-build.txt; tail -1 $OUT/gen-4b.txt; tail -1 $OUT/gen-12b.txt
export LD_LIBRARY_PATH=$LCPP/build/bin
$LCPP/build/bin/llama-quantize $GGUF/4b-F16.gguf $GGUF/4b-Q8_0.gguf Q8_0 12 > /dev/null 2>&1; echo "quantize 4b rc $?"; rm -f $GGUF/4b-F16.gguf
$LCPP/build/bin/llama-quantize $GGUF/12b-F16.gguf $GGUF/12b-Q4_K_M.gguf Q4_K_M 12 > /dev/null 2>&1; echo "quantize 12b rc $?"; rm -f $GGUF/12b-F16.gguf
ls -la $GGUF; date
