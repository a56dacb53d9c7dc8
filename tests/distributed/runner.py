"""`run_distributed(fn, world_size=2)`: W processes on this machine, one process group over gloo (DeepSpeed's CPU
accelerator), each calling `fn(rank, world_size, *args)` after pipeline.train.runtime.dist.init_distributed, as every
rank of a launch does. Seconds, not a launcher start: for barriers, broadcasts and decisions that every rank must share
(OLMo-core's `run_distributed_test`). `fn` must be a module-level function (it is pickled by name)."""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any


def _free_port() -> int:
    from tests.multiproc.launch import free_port

    return free_port()


def _rank_main(
    fn: Callable[..., Any], rank: int, world: int, port: int, env: dict[str, str], out: Any, args: tuple[Any, ...]
) -> None:
    os.environ.update(env)
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    try:
        from pipeline.train.runtime.dist import init_distributed

        init_distributed(timeout_minutes=2)
        out.put((rank, "ok", fn(rank, world, *args)))
    except BaseException:  # noqa: BLE001 - the parent reports it
        out.put((rank, "error", traceback.format_exc()))
    finally:
        out.close()
        out.join_thread()  # the queue's feeder thread must write before the process goes
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)  # no interpreter teardown: the gloo shutdown race (pipeline.train.runtime.dist.exit_now)


def run_distributed(
    fn: Callable[..., Any], *args: Any, world_size: int = 2, timeout: float = 180, env: dict[str, str] | None = None
) -> list[Any]:
    """`fn(rank, world_size, *args)` on every rank; the results by rank. Raises AssertionError with each failing
    rank's traceback, or when a rank does not answer within `timeout` seconds."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    base = {
        "DS_ACCELERATOR": "cpu",
        "OMP_NUM_THREADS": "1",
        "TORCH_EXTENSIONS_DIR": os.environ.get("TORCH_EXTENSIONS_DIR", str(Path(sys.prefix) / "torch_extensions")),
        # the venv's ninja first: two ninja versions rebuild each other's JIT ops otherwise
        "PATH": str(Path(sys.executable).parent) + os.pathsep + os.environ.get("PATH", ""),
        **(env or {}),
    }
    port = _free_port()
    procs = [ctx.Process(target=_rank_main, args=(fn, r, world_size, port, base, out, args)) for r in range(world_size)]
    for p in procs:
        p.start()
    results: dict[int, tuple[str, Any]] = {}
    try:
        while len(results) < world_size:
            try:
                rank, status, value = out.get(timeout=timeout)
            except queue.Empty:
                missing = sorted(set(range(world_size)) - set(results))
                raise AssertionError(f"ranks {missing} gave no answer within {timeout:g} s") from None
            results[rank] = (status, value)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    errors = [f"rank {r}:\n{v}" for r, (s, v) in sorted(results.items()) if s == "error"]
    if errors:
        raise AssertionError("\n".join(errors))
    return [results[r][1] for r in range(world_size)]
