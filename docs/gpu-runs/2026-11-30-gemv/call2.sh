#!/bin/bash
# Call 2: where the quantized GEMV's instructions go. Tools present; the CUDA source CubeCL
# generates (1B decode shapes); ncu per-launch metrics of every qgemv launch of the 12B decode
# table; ncu SASS-level counts of launch 896 (12B q4 gate|up, 1 row, if the order holds).
set -u
cd "$(dirname "$0")"
for b in kernel_bench; do [ -f /tmp/$b ] || { gzip -dc $b.gz > /tmp/$b; chmod +x /tmp/$b; }; done
LT=$(find /usr/local /usr/lib -name 'libcublasLt.so*' 2>/dev/null | head -1); export LD_LIBRARY_PATH=$(dirname $LT)
(which nvcc cuobjdump nvdisasm ncu; ncu --version; ls /usr/local/cuda*/bin 2>/dev/null | head -40) > $OUT/tools.txt 2>&1
CUBECL_DEBUG_LOG=$OUT/cubecl-1b.log timeout 100 /tmp/kernel_bench --backend cuda --dtype bf16 --section decode --models 1b --reps 1 > $OUT/kb-1b.txt 2>&1
echo "log rc $?"; ls -la $OUT
M=gpu__time_duration.sum,dram__bytes_read.sum,smsp__inst_executed.sum,smsp__issue_active.avg.pct_of_peak_sustained_active,sm__warps_active.avg.pct_of_peak_sustained_active,launch__grid_size,launch__block_size,launch__registers_per_thread,smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio,smsp__average_warps_issue_stalled_wait_per_issue_active.ratio,smsp__average_warps_issue_stalled_math_pipe_throttle_per_issue_active.ratio,smsp__average_warps_issue_stalled_not_selected_per_issue_active.ratio,smsp__average_warps_issue_stalled_lg_throttle_per_issue_active.ratio,smsp__average_warps_issue_stalled_short_scoreboard_per_issue_active.ratio,smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio,smsp__average_warps_issue_stalled_no_instruction_per_issue_active.ratio,smsp__average_warps_issue_stalled_selected_per_issue_active.ratio,smsp__average_warps_issue_stalled_drain_per_issue_active.ratio,smsp__average_warps_issue_stalled_dispatch_stall_per_issue_active.ratio,smsp__average_warps_issue_stalled_imc_miss_per_issue_active.ratio,launch__occupancy_limit_registers
timeout 250 ncu --csv --print-units base --clock-control none --metrics $M -k regex:qgemv --launch-count 1300 --log-file $OUT/ncu-12b.csv \
  /tmp/kernel_bench --backend cuda --dtype bf16 --section decode --models 12b --reps 1 > $OUT/kb-12b-ncu.txt 2>&1
echo "ncu rc $?"
timeout 120 ncu --csv --print-units base --clock-control none --section SourceCounters --page source --print-source sass -k regex:qgemv --launch-skip 896 --launch-count 1 --log-file $OUT/ncu-sass.csv \
  /tmp/kernel_bench --backend cuda --dtype bf16 --section decode --models 12b --reps 1 > /dev/null 2>&1
echo "sass rc $?"; ls -la $OUT
