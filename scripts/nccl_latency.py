#!/usr/bin/env python3
"""NCCL all-reduce latency as a tensor-parallel decode step sees it (issue 37).

Two processes, one GPU each, replay a CUDA graph of `--count` bf16 all-reduces of `--elems` values
(a decode token of Gemma 4 31B split over two GPUs does 120 of 5,376), with and without a small
kernel between them (the next layer's work waits on each sum). Prints the median time per
all-reduce over `--reps` replays after warm-up. NCCL's tunables come from the environment, so run
it once per setting (NCCL_PROTO, NCCL_ALGO, NCCL_MAX_NCHANNELS ...); NVLink multicast stays off.

    python3 scripts/nccl_latency.py --elems 5376 --count 120
"""
import argparse
import os
import statistics

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def worker(rank, world, args, port):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device("cuda", rank))
    x = torch.randn(args.elems, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(args.elems, device="cuda", dtype=torch.bfloat16)
    results = {}
    for between in ("none", "mul"):
        s = torch.cuda.Stream()
        with torch.cuda.stream(s):
            for _ in range(3):  # NCCL's first calls outside the capture
                dist.all_reduce(x)
                if between == "mul":
                    x.mul_(w)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=s):
            for _ in range(args.count):
                dist.all_reduce(x)
                if between == "mul":
                    x.mul_(w)
        torch.cuda.synchronize()
        for _ in range(5):
            g.replay()
        torch.cuda.synchronize()
        times = []
        for _ in range(args.reps):
            dist.barrier()
            torch.cuda.synchronize()
            a = torch.cuda.Event(enable_timing=True)
            b = torch.cuda.Event(enable_timing=True)
            a.record()
            g.replay()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) * 1000.0 / args.count)
        results[between] = statistics.median(times)
        del g
    if rank == 0:
        setting = " ".join(f"{k}={v}" for k, v in sorted(os.environ.items())
                           if k.startswith("NCCL_") and k != "NCCL_NVLS_ENABLE") or "defaults"
        print(f"{setting}: {args.elems} bf16 x {args.count} in a graph: "
              f"{results['none']:.2f} us per all-reduce, {results['mul']:.2f} us with a kernel after each "
              f"(median of {args.reps})", flush=True)
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--elems", type=int, default=5376)
    p.add_argument("--count", type=int, default=120)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--port", type=int, default=29511)
    args = p.parse_args()
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    mp.spawn(worker, args=(args.world, args, args.port), nprocs=args.world, join=True)


if __name__ == "__main__":
    main()
