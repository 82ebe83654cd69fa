#!/bin/bash
# Call C (right after call B): the 12B Q4_K_M and the 1B/4B Q8_0 rows as in call B; then where
# a 12B token's time goes (ncu per kernel: time, DRAM bytes, issue activity; synthetic 12B, q4,
# one token after a 1-token prompt; scripts/kernel_bandwidth.py), with the GEMVs' instruction
# counts per weight.
set -u
cd "$(dirname "$0")"
QSTEMS=${QSTEMS:-"12b-Q4_K_M 1b-Q8_0 4b-Q8_0"} REPS=3 QDEPTHS="512 8192" timeout ${Q_LIMIT:-330} bash bench-gpu.sh quant > /dev/null 2>&1
tail -14 $OUT/quant.md 2>/dev/null; tail -3 $OUT/log.txt; date +%T
LT=$(find /usr/local /usr/lib -name 'libcublasLt.so*' 2>/dev/null | head -1); export LD_LIBRARY_PATH=$(dirname $LT)
M=gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum,smsp__issue_active.avg.pct_of_peak_sustained_active,sm__warps_active.avg.pct_of_peak_sustained_active,launch__registers_per_thread,launch__grid_size,launch__block_size,smsp__inst_executed.sum
L=48
timeout ${NCU_LIMIT:-200} ncu --csv --print-units base --clock-control none --metrics $M --launch-skip $((12 * L)) --launch-count $((20 * L)) \
  --log-file /tmp/ncu-12b.csv /tmp/burn-gemma-bench --model /tmp/gguf/12b-Q4_K_M.gguf --backend cuda --dtype bf16 \
  --prompt-len 1 --gen 8 --reps 1 > $OUT/ncu-12b-run.txt 2>&1; echo "rc $?" >> $OUT/ncu-12b-run.txt
python3 kernel_bandwidth.py /tmp/ncu-12b.csv > $OUT/kernels-12b.md 2>&1
gzip -c /tmp/ncu-12b.csv > $OUT/ncu-12b.csv.gz
head -30 $OUT/kernels-12b.md; tail -3 $OUT/ncu-12b-run.txt; date +%T
# The GEMV kernel tests again (call A's 170 s per seed ran out), one seed, more time.
LT=$(find /usr/local /usr/lib -name 'libcublasLt.so*' 2>/dev/null | head -1); export LD_LIBRARY_PATH=$(dirname $LT)
BURN_GEMMA_TEST_SEED=20261130 timeout ${KT_LIMIT:-200} /tmp/kernel_tests --test-threads 6 quant::check::gpu linear::gpu quant::kquant::check experts::gemv::gpu > $OUT/kernel-tests.txt 2>&1; echo "rc $?" >> $OUT/kernel-tests.txt
grep -E "^test |rc |test result|panicked" $OUT/kernel-tests.txt | head -20; date +%T
