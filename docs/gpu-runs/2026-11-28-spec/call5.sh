#!/bin/bash
# GPU call 5 (issue 33): the blocked GEMM attention and the dispatcher's choice at 32,768 tokens
# (run as one command line from the repository root with `.gpu-bench/` carried).
cd .gpu-bench && gzip -dc kernel_bench.gz > /tmp/kb && chmod +x /tmp/kb
LT=$(find /usr/local /usr/lib -name 'libcublasLt.so*' 2>/dev/null | head -1); export LD_LIBRARY_PATH=$(dirname $LT)
timeout 120 /tmp/kb --backend cuda --section attention --tokens 32768 --attention-kernels blocked,auto --kv dense \
  --reps 3 > $OUT/attention-blocked.md 2>&1; echo "rc $?" >> $OUT/attention-blocked.md
