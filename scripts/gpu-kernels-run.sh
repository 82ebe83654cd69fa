#!/usr/bin/env bash
# Runs on the CUDA machine (copied to .gpu-run/run.sh by gpu-kernels-build.sh): kernel tests in
# f32 and bf16, tiny fixtures + random Gemma 3 1B-shaped model through CUDA against the CPU, and
# the kernel bandwidth table in bf16 and f32, and pp512/tg128 of synthetic 270M/1B/4B in bf16. Results go to $OUT (default ./gpu-out).
set -u
cd "$(dirname "$0")"
OUT=${OUT:-$PWD/gpu-out}; mkdir -p "$OUT"
bin=/tmp/burn-gemma-gpu; mkdir -p $bin
for f in bench kernel_bench kernel_tests integration; do gzip -dc $f.gz > $bin/$f; chmod +x $bin/$f; done
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.memory --format=csv > "$OUT/gpu.txt" 2>&1
export BURN_GEMMA_FIXTURES=$PWD/fixtures
$bin/kernel_tests --test-threads=1 --nocapture > "$OUT/kernel_tests.txt" 2>&1; echo "kernel_tests rc=$?" >> "$OUT/summary.txt"
$bin/integration --test-threads=1 --nocapture --exact $($bin/integration --list 2>/dev/null | sed -n "s/^\(tiny_models::.*cuda.*\): test$/\1/p") > "$OUT/tiny_models.txt" 2>&1; echo "tiny_models rc=$?" >> "$OUT/summary.txt"
$bin/kernel_bench --backend cuda --dtype bf16 --reps 30 > "$OUT/bench_bf16.txt" 2>&1; echo "bench bf16 rc=$?" >> "$OUT/summary.txt"
$bin/kernel_bench --backend cuda --dtype f32 --reps 30 > "$OUT/bench_f32.txt" 2>&1; echo "bench f32 rc=$?" >> "$OUT/summary.txt"
for m in gemma3-270m gemma3-1b gemma3-4b; do
  $bin/bench --model synthetic:$m --backend cuda --dtype bf16 --prompt-len 512 --gen 128 --reps 3 >> "$OUT/bench.txt" 2>&1
  echo "bench $m rc=$?" >> "$OUT/summary.txt"
done
cat "$OUT/summary.txt"; grep -hE "test result|FAILED" "$OUT/kernel_tests.txt" "$OUT/tiny_models.txt"
