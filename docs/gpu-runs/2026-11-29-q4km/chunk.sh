#!/bin/bash
# Keeps each carried chunk of the real 270M (.gpu-model-K/part, `scripts/bench-gpu.sh chunks`) in
# /tmp/model-parts/K on the warm machine; with `assemble`, joins chunks 1-9 and checks the file.
cd "$(dirname "$0")/../../.."
mkdir -p /tmp/model-parts
for d in .gpu-model-*; do [ -s "$d/part" ] && cp "$d/part" "/tmp/model-parts/${d#.gpu-model-}"; done
ls /tmp/model-parts | tr '\n' ' '; echo
if [ "${1:-}" = assemble ]; then
  cat /tmp/model-parts/{1,2,3,4,5,6,7,8,9} > /tmp/gemma3-270m-q4_k_m.gguf && sha256sum /tmp/gemma3-270m-q4_k_m.gguf
fi
