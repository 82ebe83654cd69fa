#!/bin/sh
cd /tmp/fresh11/burn-gemma
export HOME=/tmp/fresh11/home RUSTUP_HOME=/root/.rustup CARGO_HOME=/root/.cargo XDG_RUNTIME_DIR=/tmp
s=$(date +%s)
cargo run --release --example generate -- --prompt "The capital of France is" > /tmp/fresh11/gen.out 2> /tmp/fresh11/gen.err
echo "generate rc $? in $(( $(date +%s) - s )) s" > /tmp/fresh11/status
s=$(date +%s)
cargo test --release --workspace --features wgpu,server > /tmp/fresh11/test.out 2>&1
echo "tests rc $? in $(( $(date +%s) - s )) s" >> /tmp/fresh11/status
