#!/usr/bin/env bash
# Call 6: where a 31B Q8_0 pp512 goes (for the prefill issue): one plain run (tunes and caches
# the GEMM choices), then the same under ncu (kernel time only), summarised per kernel name.
set -u
here=$PWD/.gpu-bench
export BURN_GEMMA_CACHE=/tmp/bgcache
LCPP=/tmp/lcpp; GGUF=/tmp/gguf; mkdir -p $LCPP $GGUF
f=$GGUF/g4-31b-Q8_0.gguf
tar xzf $here/kit/llama.cpp-src.tgz -C $LCPP ./gguf-py 2>/dev/null || tar xzf $here/kit/llama.cpp-src.tgz -C $LCPP
PYTHONPATH=$LCPP/gguf-py python3 $here/gen_gguf4.py 31b $here/kit/gemma3-vocab.json.gz $f > $OUT/gen.txt 2>&1 || { echo "gen failed"; tail -3 $OUT/gen.txt; }
gzip -dc $here/bench.gz > /tmp/bench && chmod +x /tmp/bench
date
/tmp/bench --model $f --backend cuda --dtype bf16 --weights native --prompt-len 512 --gen 1 --reps 1 > $OUT/plain.txt 2>&1
grep -h "^JSON" $OUT/plain.txt | cut -c1-300; date
ncu --csv --print-units base --metrics gpu__time_duration.sum --clock-control none --cache-control none \
  --log-file /tmp/ncu-31b.csv /tmp/bench --model $f --backend cuda --dtype bf16 --weights native --prompt-len 512 --gen 1 --reps 1 > $OUT/ncu-run.txt 2>&1
echo "ncu rc $?"; date
gzip -c /tmp/ncu-31b.csv > $OUT/ncu-31b.csv.gz
python3 $here/prefill_profile.py /tmp/ncu-31b.csv --label "31B Q8_0 pp512" > $OUT/prefill-profile.md; head -24 $OUT/prefill-profile.md
