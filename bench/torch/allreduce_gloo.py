#!/usr/bin/env python3
"""All-reduce bandwidth of PyTorch's gloo backend, in the columns of kiln's `comm-bench`.

    python3 bench/torch/allreduce_gloo.py --ranks 2,4 --min-size 1M --max-size 256M --repeat 3

Ranks are processes spawned by this script (torch.multiprocessing), meeting over loopback;
float32 sum all-reduces, timed exactly as comm-bench times them: one warm-up, then
clamp(64 MiB / size, 2, 200) all-reduces between barriers, best of --repeat runs.
busbw = algbw x 2(N-1)/N (nccl-tests' definition). Installs nothing; needs torch.
"""

import argparse
import os
import sys
import time
import warnings

from common import free_port

# torch warns at import when numpy is missing; nothing here uses numpy.
warnings.filterwarnings("ignore", message="Failed to initialize NumPy")


def parse_size(s):
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    if s[-1].upper() in mult:
        return int(s[:-1]) * mult[s[-1].upper()]
    return int(s)


def human(b):
    for unit, shift in (("G", 30), ("M", 20), ("K", 10)):
        if b >= 1 << shift:
            return f"{b >> shift}{unit}"
    return f"{b}B"


def sizes(args):
    out, s = [], max(args.min_size, 4)
    while s <= args.max_size:
        out.append(s)
        s *= max(args.factor, 2)
    return out


def iterations(nbytes):
    # comm-bench's rule: enough to time small messages, few for large ones.
    return min(max((64 << 20) // nbytes, 2), 200)


def memcpy_bandwidth(nbytes):
    import torch

    n = max(nbytes, 1 << 20) // 4
    src, dst = torch.ones(n), torch.zeros(n)
    dst.copy_(src)  # fault the pages in first: comm-bench's buffers are warm too
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t)
    return n * 4 / best


def rank_main(rank, world, port, sizes_, repeat, queue):
    import torch
    import torch.distributed as dist

    # One intra-op thread per rank: the ranks already share the machine's cores, as kiln's do.
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    times = []
    for nbytes in sizes_:
        buf = torch.ones(nbytes // 4, dtype=torch.float32)
        dist.all_reduce(buf)  # warm-up
        iters, best = iterations(nbytes), float("inf")
        for _ in range(max(repeat, 1)):
            dist.barrier()
            t = time.perf_counter()
            for _ in range(iters):
                dist.all_reduce(buf)
            dist.barrier()
            best = min(best, (time.perf_counter() - t) / iters)
        times.append(best)
    if rank == 0:
        queue.put(times)
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", default="2,4", help="world sizes, comma-separated")
    p.add_argument("--min-size", default="1M", type=parse_size)
    p.add_argument("--max-size", default="256M", type=parse_size)
    p.add_argument("--factor", default=4, type=int)
    p.add_argument("--repeat", default=1, type=int)
    args = p.parse_args()
    try:
        import torch
        import torch.multiprocessing as mp
    except ImportError as e:
        sys.exit(f"allreduce_gloo.py needs torch: {e}")
    # Loopback for gloo too, as kiln's processes meet on 127.0.0.1.
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    szs = sizes(args)
    memcpy = memcpy_bandwidth(szs[-1])
    print(f"torch {torch.__version__}, gloo; ranks are processes ({os.cpu_count()} cores)")
    print(f"memcpy bandwidth of this machine: {memcpy / 1e9:.2f} GB/s")
    print(
        f"{'group':<6} {'N':>3} {'size':>6}  {'alg':<4}  {'time (us)':>12} "
        f"{'algbw GB/s':>10} {'busbw GB/s':>10} {'busbw/mcpy':>10}"
    )
    ctx = mp.get_context("spawn")
    for n in (int(x) for x in args.ranks.split(",")):
        queue = ctx.SimpleQueue()
        port = free_port()
        procs = [
            ctx.Process(target=rank_main, args=(r, n, port, szs, args.repeat, queue))
            for r in range(n)
        ]
        for proc in procs:
            proc.start()
        times = queue.get()
        for proc in procs:
            proc.join()
            if proc.exitcode != 0:
                sys.exit(f"a gloo rank failed (exit code {proc.exitcode})")
        for nbytes, t in zip(szs, times):
            algbw = nbytes / t
            busbw = algbw * 2 * (n - 1) / n
            print(
                f"{'gloo':<6} {n:>3} {human(nbytes):>6}  ring  {t * 1e6:>12.1f} "
                f"{algbw / 1e9:>10.3f} {busbw / 1e9:>10.3f} {busbw / memcpy:>10.3f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
