#!/usr/bin/env bash
# Call 2 (after the per-layer gate reads the residual in the activations' dtype): E2B and E4B
# Q8_0 pp512/tg128 (ours), an ncu trace of an E2B prompt pass; meanwhile llama.cpp builds and
# the 31B Q8_0 file is written for call 3 (which must follow within the machine's idle time).
set -u
here=$PWD/.gpu-bench
export BURN_GEMMA_CACHE=/tmp/bgcache
LCPP=/tmp/lcpp; GGUF=/tmp/gguf; mkdir -p $LCPP $GGUF $OUT/r
[ -d $LCPP/gguf-py ] || tar xzf $here/kit/llama.cpp-src.tgz -C $LCPP
( cd $LCPP && cmake -B build -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
    -DLLAMA_CURL=OFF -DLLAMA_BUILD_SERVER=OFF > /tmp/llama-build.txt 2>&1 && nice cmake --build build -j10 --target llama-bench >> /tmp/llama-build.txt 2>&1; echo "build rc $?" >> /tmp/llama-build.txt ) > /dev/null 2>&1 &
( for m in e2b e4b 31b; do
  [ -s $GGUF/g4-$m-Q8_0.gguf ] || PYTHONPATH=$LCPP/gguf-py python3 $here/gen_gguf4.py $m $here/kit/gemma3-vocab.json.gz $GGUF/g4-$m-Q8_0.gguf > /tmp/gen-$m.txt 2>&1
done; echo "gen done $(date)" > /tmp/gen-done ) > /dev/null 2>&1 &
while [ ! -s $GGUF/g4-e4b-Q8_0.gguf ] || [ ! -f /tmp/gen-31b.txt ]; do sleep 5; done
ls -la $GGUF; date
gzip -dc $here/bench.gz > /tmp/bench && chmod +x /tmp/bench
for m in e2b e4b; do
  /tmp/bench --model $GGUF/g4-$m-Q8_0.gguf --backend cuda --dtype bf16 --weights native --prompt-len 512 --gen 128 --reps 3 > $OUT/r/ours-$m.txt 2>&1
  date; echo "ours $m:"; grep -h "loaded in\|^JSON" $OUT/r/ours-$m.txt | cut -c1-700
done
f=$GGUF/g4-e2b-Q8_0.gguf
ncu --csv --print-units base --metrics gpu__time_duration.sum --clock-control none --cache-control none \
  --log-file /tmp/ncu-e2b.csv /tmp/bench --model $f --backend cuda --dtype bf16 --weights native --prompt-len 512 --gen 1 --reps 1 > $OUT/r/ncu-run.txt 2>&1
echo "ncu rc $?"; date
gzip -c /tmp/ncu-e2b.csv > $OUT/ncu-e2b.csv.gz
while [ ! -f /tmp/gen-done ] && [ $SECONDS -lt 540 ]; do sleep 5; done
cat /tmp/gen-done 2>/dev/null; ls -la $GGUF; tail -1 /tmp/llama-build.txt
tar czf $OUT/logs.tgz -C $OUT r
