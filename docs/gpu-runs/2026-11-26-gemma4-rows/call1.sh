#!/usr/bin/env bash
# Call 1: the quantized-kernels check on CUDA (int8 KV now against a reference pinned to the
# codes the device stored) and the expert/quant kernel tests after the review mend; E2B and E4B
# Q8_0 (random weights of the published shapes) side by side with llama.cpp: pp512 and tg128;
# then an ncu trace of an E2B prompt pass (where its prefill time goes). llama.cpp builds in
# the background meanwhile.
set -u
here=$PWD/.gpu-bench
export BURN_GEMMA_CACHE=/tmp/bgcache
LCPP=/tmp/lcpp; GGUF=/tmp/gguf; mkdir -p $LCPP $GGUF
tar xzf $here/kit/llama.cpp-src.tgz -C $LCPP
( cd $LCPP && cmake -B build -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
    -DLLAMA_CURL=OFF -DLLAMA_BUILD_SERVER=OFF > $OUT/llama-build.txt 2>&1 && nice cmake --build build -j12 --target llama-bench >> $OUT/llama-build.txt 2>&1; echo "build rc $?" >> $OUT/llama-build.txt ) &
build=$!
for m in e2b e4b; do
  PYTHONPATH=$LCPP/gguf-py python3 $here/gen_gguf4.py $m $here/kit/gemma3-vocab.json.gz $GGUF/g4-$m-Q8_0.gguf > $OUT/gen-$m.txt 2>&1 || { echo "gen $m failed"; tail -3 $OUT/gen-$m.txt; }
done &
gen=$!
gzip -dc $here/tiny_models.gz > /tmp/tiny_models && chmod +x /tmp/tiny_models
BURN_GEMMA_FIXTURES=$PWD/tests/fixtures /tmp/tiny_models quantized_kernels_match_their_reference_on_cuda --nocapture > $OUT/tiny-models-quant.txt 2>&1
echo "tiny_models rc $?"; grep "held to\|test result" $OUT/tiny-models-quant.txt
gzip -dc $here/kernel_tests.gz > /tmp/kernel_tests && chmod +x /tmp/kernel_tests
BURN_GEMMA_TEST_SEED=20261126 /tmp/kernel_tests experts quant kv --test-threads 1 > $OUT/kernel-tests.txt 2>&1
echo "kernel tests rc $?"; grep "test result\|seed" $OUT/kernel-tests.txt | head -5
wait $gen; ls -la $GGUF; date
gzip -dc $here/bench.gz > /tmp/bench && chmod +x /tmp/bench
for m in e2b e4b; do
  /tmp/bench --model $GGUF/g4-$m-Q8_0.gguf --backend cuda --dtype bf16 --weights native --prompt-len 512 --gen 128 --reps 3 > $OUT/ours-$m.txt 2>&1
  date; echo "ours $m:"; grep -h "loaded in\|^JSON" $OUT/ours-$m.txt | cut -c1-700
done
f=$GGUF/g4-e2b-Q8_0.gguf
ncu --csv --print-units base --metrics gpu__time_duration.sum --clock-control none --cache-control none \
  --log-file /tmp/ncu-e2b.csv /tmp/bench --model $f --backend cuda --dtype bf16 --weights native --prompt-len 512 --gen 1 --reps 1 > $OUT/ncu-run.txt 2>&1
echo "ncu rc $?"; date
gzip -c /tmp/ncu-e2b.csv > $OUT/ncu-e2b.csv.gz
python3 $here/prefill_profile.py /tmp/ncu-e2b.csv --label "E2B Q8_0 pp512" > $OUT/prefill-profile.md; head -30 $OUT/prefill-profile.md
wait $build; tail -2 $OUT/llama-build.txt; date
for m in e2b e4b; do
  LD_LIBRARY_PATH=$LCPP/build/bin $LCPP/build/bin/llama-bench -m $GGUF/g4-$m-Q8_0.gguf -p 512 -n 128 -fa 1 -ngl 99 -r 3 -o jsonl > $OUT/llama-$m.jsonl 2>> $OUT/llama-err.txt
  python3 -c '
import json,sys
for l in open(sys.argv[1]):
    r=json.loads(l); print("llama.cpp", sys.argv[2], r["n_prompt"], r["n_gen"], "%.1f tok/s" % r["avg_ts"])' $OUT/llama-$m.jsonl $m
done
date
