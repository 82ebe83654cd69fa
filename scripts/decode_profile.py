#!/usr/bin/env python3
"""Where a decode token's time goes, from an Nsight Compute trace of examples/bench.

The trace covers a window of consecutive kernel launches in the middle of a run of single-token
forwards (ncu --launch-skip/--launch-count: profiling every launch of a whole run takes far too
long). One sampling kernel ends every token, so the launches between the first and the last
sampling kernel of the window are whole decode steps: their count and summed GPU time
(gpu__time_duration.sum, which times each kernel alone: no launch gaps, no host work) divided by
the number of steps give one token's launches and kernel time.

With --ours (our bench's log holding the same model's tg run) the kernel time is set against the
measured wall time per token and the host time spent issuing a token's work (`host_ms_per_token`):
wall - kernels = time the GPU sits idle between kernels.

usage: decode_profile.py TRACE.csv [--marker sample_kernel] [--label L] [--ours ours.txt --model M]
"""
import argparse
import collections
import csv
import json
import re

UNITS = {"ns": 1e-9, "nsecond": 1e-9, "us": 1e-6, "usecond": 1e-6, "ms": 1e-3, "msecond": 1e-3, "s": 1.0, "second": 1.0}


def kernels(path):
    """Per kernel name: (launches, seconds)."""
    out = collections.defaultdict(lambda: [0, 0.0])
    with open(path, newline="") as f:
        rows = [line for line in f if line.startswith('"')]
    for row in csv.DictReader(rows):
        if row.get("Metric Name") != "gpu__time_duration.sum":
            continue
        value = float(row["Metric Value"].replace(",", ""))
        name = row["Kernel Name"]
        out[name][0] += 1
        out[name][1] += value * UNITS[row["Metric Unit"]]
    return out


def short(name):
    name = re.sub(r"<.*", "", name)  # template arguments
    name = re.sub(r"\(.*", "", name)
    return name[:70]


def read_trace(path):
    """(kernel name, seconds) in launch order."""
    with open(path, newline="") as f:
        rows = [line for line in f if line.startswith('"')]
    out = []
    for row in csv.DictReader(rows):
        if row.get("Metric Name") == "gpu__time_duration.sum":
            out.append((row["Kernel Name"], float(row["Metric Value"].replace(",", "")) * UNITS[row["Metric Unit"]]))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("trace")
    ap.add_argument("--marker", default="sample_kernel", help="name of the kernel that ends each token")
    ap.add_argument("--label", default="")
    ap.add_argument("--ours", help="our bench log (JSON lines) to take wall and host time from")
    ap.add_argument("--model", help="model as given to our bench")
    args = ap.parse_args()
    trace = read_trace(args.trace)
    marks = [i for i, (name, _) in enumerate(trace) if args.marker in name]
    if len(marks) < 2:
        raise SystemExit(f"{args.trace}: fewer than two `{args.marker}` launches in {len(trace)} kernels")
    steps = len(marks) - 1
    window = trace[marks[0] + 1 : marks[-1] + 1]
    per = collections.defaultdict(lambda: [0.0, 0.0])
    for name, secs in window:
        per[name][0] += 1 / steps
        per[name][1] += secs / steps
    grouped = collections.defaultdict(lambda: [0.0, 0.0])
    for name, (launches, secs) in per.items():
        grouped[short(name)][0] += launches
        grouped[short(name)][1] += secs
    total_launches = sum(v[0] for v in per.values())
    total_ms = sum(v[1] for v in per.values()) * 1e3
    print(f"## Decode profile: {args.label}")
    print()
    print(f"{steps} whole decode steps in the traced window; per token: {total_launches:.0f} kernel launches, {total_ms:.3f} ms of kernel time (sum of ncu gpu__time_duration)")
    if args.ours and args.model:
        runs = []
        with open(args.ours) as f:
            for line in f:
                if line.startswith("JSON "):
                    r = json.loads(line[5:])
                    if r["model"] == args.model and r["depth"] == 0 and r["prompt_len"] > 1:
                        runs.append(r)
        if runs:
            r = runs[-1]
            wall = 1e3 / r["tg"]
            host = r["host_ms_per_token"]
            print(f"measured (same model, tg{r['gen']}, no profiler): wall {wall:.3f} ms/token; host time issuing the token's work {host:.3f} ms/token")
            print(f"GPU busy {total_ms:.3f} ms = {100 * total_ms / wall:.0f}% of the wall time; idle between kernels {wall - total_ms:.3f} ms "
                  f"({1e3 * (wall - total_ms) / max(total_launches, 1):.1f} us per launch)")
            print(f"host issue time per launch: {1e3 * host / max(total_launches, 1):.1f} us")
    print()
    print("| kernel | launches/token | ms/token | share |")
    print("| --- | ---: | ---: | ---: |")
    for name, (launches, secs) in sorted(grouped.items(), key=lambda kv: -kv[1][1])[:15]:
        print(f"| `{name}` | {launches:.0f} | {secs * 1e3:.3f} | {100 * secs * 1e3 / total_ms:.1f}% |")
    print()


if __name__ == "__main__":
    main()
