#!/usr/bin/env bash
# Call 2: 26B-A4B decode and pp512 side by side with llama.cpp on the same Q8_0 and Q4_K_M files.
set -u
here=$PWD/.gpu-bench
G4MODELS=26b-a4b G4QUANTS="Q8_0 Q4_K_M" REPS=3 bash $here/bench-gpu.sh gemma4 2>&1 | tail -20
grep -h "loaded in\|^JSON" $OUT/g4-ours.txt | cut -c1-600
