#!/usr/bin/env python3
"""Summarizes the collapsed stacks written by `bench --host-profile FILE`.

    python3 scripts/host_profile.py FILE [--top N] [--focus SUBSTRING]

Prints the samples per thread, then the functions with the most inclusive samples (the share of
samples with the function anywhere on the stack, counted once per stack) and the most self
samples (the sampled function itself). `--focus` keeps only stacks that pass through a function
whose name contains SUBSTRING, so its callees can be read apart from the rest.
"""
import argparse
import collections
import re


def short(name: str) -> str:
    # Drop generic arguments and hashes so that monomorphized copies add up.
    name = re.sub(r"::h[0-9a-f]{16}$", "", name)
    out, depth = [], 0
    for ch in name:
        if ch == "<":
            depth += 1
            if depth == 1:
                out.append("<..>")
            continue
        if ch == ">":
            depth = max(0, depth - 1)
            continue
        if depth == 0:
            out.append(ch)
    return "".join(out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("file")
    ap.add_argument("--top", type=int, default=45)
    ap.add_argument("--focus")
    args = ap.parse_args()
    stacks = []
    for line in open(args.file):
        line = line.rstrip("\n")
        if not line:
            continue
        path, _, count = line.rpartition(" ")
        frames = path.split(";")
        if args.focus and not any(args.focus in f for f in frames):
            continue
        stacks.append((frames[0], [short(f) for f in frames[1:]], int(count)))
    total = sum(c for _, _, c in stacks)
    if total == 0:
        print("no samples")
        return
    threads = collections.Counter()
    inclusive = collections.Counter()
    own = collections.Counter()
    for thread, frames, count in stacks:
        threads[thread] += count
        for f in set(frames):
            inclusive[f] += count
        if frames:
            own[frames[-1]] += count
    print(f"{total} samples" + (f" through '{args.focus}'" if args.focus else ""))
    for t, c in threads.most_common():
        print(f"  thread {t}: {c} ({100 * c / total:.1f}%)")
    print(f"\ninclusive (top {args.top}):")
    for f, c in inclusive.most_common(args.top):
        print(f"  {100 * c / total:5.1f}%  {f}")
    print(f"\nself (top {args.top}):")
    for f, c in own.most_common(args.top):
        print(f"  {100 * c / total:5.1f}%  {f}")


if __name__ == "__main__":
    main()
