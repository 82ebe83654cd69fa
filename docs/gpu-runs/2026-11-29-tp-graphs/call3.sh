#!/bin/bash
# GPU call 3 (issue 37), nvidia-h200-x2: Gemma 3 27B Q8_0 (random weights, gen_gguf4.py g3-27b,
# one file for both programs) on two GPUs and one: ours (tp_bench, graphs, the file's Q8_0 blocks
# as q8) beside llama.cpp's llama-bench with --split-mode none / layer / row (flash attention on,
# every layer on the GPUs), 512-token prompt and 64 generated tokens, 2 reps. llama.cpp builds in
# the background (nice 19) while the file is written and ours runs.
set -u
cd "$(dirname "$0")/../../.."
here=$PWD/.gpu-bench
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
log() { echo "[$(date +%T)] $*" | tee -a $OUT/log.txt; }
LCPP=/tmp/lcpp; GGUF=/tmp/gguf; mkdir -p $LCPP $GGUF
tar xzf $here/kit/llama.cpp-src.tgz -C $LCPP
export PYTHONPATH=$LCPP/gguf-py
(cd $LCPP && cmake -B build -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DLLAMA_BUILD_TESTS=OFF \
   -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_CURL=OFF -DLLAMA_BUILD_SERVER=OFF > $OUT/llama-build.txt 2>&1 &&
   nice -n 19 cmake --build build -j24 --target llama-bench >> $OUT/llama-build.txt 2>&1; echo "build rc $?" >> $OUT/llama-build.txt) &
builder=$!
F=$GGUF/g3-27b-Q8_0.gguf
log "writing $F"
python3 $here/gen_gguf4.py g3-27b $here/kit/gemma3-vocab.json.gz $F q8_0 >> $OUT/log.txt 2>&1
log "written: $(ls -s $F)"
gzip -dc $here/tp_bench.gz > /tmp/tp_bench; chmod +x /tmp/tp_bench
LT=$(find /usr/local /usr/lib -name 'libcublasLt.so*' 2>/dev/null | head -1)
NC=$(python3 -c "import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], 'lib'))" 2>/dev/null)
mkdir -p /tmp/ncclib; ln -sf $(ls $NC/libnccl.so* | head -1) /tmp/ncclib/libnccl.so
export LD_LIBRARY_PATH=$(dirname $LT):/tmp/ncclib:$NC
log "ours"
timeout 240 /tmp/tp_bench --backend cuda --dtype bf16 --model $F --tensor-parallel 2,1 --prompt-len 512 --gen 64 --reps 2 > $OUT/ours.txt 2> $OUT/ours.err; echo "rc $?" >> $OUT/ours.txt
cat $OUT/ours.txt | cut -c1-400; grep -vE "^\s*$" $OUT/ours.err | tail -3 | cut -c1-300
log "waiting for llama.cpp"
wait $builder; tail -1 $OUT/llama-build.txt
export LD_LIBRARY_PATH=$LCPP/build/bin:$LD_LIBRARY_PATH
for sm in none layer row; do
  log "llama-bench -sm $sm"
  timeout 150 $LCPP/build/bin/llama-bench -m $F -p 512 -n 64 -fa 1 -ngl 99 -r 2 -sm $sm -mg 0 -o md >> $OUT/llama.md 2>> $OUT/llama.err
done
cat $OUT/llama.md; grep -iE "error|fail" $OUT/llama.err | head -5
log "done"
