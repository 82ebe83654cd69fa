#!/bin/bash
# GPU calls (issue 37), nvidia-h200-x2: a BF16 GGUF (random weights in the published shapes,
# gen_gguf4.py SIZE ... bf16, the type of the published checkpoints) read by both programs in one
# call: ours (tp_bench, bf16 weights and activations, decode replayed as CUDA graphs) on two GPUs,
# llama.cpp's llama-bench with --split-mode none / layer (flash attention on, every layer on the
# GPUs; its row split is refused by this build, 2026-11-29), then ours on one GPU with the time
# left. 512-token prompt, 64 generated tokens, medians of 2 after a warm-up. llama.cpp builds in
# the background (nice 19) while the file is written and ours runs, unless an earlier call of the
# same warm machine built it.
#   call.sh 31b | g3-27b
set -u
size=$1
cd "$(dirname "$0")/../../.."
here=$PWD/.gpu-bench
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
log() { echo "[$(date +%T) +${SECONDS}s] $*" | tee -a $OUT/log.txt; }
nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader > $OUT/env.txt
LCPP=/tmp/lcpp; GGUF=/tmp/gguf; mkdir -p $LCPP $GGUF
[ -d $LCPP/gguf-py ] || tar xzf $here/kit/llama.cpp-src.tgz -C $LCPP
export PYTHONPATH=$LCPP/gguf-py
if [ -x $LCPP/build/bin/llama-bench ]; then builder=""; echo "built by an earlier call" > $OUT/llama-build.txt; else
(cd $LCPP && cmake -B build -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DLLAMA_BUILD_TESTS=OFF \
   -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_CURL=OFF -DLLAMA_BUILD_SERVER=OFF > $OUT/llama-build.txt 2>&1 &&
   nice -n 19 cmake --build build -j24 --target llama-bench >> $OUT/llama-build.txt 2>&1; echo "build rc $?" >> $OUT/llama-build.txt) &
builder=$!; fi
rm -f $GGUF/*.gguf
F=$GGUF/$size-BF16.gguf
log "writing $F"
python3 $here/gen_gguf4.py $size $here/kit/gemma3-vocab.json.gz $F bf16 >> $OUT/log.txt 2>&1
log "written: $(ls -s $F); disk: $(df -h /tmp | tail -1)"
gzip -dc $here/tp_bench.gz > /tmp/tp_bench; chmod +x /tmp/tp_bench
LT=$(find /usr/local /usr/lib -name 'libcublasLt.so*' 2>/dev/null | head -1)
NC=$(python3 -c "import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], 'lib'))" 2>/dev/null)
mkdir -p /tmp/ncclib; ln -sf $(ls $NC/libnccl.so* | head -1) /tmp/ncclib/libnccl.so
export LD_LIBRARY_PATH=$(dirname $LT):/tmp/ncclib:$NC
ours() { # GPUs, time limit
  log "ours on $1 GPU(s), limit $2 s"
  timeout $2 /tmp/tp_bench --backend cuda --dtype bf16 --weights bf16 --model $F --tensor-parallel $1 \
    --prompt-len 512 --gen 64 --reps 2 --save-logits /tmp/logits-$size > $OUT/ours-$1gpu.txt 2> $OUT/ours-$1gpu.err
  echo "rc $?" >> $OUT/ours-$1gpu.txt
  cut -c1-400 $OUT/ours-$1gpu.txt; grep -vE "^\s*$" $OUT/ours-$1gpu.err | tail -3 | cut -c1-300
}
ours 2 280
log "waiting for llama.cpp"
[ -n "$builder" ] && wait $builder; tail -1 $OUT/llama-build.txt
for sm in none layer; do
  log "llama-bench -sm $sm"
  LD_LIBRARY_PATH=$LCPP/build/bin:$LD_LIBRARY_PATH timeout 90 $LCPP/build/bin/llama-bench -m $F -p 512 -n 64 -fa 1 -ngl 99 -r 2 -sm $sm -mg 0 -o md >> $OUT/llama.md 2>> $OUT/llama.err
done
cat $OUT/llama.md; grep -iE "error|fail" $OUT/llama.err | head -5
ours 1 $((585 - SECONDS))
python3 - /tmp/logits-$size <<'PY' | tee $OUT/compare.txt
import sys, numpy as np
p = sys.argv[1]
try:
    one = np.fromfile(f"{p}-1gpu.f32", dtype=np.float32); two = np.fromfile(f"{p}-2gpu.f32", dtype=np.float32)
    top = np.sort(one)[::-1]
    print(f"prompt logits, two GPUs against one: max |diff| {np.abs(one - two).max():.4f} (largest |logit| {np.abs(one).max():.2f}, one GPU's top-2 margin {top[0] - top[1]:.4f}), argmax {'same' if one.argmax() == two.argmax() else 'differs'}")
except (OSError, ValueError) as e:
    print(f"no comparison: {e}")
PY
log done
