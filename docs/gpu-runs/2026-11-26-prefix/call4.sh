#!/usr/bin/env bash
# Call 4 (right after call 3): llama-server -np 64 under the same load as call 2, with as many
# HTTP threads as clients (its default, one fewer than the cores, serves 15 streams at once).
set -u
LCPP=/tmp/lcpp; GGUF=/tmp/gguf; f=$GGUF/4b-Q4_K_M.gguf
export LD_LIBRARY_PATH=$LCPP/build/bin
load() { python3 scripts/serve_load.py --url http://127.0.0.1:$1 --streams $2 --requests $3 --prompt-words 512 --max-tokens 128 --label "$4"; }
up() { python3 -c 'import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=2)' "$1" 2>/dev/null; }
wait_up() { for i in $(seq 1 240); do up http://127.0.0.1:$1/health && return 0; sleep 0.5; done; return 1; }
$LCPP/build/bin/llama-server -m $f -ngl 99 -np 64 -c 65536 -fa on --threads-http 80 --host 127.0.0.1 --port 8081 > $OUT/llama-server-http80.txt 2>&1 &
ll=$!
wait_up 8081; echo "llama-server up rc $?"; date
load 8081 8 8 warmup > /dev/null
for n in 8 32 64; do load 8081 $n $((3 * n)) llama-server-http80 | tee -a $OUT/server-load-http80.txt; done
kill -INT $ll; wait $ll; echo "llama-server stopped rc $?"; date
