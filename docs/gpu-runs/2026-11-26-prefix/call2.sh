#!/usr/bin/env bash
# Call 2 (right after call 1): the OpenAI-compatible servers under the same load script
# (scripts/serve_load.py: N clients at once, streamed /v1/completions, prompts of 512 random
# words, 128 tokens greedy, 3 x N requests): ours (examples/serve) and llama-server -np 64 on
# the same 4B Q4_K_M file, at 8, 32 and 64 clients. One warm-up run of 8 requests each.
set -u
LCPP=/tmp/lcpp; GGUF=/tmp/gguf; f=$GGUF/4b-Q4_K_M.gguf
export LD_LIBRARY_PATH=$LCPP/build/bin
load() { python3 scripts/serve_load.py --url http://127.0.0.1:$1 --streams $2 --requests $3 --prompt-words 512 --max-tokens 128 --label "$4"; }
up() { python3 -c 'import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=2)' "$1" 2>/dev/null; }
wait_up() { for i in $(seq 1 240); do up http://127.0.0.1:$1/health && return 0; sleep 0.5; done; return 1; }
/tmp/serve --model $f --backend cuda --dtype bf16 --weights native --port 8080 --max-running 64 --max-sequence-len 1024 > $OUT/ours-server.txt 2>&1 &
ours=$!
wait_up 8080; echo "ours up rc $?"; date
load 8080 8 8 warmup > /dev/null
for n in 8 32 64; do load 8080 $n $((3 * n)) ours | tee -a $OUT/server-load.txt; done
python3 -c 'import urllib.request; print(urllib.request.urlopen("http://127.0.0.1:8080/metrics").read().decode())' > $OUT/ours-metrics.txt
kill -INT $ours; wait $ours; echo "ours stopped rc $?"; date
$LCPP/build/bin/llama-server -m $f -ngl 99 -np 64 -c 65536 -fa on --host 127.0.0.1 --port 8081 > $OUT/llama-server.txt 2>&1 &
ll=$!
wait_up 8081; echo "llama-server up rc $?"; date
load 8081 8 8 warmup > /dev/null
for n in 8 32 64; do load 8081 $n $((3 * n)) llama-server | tee -a $OUT/server-load.txt; done
kill -INT $ll; wait $ll; echo "llama-server stopped rc $?"; date
