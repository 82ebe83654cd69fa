#!/usr/bin/env bash
# Call 1: llama.cpp built and Gemma 3 4B written (random weights of the published shape) and
# quantized to Q4_K_M in the background; meanwhile on CUDA: the in-place block scatter and the
# paged kernels' tests (f32, bf16), the engine against each request alone (graphs under Auto,
# and eager), the random 1B's batched step (rows, paged, paged replayed as a graph).
set -u
here=$PWD/gpu-bundle
LCPP=/tmp/lcpp; GGUF=/tmp/gguf; mkdir -p $LCPP $GGUF
unxz() { xz -dc "$1" 2>/dev/null || python3 -c 'import lzma,shutil,sys; shutil.copyfileobj(lzma.open(sys.argv[1]), sys.stdout.buffer)' "$1"; }
for b in ktests engine_test bstest serve_bench; do unxz $here/$b.xz > /tmp/$b && chmod +x /tmp/$b; done
date
tar xzf $here/kit/llama.cpp-src.tgz -C $LCPP
( PYTHONPATH=$LCPP/gguf-py python3 $here/kit/gen_gguf.py 4b $here/kit/gemma3-vocab.json.gz $GGUF/4b-F16.gguf > $OUT/gen-4b.txt 2>&1; echo "gen rc $?" >> $OUT/gen-4b.txt ) &
( cd $LCPP && cmake -B build -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
    -DLLAMA_CURL=OFF -DLLAMA_BUILD_SERVER=OFF > $OUT/llama-build.txt 2>&1 && cmake --build build -j12 --target llama-batched-bench llama-quantize >> $OUT/llama-build.txt 2>&1; echo "build rc $?" >> $OUT/llama-build.txt ) &
export BURN_GEMMA_TEST_SEED=20261126
/tmp/ktests --test-threads 1 scatter_into_blocks decode_per_sequence qkv_rope_append dense_kv_write > $OUT/kernel-tests.txt 2>&1
echo "kernel tests rc $?"; grep -E "test result|FAILED|panicked" $OUT/kernel-tests.txt | head; date
unset BURN_GEMMA_TEST_SEED
/tmp/ktests --test-threads 1 scatter_into_blocks > $OUT/kernel-tests-fresh-seed.txt 2>&1
echo "kernel tests (fresh seed) rc $?"; grep -E "test result|FAILED|seed" $OUT/kernel-tests-fresh-seed.txt | head -4
BURN_GEMMA_FIXTURES=$PWD/tests/fixtures /tmp/engine_test --test-threads 1 --nocapture cuda > $OUT/engine-test.txt 2>&1
echo "engine test rc $?"; grep -E "test result|FAILED|panicked|replayed" $OUT/engine-test.txt | head -20; date
/tmp/bstest --nocapture > $OUT/batched-step-test.txt 2>&1
echo "batched step rc $?"; grep -E "test result|FAILED|panicked|sequences" $OUT/batched-step-test.txt | head -30; date
wait
tail -1 $OUT/llama-build.txt; tail -1 $OUT/gen-4b.txt
export LD_LIBRARY_PATH=$LCPP/build/bin
$LCPP/build/bin/llama-quantize $GGUF/4b-F16.gguf $GGUF/4b-Q4_K_M.gguf Q4_K_M 12 > /dev/null 2>&1; echo "quantize rc $?"; date
