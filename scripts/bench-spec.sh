#!/usr/bin/env bash
# Speculative decoding's speed: the generate example with and without drafts on the prompts of
# scripts/spec-prompts (copying a passage, editing code, free text), REPS runs each, medians,
# and whether the greedy text with drafts is the text without, byte for byte.
#
#   scripts/bench-spec.sh [generate arguments ...]      e.g. --model m.gguf --backend cuda
#
# DRAFT: the drafting arguments (default "--draft ngram"); REPS (3); TOKENS (128);
# GENERATE: the executable (default target/release/examples/generate, built if missing);
# OUT: where logs and texts go (default bench-spec-out).
set -euo pipefail
cd "$(dirname "$0")/.."
draft=${DRAFT:---draft ngram}
reps=${REPS:-3}
tokens=${TOKENS:-128}
out=${OUT:-bench-spec-out}
generate=${GENERATE:-target/release/examples/generate}
[ -x "$generate" ] || cargo build --release --example generate
mkdir -p "$out"
: > "$out/runs.txt"
for prompt in scripts/spec-prompts/*.txt; do
  name=$(basename "$prompt" .txt)
  for mode in plain drafted; do
    for r in $(seq "$reps"); do
      extra=()
      # shellcheck disable=SC2206 # the drafting arguments split on spaces
      [ "$mode" = drafted ] && extra=($draft)
      "$generate" "$@" --chat --prompt "$(cat "$prompt")" --max-new-tokens "$tokens" "${extra[@]}" \
        > "$out/$name-$mode-$r.txt" 2> "$out/$name-$mode-$r.err"
      echo "$name $mode $r $(tail -1 "$out/$name-$mode-$r.err")" >> "$out/runs.txt"
    done
  done
done
python3 - "$out" "$reps" <<'PY' | tee "$out/table.md"
import re, statistics, sys, pathlib
out, reps = pathlib.Path(sys.argv[1]), int(sys.argv[2])
rows = {}
for line in open(out / "runs.txt"):
    name, mode, rep, stats = line.split(" ", 3)
    speed = re.search(r"decode: ([0-9.]+) tok/s", stats)
    spec = re.search(r"speculative: (\d+)/(\d+) drafts accepted \(\d+%\), ([0-9.]+) tokens per model step", stats)
    entry = rows.setdefault(name, {"plain": [], "drafted": [], "spec": None})
    entry[mode].append(float(speed.group(1)) if speed else float("nan"))
    if spec:
        entry["spec"] = spec.groups()
print("| prompt | decode tok/s without | with drafts | speed-up | drafts kept | tokens per model step | same text |")
print("| --- | ---: | ---: | ---: | ---: | ---: | --- |")
for name, e in rows.items():
    plain, drafted = statistics.median(e["plain"]), statistics.median(e["drafted"])
    kept, drafts, per_step = e["spec"] or ("0", "0", "-")
    same = all((out / f"{name}-plain-1.txt").read_bytes() == (out / f"{name}-{m}-{r}.txt").read_bytes()
               for m in ("plain", "drafted") for r in range(1, reps + 1))
    print(f"| {name} | {plain:.2f} | {drafted:.2f} | {drafted / plain:.2f}x | {kept}/{drafts} | {per_step} | {'yes' if same else 'NO'} |")
PY
