#!/usr/bin/env bash
# Call 1: llama.cpp built and Gemma 3 4B written (random weights of the published shape) and
# quantized to Q4_K_M in the background; meanwhile the paged-cache tests on CUDA: the decode
# attention and QKV-append kernels over shuffled blocks (f32, bf16), the engine against each
# request alone (a row per sequence and a pool of 100 positions), the random 1B's batched step
# over rows and over a paged cache; then the 4B step by rows, a row per sequence vs paged.
set -u
here=$PWD/.gpu-bench
LCPP=/tmp/lcpp; GGUF=/tmp/gguf; mkdir -p $LCPP $GGUF
unxz() { xz -dc "$1" 2>/dev/null || python3 -c 'import lzma,shutil,sys; shutil.copyfileobj(lzma.open(sys.argv[1]), sys.stdout.buffer)' "$1"; }
for b in ktests engine_test bstest serve_bench; do unxz $here/$b.xz > /tmp/$b && chmod +x /tmp/$b; done
date
tar xzf $here/kit/llama.cpp-src.tgz -C $LCPP
( PYTHONPATH=$LCPP/gguf-py python3 $here/kit/gen_gguf.py 4b $here/kit/gemma3-vocab.json.gz $GGUF/4b-F16.gguf > $OUT/gen-4b.txt 2>&1; echo "gen rc $?" >> $OUT/gen-4b.txt ) &
( cd $LCPP && cmake -B build -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
    -DLLAMA_CURL=OFF -DLLAMA_BUILD_SERVER=OFF > $OUT/llama-build.txt 2>&1 && cmake --build build -j12 --target llama-batched-bench llama-quantize >> $OUT/llama-build.txt 2>&1; echo "build rc $?" >> $OUT/llama-build.txt ) &
export BURN_GEMMA_TEST_SEED=20261126
/tmp/ktests --test-threads 1 decode_per_sequence qkv_rope_append decode_at_position > $OUT/kernel-tests.txt 2>&1
echo "kernel tests rc $?"; grep -E "test result|FAILED|panicked" $OUT/kernel-tests.txt | head; date
BURN_GEMMA_FIXTURES=$PWD/tests/fixtures /tmp/engine_test --test-threads 1 --nocapture cuda > $OUT/engine-test.txt 2>&1
echo "engine test rc $?"; grep -E "test result|FAILED|panicked|decode steps" $OUT/engine-test.txt | head; date
/tmp/bstest --nocapture > $OUT/batched-step-test.txt 2>&1
echo "batched step rc $?"; grep -E "test result|FAILED|panicked|sequences" $OUT/batched-step-test.txt | head -20; date
wait
tail -1 $OUT/llama-build.txt; tail -1 $OUT/gen-4b.txt
export LD_LIBRARY_PATH=$LCPP/build/bin
$LCPP/build/bin/llama-quantize $GGUF/4b-F16.gguf $GGUF/4b-Q4_K_M.gguf Q4_K_M 12 > /dev/null 2>&1; echo "quantize rc $?"; date
/tmp/serve_bench --model $GGUF/4b-Q4_K_M.gguf --backend cuda --dtype bf16 --weights native --step-only --streams 1,8,32,64 --prompt-len 512 > $OUT/step-q4.txt 2>&1
echo "step rc $?"; grep "^step" $OUT/step-q4.txt; date
