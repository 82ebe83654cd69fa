#!/usr/bin/env bash
# Call 5: where a 26B-A4B pp512 goes. One plain run first (it times the prefill GEMM kernels and
# caches the choices), then the same run under ncu (every launch, kernel time only), summarized
# per kernel name for the last prompt pass.
set -u
here=$PWD/.gpu-bench
export BURN_GEMMA_CACHE=/tmp/bgcache
LCPP=/tmp/lcpp; GGUF=/tmp/gguf; mkdir -p $LCPP $GGUF
f=$GGUF/g4-26b-a4b-Q8_0.gguf
if [ ! -s $f ]; then
  tar xzf $here/kit/llama.cpp-src.tgz -C $LCPP ./gguf-py 2>/dev/null || tar xzf $here/kit/llama.cpp-src.tgz -C $LCPP
  PYTHONPATH=$LCPP/gguf-py python3 $here/gen_gguf4.py 26b-a4b $here/kit/gemma3-vocab.json.gz $f > $OUT/gen.txt 2>&1 || { echo "gen failed"; tail -3 $OUT/gen.txt; }
fi
gzip -dc $here/bench.gz > /tmp/bench && chmod +x /tmp/bench
date
/tmp/bench --model $f --backend cuda --dtype bf16 --weights native --prompt-len 512 --gen 1 --reps 1 > $OUT/plain.txt 2>&1
grep -h "^JSON" $OUT/plain.txt | cut -c1-400; date
ncu --csv --print-units base --metrics gpu__time_duration.sum --clock-control none --cache-control none \
  --log-file /tmp/ncu-26b.csv /tmp/bench --model $f --backend cuda --dtype bf16 --weights native --prompt-len 512 --gen 1 --reps 1 > $OUT/ncu-run.txt 2>&1
echo "ncu rc $?"; date
gzip -c /tmp/ncu-26b.csv > $OUT/ncu-26b.csv.gz
python3 $here/prefill_profile.py /tmp/ncu-26b.csv --label "26B-A4B Q8_0 pp512" | tee $OUT/prefill-profile.md | head -40
