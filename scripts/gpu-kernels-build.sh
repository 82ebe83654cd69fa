#!/usr/bin/env bash
# Builds (here, with a Rust toolchain) what scripts/gpu-kernels-run.sh runs on a CUDA machine
# without one: the kernel tests, the CUDA parity tests (tiny fixtures + random 1B-shaped model)
# the kernel bandwidth bench and the model bench, stripped and gzipped into .gpu-run/ with the tiny fixtures.
# Then, through the device tool: `bash .gpu-run/run.sh` with `.gpu-run` carried.
set -euo pipefail
cd "$(dirname "$0")/.."
fixtures=${BURN_GEMMA_FIXTURES:-tests/fixtures}
rm -rf .gpu-bin .gpu-run && mkdir -p .gpu-bin .gpu-run/fixtures
mkdir -p .git/info
grep -qxF "/.gpu-bin/" .git/info/exclude 2>/dev/null || echo "/.gpu-bin/" >> .git/info/exclude
grep -qxF "/.gpu-run/" .git/info/exclude 2>/dev/null || echo "/.gpu-run/" >> .git/info/exclude
cargo build --release --features cuda,tools --example kernel_bench --example bench
cp target/release/examples/kernel_bench target/release/examples/bench .gpu-bin/
test_exe() {
  cargo test --release --no-run "$@" --message-format=json 2>/dev/null | python3 -c '
import json, sys
for line in sys.stdin:
    try:
        m = json.loads(line)
    except ValueError:
        continue
    if m.get("reason") == "compiler-artifact" and m.get("executable"):
        print(m["executable"])' | tail -1
}
cp "$(test_exe -p burn-gemma-kernels --lib --features cuda)" .gpu-bin/kernel_tests
cp "$(test_exe -p burn-gemma --test integration --features cuda)" .gpu-bin/integration
strip .gpu-bin/*
for f in bench kernel_bench kernel_tests integration; do gzip -9 -c ".gpu-bin/$f" > ".gpu-run/$f.gz"; done
cp -r "$fixtures/tiny-gemma" .gpu-run/fixtures/
cp scripts/gpu-kernels-run.sh .gpu-run/run.sh
du -sh .gpu-run
