#!/bin/bash
# Call 3: the quantized GEMV's SASS. CubeCL's CUDA source of the qgemv kernels (a synthetic 270M
# decode, q4 then q8), compiled by nvcc for sm_90 and disassembled; ncu's per-instruction counts
# of one 12B q4 gate|up launch.
set -u
cd "$(dirname "$0")"
for b in bench kernel_bench; do [ -f /tmp/$b ] || { gzip -dc $b.gz > /tmp/$b; chmod +x /tmp/$b; }; done
LT=$(find /usr/local /usr/lib -name 'libcublasLt.so*' 2>/dev/null | head -1); export LD_LIBRARY_PATH=$(dirname $LT)
export BURN_GEMMA_CACHE=/tmp/cache-ab
for w in q4 q8; do
CUBECL_DEBUG_LOG=/tmp/cubecl-$w.log timeout 100 /tmp/bench --model synthetic:gemma3-270m --backend cuda --dtype bf16 --weights $w --prompt-len 8 --gen 8 --reps 1 > $OUT/bench-$w.txt 2>&1
echo "bench $w rc $?"
python3 - /tmp/cubecl-$w.log $OUT/qgemv-$w <<'PY'
import sys,re
text=open(sys.argv[1]).read()
blocks=text.split('[START_KERNEL_COMPILATION]')
n=0
for b in blocks:
    if 'qgemv_kernel' not in b: continue
    m=re.search(r'```cpp\n(.*?)```',b,re.S)
    if not m: continue
    open(f"{sys.argv[2]}-{n}.cu","w").write(m.group(1)); n+=1
print(sys.argv[1], n, "qgemv sources")
PY
done
for f in $OUT/qgemv-*.cu; do
  nvcc -cubin -arch=sm_90 -O3 -I/usr/local/cuda/include -o /tmp/k.cubin $f > ${f%.cu}.nvcc.txt 2>&1 && cuobjdump -sass /tmp/k.cubin > ${f%.cu}.sass && cuobjdump -res-usage /tmp/k.cubin >> ${f%.cu}.nvcc.txt 2>&1
  echo "$f rc $?"
done
timeout 150 ncu --csv --print-units base --clock-control none --section SourceCounters --page source --print-source sass -k regex:qgemv --launch-skip 448 --launch-count 1 --log-file $OUT/ncu-sass.csv \
  /tmp/kernel_bench --backend cuda --dtype bf16 --section decode --models 12b --reps 1 > /dev/null 2>&1
echo "sass rc $?"; ls -la $OUT | head -40
