#!/bin/bash
# GPU call 1 (carries .gpu-bench): llama.cpp built and the Gemma 3 files written (1B, 4B, 12B;
# Q4_K_M and Q8_0, gen_gguf4.py g3-*) in the background; on the GPU meanwhile, where a decode
# token's time goes (ncu per kernel: time, DRAM bytes, issue activity, occupancy) on synthetic
# 1B, 4B, 27B and Gemma 4 31B with q4 weights, one table each (scripts/kernel_bandwidth.py).
set -u
cd "$(dirname "$0")/../../.."
for b in bench; do gzip -dc .gpu-bench/$b.gz > /tmp/burn-gemma-${b//_/-}; chmod +x /tmp/burn-gemma-${b//_/-}; done
LT=$(find /usr/local /usr/lib -name 'libcublasLt.so*' 2>/dev/null | head -1); export LD_LIBRARY_PATH=$(dirname $LT)
mkdir -p /tmp/gpy && tar xzf .gpu-bench/kit/llama.cpp-src.tgz -C /tmp/gpy --wildcards './gguf-py/*'
(bash .gpu-bench/bench-gpu.sh llama > $OUT/build-llama.txt 2>&1; echo "rc $?" >> $OUT/build-llama.txt) &
(PYTHONPATH=/tmp/gpy/gguf-py G3MODELS="1b 4b 12b" G3QUANTS="Q4_K_M Q8_0" /usr/bin/time -v bash .gpu-bench/bench-gpu.sh prepare3 \
  > $OUT/prepare3.txt 2>&1; echo "rc $?" >> $OUT/prepare3.txt) &
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,clocks.max.mem,memory.total --format=csv > $OUT/env.txt
M=gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum,smsp__issue_active.avg.pct_of_peak_sustained_active,sm__warps_active.avg.pct_of_peak_sustained_active,launch__registers_per_thread,launch__grid_size,launch__block_size
for spec in gemma3-1b:26 gemma3-4b:34 gemma3-27b:62 gemma4-31b:60; do
  m=${spec%%:*}; L=${spec##*:}
  timeout 170 ncu --csv --print-units base --clock-control none --metrics $M --launch-skip $((40 * L)) --launch-count $((20 * L)) \
    --log-file /tmp/ncu-$m.csv /tmp/burn-gemma-bench --model synthetic:$m --backend cuda --dtype bf16 --weights q4 \
    --prompt-len 1 --gen 64 --reps 1 > $OUT/ncu-$m-run.txt 2>&1; echo "rc $?" >> $OUT/ncu-$m-run.txt
  python3 .gpu-bench/kernel_bandwidth.py /tmp/ncu-$m.csv > $OUT/kernels-$m.md 2>&1
  gzip -c /tmp/ncu-$m.csv > $OUT/ncu-$m.csv.gz
  head -3 $OUT/kernels-$m.md
done
wait
tail -3 $OUT/build-llama.txt; grep -E "Elapsed|rc " $OUT/prepare3.txt; ls -la /tmp/gguf; df -h /tmp | tail -1
