#!/bin/bash
# GPU call 5 (issue 37), nvidia-h200-x2: call 4's two-GPU run of Gemma 4 31B Q8_0 printed nothing
# for 170 s after loading. The same run (tp_bench with its symbols, two GPUs only), and where its
# threads are once it has run 100 s past its load (gdb if the image has it, else /proc).
set -u
cd "$(dirname "$0")/../../.."
here=$PWD/.gpu-bench
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
log() { echo "[$(date +%T)] $*" | tee -a $OUT/log.txt; }
LCPP=/tmp/lcpp; GGUF=/tmp/gguf; mkdir -p $LCPP $GGUF
[ -d $LCPP/gguf-py ] || tar xzf $here/kit/llama.cpp-src.tgz -C $LCPP
export PYTHONPATH=$LCPP/gguf-py
F=$GGUF/31b-Q8_0.gguf
[ -s $F ] || python3 $here/gen_gguf4.py 31b $here/kit/gemma3-vocab.json.gz $F q8_0 >> $OUT/log.txt 2>&1
log "file: $(ls -s $F)"
gzip -dc $here/tp_bench_syms.gz > /tmp/tp_bench_syms; chmod +x /tmp/tp_bench_syms
LT=$(find /usr/local /usr/lib -name 'libcublasLt.so*' 2>/dev/null | head -1)
NC=$(python3 -c "import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], 'lib'))" 2>/dev/null)
mkdir -p /tmp/ncclib; ln -sf $(ls $NC/libnccl.so* | head -1) /tmp/ncclib/libnccl.so
export LD_LIBRARY_PATH=$(dirname $LT):/tmp/ncclib:$NC
which gdb eu-stack >> $OUT/log.txt 2>&1
/tmp/tp_bench_syms --backend cuda --dtype bf16 --model $F --tensor-parallel 2 --prompt-len 512 --gen 64 --reps 2 > $OUT/ours.txt 2> $OUT/ours.err &
pid=$!
for i in $(seq 1 220); do
  sleep 1
  kill -0 $pid 2>/dev/null || break
  if grep -q loaded $OUT/ours.err && [ -z "${loaded:-}" ]; then loaded=$i; log "loaded at $i s"; fi
  if [ -n "${loaded:-}" ] && [ $i -ge $((loaded + 100)) ]; then
    log "still running 100 s after the load: stacks"
    if command -v gdb > /dev/null; then
      timeout 60 gdb -p $pid -batch -ex "thread apply all bt 25" > $OUT/stacks.txt 2>&1
    else
      for t in /proc/$pid/task/*; do echo "== $t $(cat $t/comm) $(cat $t/wchan)"; cat $t/stack 2>/dev/null | head -5; done > $OUT/stacks.txt
    fi
    nvidia-smi --query-gpu=index,utilization.gpu,memory.used --format=csv >> $OUT/stacks.txt
    kill $pid; break
  fi
done
wait $pid; echo "rc $?" >> $OUT/ours.txt
cat $OUT/ours.txt | cut -c1-400; tail -3 $OUT/ours.err | cut -c1-300
grep -E "^Thread|^#[0-9]+ " $OUT/stacks.txt | grep -vE " in (syscall|__futex|futex_wait|pthread_cond|std::sys::.*futex)" | cut -c1-220 | head -60
tail -4 $OUT/stacks.txt
