#!/usr/bin/env bash
# Call 7 (after the batch padded to the typical expert): the expert kernel tests,
# then 26B-A4B and E2B (Q8_0, random weights of the published shapes) side by side with
# llama.cpp on the same files in one call: pp512 and tg128. llama.cpp builds while the tests and
# our bench run; llama-bench last.
set -u
here=$PWD/.gpu-bench
export BURN_GEMMA_CACHE=/tmp/bgcache
LCPP=/tmp/lcpp; GGUF=/tmp/gguf; mkdir -p $LCPP $GGUF
tar xzf $here/kit/llama.cpp-src.tgz -C $LCPP
( cd $LCPP && cmake -B build -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
    -DLLAMA_CURL=OFF -DLLAMA_BUILD_SERVER=OFF > $OUT/llama-build.txt 2>&1 && nice cmake --build build -j12 --target llama-bench >> $OUT/llama-build.txt 2>&1; echo "build rc $?" >> $OUT/llama-build.txt ) &
build=$!
gzip -dc $here/kernel_tests.gz > /tmp/kernel_tests && chmod +x /tmp/kernel_tests
BURN_GEMMA_TEST_SEED=20261125 /tmp/kernel_tests experts --test-threads 1 > $OUT/kernel-tests.txt 2>&1
echo "kernel tests rc $?"; grep "test result" $OUT/kernel-tests.txt
for m in 26b-a4b; do
  PYTHONPATH=$LCPP/gguf-py python3 $here/gen_gguf4.py $m $here/kit/gemma3-vocab.json.gz $GGUF/g4-$m-Q8_0.gguf > $OUT/gen-$m.txt 2>&1 || { echo "gen $m failed"; tail -3 $OUT/gen-$m.txt; }
done
ls -la $GGUF; date
gzip -dc $here/bench.gz > /tmp/bench && chmod +x /tmp/bench
for m in 26b-a4b; do
  /tmp/bench --model $GGUF/g4-$m-Q8_0.gguf --backend cuda --dtype bf16 --weights native --prompt-len 512 --gen 128 --reps 3 > $OUT/ours-$m.txt 2>&1
  date; echo "ours $m:"; grep -h "loaded in\|^JSON" $OUT/ours-$m.txt | cut -c1-700
done
wait $build; tail -2 $OUT/llama-build.txt; date
for m in 26b-a4b; do
  LD_LIBRARY_PATH=$LCPP/build/bin $LCPP/build/bin/llama-bench -m $GGUF/g4-$m-Q8_0.gguf -p 512 -n 128 -fa 1 -ngl 99 -r 3 -o jsonl > $OUT/llama-$m.jsonl 2>> $OUT/llama-err.txt
  python3 -c '
import json,sys
for l in open(sys.argv[1]):
    r=json.loads(l); print("llama.cpp", sys.argv[2], r["n_prompt"], r["n_gen"], "%.1f tok/s" % r["avg_ts"])' $OUT/llama-$m.jsonl $m
done
