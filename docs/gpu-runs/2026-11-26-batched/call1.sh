#!/usr/bin/env bash
# Call 1 (issue 32): batched decode on the H200. The per-sequence kernels' tests and the engine's
# batched == alone test on CUDA; then Gemma 3 4B Q4_K_M (random weights of the published
# shape, one file each) through our engine at 1, 8, 32 and 64 streams (prompt 512, 128 new
# tokens) and through llama-batched-bench on the same files. llama.cpp builds meanwhile.
set -u
here=$PWD/.gpu-bench
export BURN_GEMMA_CACHE=/tmp/bgcache
LCPP=/tmp/lcpp; GGUF=/tmp/gguf; mkdir -p $LCPP $GGUF
date
tar xzf $here/kit/llama.cpp-src.tgz -C $LCPP
( cd $LCPP && cmake -B build -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
    -DLLAMA_CURL=OFF -DLLAMA_BUILD_SERVER=OFF > $OUT/llama-build.txt 2>&1 && nice cmake --build build -j14 --target llama-batched-bench llama-quantize >> $OUT/llama-build.txt 2>&1; echo "build rc $?" >> $OUT/llama-build.txt ) &
build=$!
PYTHONPATH=$LCPP/gguf-py python3 $here/kit/gen_gguf.py 4b $here/kit/gemma3-vocab.json.gz $GGUF/4b-F16.gguf > $OUT/gen-4b.txt 2>&1 &
gen=$!
for t in kernel_tests engine_tests serve_bench; do gzip -dc $here/$t.gz > /tmp/$t && chmod +x /tmp/$t; done
BURN_GEMMA_TEST_SEED=20261126 /tmp/kernel_tests qkv_rope_append decode_per_sequence decode_at_position --test-threads 1 > $OUT/kernel-tests.txt 2>&1
echo "kernel tests rc $?"; grep "test result\|seed" $OUT/kernel-tests.txt | head -5
BURN_GEMMA_FIXTURES=$PWD/tests/fixtures /tmp/engine_tests on_cuda --nocapture > $OUT/engine-tests.txt 2>&1
echo "engine tests rc $?"; grep "decode steps\|test result" $OUT/engine-tests.txt
wait $build; tail -2 $OUT/llama-build.txt; wait $gen; date
export LD_LIBRARY_PATH=$LCPP/build/bin
for q in Q4_K_M Q8_0; do $LCPP/build/bin/llama-quantize $GGUF/4b-F16.gguf $GGUF/4b-$q.gguf $q 16 > /dev/null 2>&1; done
ls -la $GGUF; date
for q in Q4_K_M; do
  f=$GGUF/4b-$q.gguf
  /tmp/serve_bench --model $f --backend cuda --dtype bf16 --weights native --streams 1,8,32,64 --prompt-len 512 --gen 128 --reps 2 > $OUT/ours-4b-$q.txt 2>&1
  echo "ours 4b $q rc $?"; grep "streams" $OUT/ours-4b-$q.txt; date
  $LCPP/build/bin/llama-batched-bench -m $f -c 50000 -b 2048 -ub 512 -npp 512 -ntg 128 -npl 1,8,32,64 -fa on -ngl 99 > $OUT/llama-4b-$q.txt 2>&1
  echo "llama 4b $q rc $?"; grep "^|" $OUT/llama-4b-$q.txt; date
done
