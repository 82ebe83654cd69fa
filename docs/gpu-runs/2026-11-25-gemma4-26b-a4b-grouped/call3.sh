#!/usr/bin/env bash
# Call 3: 26B-A4B prompts grouped by expert on the device, pp512 and tg128 beside llama.cpp on the
# same Q8_0 file, in one call: the file is written first (gguf-py from the llama.cpp source), then
# llama.cpp builds while our bench runs; llama-bench last.
set -u
here=$PWD/.gpu-bench
LCPP=/tmp/lcpp; GGUF=/tmp/gguf; mkdir -p $LCPP $GGUF
tar xzf $here/kit/llama.cpp-src.tgz -C $LCPP
f=$GGUF/g4-26b-a4b-Q8_0.gguf
PYTHONPATH=$LCPP/gguf-py python3 $here/gen_gguf4.py 26b-a4b $here/kit/gemma3-vocab.json.gz $f > $OUT/gen.txt 2>&1 || { echo "gen failed"; tail $OUT/gen.txt; }
ls -la $GGUF; date
( cd $LCPP && cmake -B build -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
    -DLLAMA_CURL=OFF -DLLAMA_BUILD_SERVER=OFF > $OUT/llama-build.txt 2>&1 && nice cmake --build build -j12 --target llama-bench >> $OUT/llama-build.txt 2>&1; echo "build rc $?" >> $OUT/llama-build.txt ) &
build=$!
gzip -dc $here/bench.gz > /tmp/bench && chmod +x /tmp/bench
/tmp/bench --model $f --backend cuda --dtype bf16 --weights native --prompt-len 512 --gen 128 --reps 3 > $OUT/ours.txt 2>&1
date; grep -h "loaded in\|^JSON" $OUT/ours.txt | cut -c1-700
wait $build; tail -2 $OUT/llama-build.txt; date
LD_LIBRARY_PATH=$LCPP/build/bin $LCPP/build/bin/llama-bench -m $f -p 512 -n 128 -fa 1 -ngl 99 -r 3 -o jsonl > $OUT/llama.jsonl 2>> $OUT/llama-err.txt
python3 -c '
import json,sys
for l in open(sys.argv[1]):
    r=json.loads(l); print("llama.cpp", r["n_prompt"], r["n_gen"], "%.1f tok/s" % r["avg_ts"])' $OUT/llama.jsonl
