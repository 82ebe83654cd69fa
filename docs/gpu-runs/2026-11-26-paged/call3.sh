#!/usr/bin/env bash
# Call 3 (same machine as calls 1-2): the paged kernels split a slot by a shift and a mask
# (blocks of a power of two) instead of a division: the kernel tests again (f32, bf16), the 4B
# step rows vs paged, and the engine on 4B Q4_K_M (1, 8, 32, 64 streams).
set -u
here=$PWD/.gpu-bench
unxz() { xz -dc "$1" 2>/dev/null || python3 -c 'import lzma,shutil,sys; shutil.copyfileobj(lzma.open(sys.argv[1]), sys.stdout.buffer)' "$1"; }
for b in ktests serve_bench; do unxz $here/$b.xz > /tmp/$b && chmod +x /tmp/$b; done
export BURN_GEMMA_TEST_SEED=20261126
f=/tmp/gguf/4b-Q4_K_M.gguf
/tmp/serve_bench --model $f --backend cuda --dtype bf16 --weights native --step-only --streams 1,8,32,64 --prompt-len 512 > $OUT/step-q4.txt 2>&1
echo "step rc $?"; grep "^step" $OUT/step-q4.txt; date
/tmp/serve_bench --model $f --backend cuda --dtype bf16 --weights native --streams 1,8,32,64 --prompt-len 512 --gen 128 --reps 1 > $OUT/ours-4b-Q4_K_M.txt 2>&1
echo "ours rc $?"; grep "^streams" $OUT/ours-4b-Q4_K_M.txt; date
/tmp/ktests --test-threads 1 decode_per_sequence qkv_rope_append decode_at_position > $OUT/kernel-tests.txt 2>&1
echo "kernel tests rc $?"; grep -E "test result|FAILED|panicked" $OUT/kernel-tests.txt | head; date
