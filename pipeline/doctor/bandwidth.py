"""A short all-reduce between hosts (one process per hostfile slot; NCCL on GPUs, gloo on CPUs) over the interface the
checks found: the bus bandwidth a data-parallel run will see, as nccl-tests counts it (2 (n-1)/n x bytes / time).
Started on every host at once by `pipeline doctor --hostfile`; rank 0 prints the figure."""

from __future__ import annotations

import argparse
import json
import os
import time
from datetime import timedelta


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--local-rank", type=int, default=0, help="this process's GPU on its host")
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--master", required=True, help="ADDR:PORT of rank 0")
    ap.add_argument("--iface", default=None)
    ap.add_argument(
        "--mbytes",
        type=float,
        default=16.0,
        help="the first size; it grows x4 while an all-reduce takes "
        "under --min-seconds, up to --max-mbytes (as nccl-tests sweeps sizes)",
    )
    ap.add_argument("--max-mbytes", type=float, default=1024.0)
    ap.add_argument("--min-seconds", type=float, default=0.5)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=60.0)
    args = ap.parse_args(argv)
    from pipeline.train.runtime.env import apply_env_files

    apply_env_files()  # .deepspeed_env, as the run's ranks get it (NCCL_IB_*, NCCL_P2P_DISABLE, ...)
    if args.iface:
        os.environ["GLOO_SOCKET_IFNAME"] = os.environ["NCCL_SOCKET_IFNAME"] = args.iface

    import torch
    import torch.distributed as dist

    gpu = torch.cuda.is_available()
    backend = "nccl" if gpu else "gloo"
    device = torch.device("cuda", args.local_rank) if gpu else torch.device("cpu")
    dist.init_process_group(
        backend,
        init_method=f"tcp://{args.master}",
        rank=args.rank,
        world_size=args.world,
        timeout=timedelta(seconds=args.timeout),
    )

    def median_time(n: int) -> float:
        x = torch.ones(n, dtype=torch.float32, device=device)
        dist.all_reduce(x[: max(1, n // 16)])  # connections up, buffers warm
        dist.all_reduce(x)
        times = []
        for _ in range(args.iters):
            if gpu:
                torch.cuda.synchronize()
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_reduce(x)
            if gpu:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        # rank 0's figure for everyone, so all ranks take the same decision to grow
        agreed = torch.tensor([sorted(times)[len(times) // 2]], dtype=torch.float64, device=device)
        dist.broadcast(agreed, src=0)
        return float(agreed.item())

    # A short all-reduce measures latency, not the link: grow the size until one takes min_seconds (16 MiB over
    # 100 Gbps takes about 10 ms).
    n = int(args.mbytes * 2**20 / 4)
    t = median_time(n)
    while t < args.min_seconds and n * 4 * 4 <= args.max_mbytes * 2**20:
        n *= 4
        t = median_time(n)
    bus = 2 * (args.world - 1) / args.world * n * 4 / t
    if args.rank == 0:
        print(
            "DOCTOR-BW "
            + json.dumps(
                {"backend": backend, "bytes": n * 4, "seconds": t, "bus_bytes_per_s": bus, "world": args.world}
            ),
            flush=True,
        )
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    from pipeline.train.runtime.dist import exit_now  # torch is imported by then: this costs nothing

    exit_now(main())
