#!/usr/bin/env python3
"""Each decode kernel's time, DRAM bytes and share of the copy rate, from an Nsight Compute
trace of examples/bench taken with

  ncu --csv --print-units base --metrics gpu__time_duration.sum,dram__bytes_read.sum,\
dram__bytes_write.sum,smsp__issue_active.avg.pct_of_peak_sustained_active,\
sm__warps_active.avg.pct_of_peak_sustained_active,launch__grid_size,launch__block_size ...

over a window of decode launches (with smsp__inst_executed.sum among the metrics, each kernel's
warp instructions per launch too). One sampling kernel ends every token: the launches between
the first two are one token. Kernels are grouped by name, launch shape (grid x block) and the
megabytes they move, so the GEMVs of different matrices get a row each (also two matrices of one
launch shape stored in different formats, as a Q4_K_M file's Q4_K and Q6_K `down`s).

usage: kernel_bandwidth.py TRACE.csv [--copy-gbs 4200] [--marker sample_kernel]
"""
import argparse
import collections
import csv


def launches(path):
    """The trace's launches in order: (name, {metric: value})."""
    with open(path, newline="") as f:
        rows = [line for line in f if line.startswith('"')]
    by_id = collections.OrderedDict()
    for row in csv.DictReader(rows):
        value = row["Metric Value"].replace(",", "")
        try:
            value = float(value)
        except ValueError:
            pass
        by_id.setdefault(int(row["ID"]), (row["Kernel Name"], {}))[1][row["Metric Name"]] = value
    return [by_id[k] for k in sorted(by_id)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("trace")
    ap.add_argument("--copy-gbs", type=float, default=4200.0, help="the device's copy rate, GB/s")
    ap.add_argument("--marker", default="sample_kernel")
    a = ap.parse_args()
    trace = launches(a.trace)
    marks = [i for i, (name, _) in enumerate(trace) if name.startswith(a.marker)]
    if len(marks) < 2:
        raise SystemExit(f"{a.trace}: fewer than two {a.marker} launches: no whole token in the window")
    token = trace[marks[0] + 1 : marks[1] + 1]
    groups = collections.OrderedDict()
    for name, m in token:
        moved = m.get("dram__bytes_read.sum", 0.0) + m.get("dram__bytes_write.sum", 0.0)
        shape = (name.split("_f_")[0], int(m.get("launch__grid_size", 0)), int(m.get("launch__block_size", 0)))
        # Launches of one shape moving within 25% of a group's first launch join it.
        key = next((k for k in groups if k[:3] == shape and abs(moved - k[3]) <= 0.25 * max(k[3], 1e6)), shape + (moved,))
        g = groups.setdefault(key, {"n": 0, "s": 0.0, "bytes": 0.0, "issue": 0.0, "occ": 0.0, "inst": 0.0})
        g["n"] += 1
        g["s"] += m["gpu__time_duration.sum"] * 1e-9
        g["bytes"] += m.get("dram__bytes_read.sum", 0.0) + m.get("dram__bytes_write.sum", 0.0)
        g["issue"] += m.get("smsp__issue_active.avg.pct_of_peak_sustained_active", 0.0)
        g["occ"] += m.get("sm__warps_active.avg.pct_of_peak_sustained_active", 0.0)
        g["inst"] += m.get("smsp__inst_executed.sum", 0.0)
    total = sum(g["s"] for g in groups.values())
    total_bytes = sum(g["bytes"] for g in groups.values())
    print(f"one token: {len(token)} launches, {total * 1e3:.3f} ms of kernel time, {total_bytes / 1e6:.1f} MB from DRAM "
          f"({total_bytes / total / 1e9:,.0f} GB/s, {100 * total_bytes / total / 1e9 / a.copy_gbs:.0f}% of {a.copy_gbs:,.0f})")
    counted = any(g["inst"] > 0 for g in groups.values())
    print()
    print("| kernel | grid x block | launches | us each | MB each | GB/s | % of copy | issue active | warps active | share of token |"
          + (" M warp instructions each |" if counted else ""))
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|" + ("---:|" if counted else ""))
    for (name, grid, block, _), g in sorted(groups.items(), key=lambda kv: -kv[1]["s"]):
        gbs = g["bytes"] / g["s"] / 1e9
        print(f"| {name} | {grid} x {block} | {g['n']} | {g['s'] / g['n'] * 1e6:.1f} | {g['bytes'] / g['n'] / 1e6:.1f} | "
              f"{gbs:,.0f} | {100 * gbs / a.copy_gbs:.0f}% | {g['issue'] / g['n']:.0f}% | {g['occ'] / g['n']:.0f}% | "
              f"{100 * g['s'] / total:.1f}% |" + (f" {g['inst'] / g['n'] / 1e6:.2f} |" if counted else ""))


if __name__ == "__main__":
    main()
