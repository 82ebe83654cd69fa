#!/usr/bin/env python3
"""Where a prompt's time goes, from an Nsight Compute trace of examples/bench.

The trace holds every launch of a short run (ncu --metrics gpu__time_duration.sum). One sampling
kernel ends each forward pass, so the launches between two sampling kernels are one pass; the
pass of --min launches or more with the most kernel time is the prompt (a decode step replayed as a
CUDA graph also has hundreds of launches, so the last long pass may be one). Prints its kernel time by kernel name,
largest first (each kernel timed alone: no launch gaps, no host work).

usage: prefill_profile.py TRACE.csv [--marker sample_kernel] [--min 200] [--label L]
"""
import argparse
import collections

from decode_profile import read_trace, short


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("trace")
    ap.add_argument("--marker", default="sample_kernel")
    ap.add_argument("--min", type=int, default=200)
    ap.add_argument("--label", default="")
    a = ap.parse_args()
    trace = read_trace(a.trace)
    passes, current = [], []
    for name, seconds in trace:
        current.append((name, seconds))
        if a.marker in name:
            passes.append(current)
            current = []
    prompts = [p for p in passes if len(p) >= a.min]
    if not prompts:
        raise SystemExit(f"no pass of {a.min} launches or more among {len(passes)} in {len(trace)} launches")
    prompt = max(prompts, key=lambda p: sum(s for _, s in p))
    total = sum(s for _, s in prompt)
    by_name = collections.defaultdict(lambda: [0, 0.0])
    for name, seconds in prompt:
        by_name[short(name)][0] += 1
        by_name[short(name)][1] += seconds
    print(f"## {a.label}: one prompt pass, {len(prompt)} launches, {total * 1e3:.2f} ms of kernel time\n")
    print("| kernel | launches | ms | share |")
    print("|---|---:|---:|---:|")
    for name, (n, s) in sorted(by_name.items(), key=lambda kv: -kv[1][1]):
        print(f"| `{name}` | {n} | {s * 1e3:.3f} | {100 * s / total:.1f}% |")


if __name__ == "__main__":
    main()
