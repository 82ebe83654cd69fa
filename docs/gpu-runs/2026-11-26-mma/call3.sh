#!/usr/bin/env bash
# Call 3: kernel tests (the mma kernel, quantized and GELU products through `project`, bf16/f16),
# the 4B step alone by rows and the engine by streams with our Q4 and Q8 (quantized at load
# from the F16 file), then the batched products by graph replay (4B shapes).
set -u
here=$PWD/.gpu-bench
mkdir -p /tmp/lcpp /tmp/gguf
cd /tmp
for b in ktests kernel_bench serve_bench; do gzip -dc $here/$b.gz > /tmp/$b && chmod +x /tmp/$b; done
tar xzf $here/kit/llama.cpp-src.tgz -C /tmp/lcpp --wildcards '*gguf-py*'
(PYTHONPATH=$(dirname $(find /tmp/lcpp -type d -name gguf-py | head -1))/gguf-py python3 $here/kit/gen_gguf.py 4b $here/kit/gemma3-vocab.json.gz /tmp/gguf/4b-F16.gguf > $OUT/gen.txt 2>&1; echo "gen rc $?" >> $OUT/gen.txt) &
date
/tmp/ktests --test-threads 1 mma_matches_reference quantized_matches_host project_gelu_pairs_matches_host > $OUT/kernel-tests.txt 2>&1
echo "kernel tests rc $?"; grep -E "test result|FAILED|panicked" $OUT/kernel-tests.txt | head; date
wait; tail -1 $OUT/gen.txt
for w in q4 q8; do
  /tmp/serve_bench --model /tmp/gguf/4b-F16.gguf --backend cuda --dtype bf16 --weights $w --step-only --streams 1,2,3,4,8,9,16,32,64 --prompt-len 512 > $OUT/step-$w.txt 2>&1
  echo "step $w rc $?"; grep "^step" $OUT/step-$w.txt; date
done
/tmp/serve_bench --model /tmp/gguf/4b-F16.gguf --backend cuda --dtype bf16 --weights q4 --streams 1,8,32,64 --prompt-len 512 --gen 128 --reps 1 > $OUT/engine-q4.txt 2>&1
echo "engine q4 rc $?"; grep "^streams" $OUT/engine-q4.txt; date
timeout 120 /tmp/kernel_bench --backend cuda --dtype bf16 --section batched --models 4b --rows 1,2,3,4,8,16,32,64 --reps 10 > $OUT/batched.txt 2>&1
echo "batched rc $?"; date
