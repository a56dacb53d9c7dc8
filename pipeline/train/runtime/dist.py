"""Each rank's side of a distributed run: which device it drives, the process group, what the node looks like, and
the one way rank 0 decides something for everyone (`on_rank0`). Rank and world size are read once, here, and
passed on in a `Dist`; nothing else reads them from the environment."""

from __future__ import annotations

import importlib.metadata as md
import logging
import os
import shutil
import sys
import threading
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, TypeVar

import torch

from pipeline.errors import PipelineError, SaidOnRankZero
from pipeline.train.runtime.ds_workarounds import memoize_cpu_info, release_shm_names
from pipeline.train.runtime.env import apply_env_files, p2p_default, recorded
from pipeline.train.runtime.ops import use_project_cache

T = TypeVar("T")
log = logging.getLogger(__name__)


def accelerator_name() -> str:
    """DeepSpeed's accelerator: DS_ACCELERATOR when set, else cuda when torch sees a GPU, else cpu, refused when
    this machine has an NVIDIA GPU that torch cannot use (`unusable_gpu`): that run would train on the CPU."""
    name = os.environ.get("DS_ACCELERATOR")
    if name:
        return name
    if torch.cuda.is_available():
        return "cuda"
    if problem := unusable_gpu():
        raise PipelineError(problem)
    return "cpu"


def unusable_gpu() -> str | None:
    """Why this machine's NVIDIA GPU is not used by torch (a CPU build of torch, a driver older than the build's
    CUDA), or None when there is no GPU here or torch uses it."""
    smi = shutil.which("nvidia-smi")
    if not (smi or Path("/dev/nvidia0").exists()) or torch.cuda.is_available():
        return None
    if torch.version.cuda is None:
        cause = f"this torch ({torch.__version__}) is a CPU build"
    else:
        try:
            torch.cuda.init()
            error = "torch.cuda.is_available() is False"
        except Exception as e:  # noqa: BLE001 - its message is the diagnosis (e.g. "driver too old")
            error = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        cause = f"torch {torch.__version__}, built for CUDA {torch.version.cuda}, cannot use it ({error})"
    return (
        f"this machine has an NVIDIA GPU ({smi or '/dev/nvidia0'}) but {cause}, so training would run on the CPU. "
        "Install a CUDA build of torch the driver supports (nvidia-smi shows the driver's CUDA version), e.g. "
        'make install TORCH_SPEC="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128"; or set '
        "DS_ACCELERATOR=cpu to run on the CPU on purpose"
    )


def visible_gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def local_ranks_problem(num_gpus: int | None, accelerator: str, visible: int) -> str | None:
    """Why `--num-gpus N` cannot start here: more GPU ranks than GPUs this process sees (DeepSpeed would hand out
    device numbers that do not exist: rank N fails with "invalid device ordinal")."""
    if not num_gpus or accelerator != "cuda" or num_gpus <= visible:
        return None
    shown = (
        f" (CUDA_VISIBLE_DEVICES={os.environ['CUDA_VISIBLE_DEVICES']})" if "CUDA_VISIBLE_DEVICES" in os.environ else ""
    )
    return (
        f"--num-gpus {num_gpus}: this machine shows {visible} GPU(s){shown}; use --num-gpus {visible} or fewer, "
        "or a hostfile for more machines"
    )


def device_for(accelerator: str, local_rank: int) -> torch.device:
    """The device of the rank that is `local_rank` on its node: GPU number `local_rank`, or the CPU."""
    if accelerator == "cpu":
        return torch.device("cpu")
    return torch.device(accelerator, local_rank)


def local_rank_from_env(environ: dict[str, str] | os._Environ[str] = os.environ) -> int:
    return int(environ.get("LOCAL_RANK", "0"))


def ranks_per_node(world_size: int) -> int:
    """Ranks on this node, as the launcher says (LOCAL_SIZE), else the whole world."""
    return int(os.environ.get("LOCAL_SIZE", os.environ.get("LOCAL_WORLD_SIZE", str(world_size))))


def host_ram_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


@dataclass(frozen=True, slots=True)
class Dist:
    """This rank in the run: its global rank, the world size and the device it drives."""

    rank: int
    world_size: int
    device: torch.device


def init_distributed(timeout_minutes: float = 30.0) -> Dist:
    """Select this rank's GPU (from LOCAL_RANK; DeepSpeed would select it only later, inside `initialize`), start
    the process group, and release DeepSpeed's CPU shared-memory names once every rank has mapped them."""
    import deepspeed
    import deepspeed.comm as dist

    memoize_cpu_info()  # before DeepSpeed loads its first op
    use_project_cache()
    applied = apply_env_files()  # before NCCL reads its settings (DeepSpeed forwards them only over pdsh)
    device = device_for(accelerator_name(), local_rank_from_env())
    if device.type == "cuda":
        torch.cuda.set_device(device)
        names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        if (note := p2p_default(names, ranks_per_node(1))) and local_rank_from_env() == 0:
            log.warning("%s", note)
    if "OMP_NUM_THREADS" in applied:
        torch.set_num_threads(int(applied["OMP_NUM_THREADS"]))  # torch read the variable at import, before the file
    deepspeed.init_distributed(timeout=timedelta(minutes=timeout_minutes))
    rank, world = dist.get_rank(), dist.get_world_size()
    dist.barrier()  # every rank has mapped every shared-memory buffer by now
    release_shm_names(rank)
    return Dist(rank, world, device)


def on_rank0(fn: Callable[[], T], *, heartbeat_s: float | None = None) -> T:
    """`fn()` run on rank 0 alone, its value returned on every rank. A PipelineError it raises is raised on every
    rank with the same message; any other exception is re-raised on rank 0 and reported on the others, so that no
    rank is left waiting for an answer. Without a process group (one process) it is `fn()`.

    `heartbeat_s`: `fn` may take longer than a collective may wait (the process group's timeout: a universal
    conversion of a 70B checkpoint reads and writes terabytes). Rank 0 then runs it in a thread and every rank
    meets in a small broadcast every `heartbeat_s` until it is done, so the others wait without timing out while
    rank 0 works, and still fail within the timeout if rank 0 itself stops answering."""
    import torch.distributed as tdist

    if not tdist.is_initialized():
        return fn()
    box: list[Any] = [None, None, None]  # value, user error, internal error
    caught: list[BaseException] = []

    def run() -> None:
        try:
            box[0] = fn()
        except PipelineError as e:
            box[1] = str(e)
        except BaseException as e:  # noqa: BLE001 - every rank must hear of it, then rank 0 re-raises it
            caught.append(e)
            box[2] = "".join(traceback.format_exception_only(type(e), e)).strip()

    rank0 = tdist.get_rank() == 0
    if heartbeat_s is None:
        if rank0:
            run()
    else:
        worker = threading.Thread(target=run, name="pipeline-on-rank0", daemon=True)
        if rank0:
            worker.start()
        while True:
            if rank0:
                worker.join(heartbeat_s)
            done = [not worker.is_alive()] if rank0 else [False]
            tdist.broadcast_object_list(done, src=0)
            if done[0]:
                break
    tdist.broadcast_object_list(box, src=0)
    if box[1] is not None:
        raise PipelineError(box[1]) if rank0 else SaidOnRankZero(box[1])
    if caught:
        raise caught[0]
    if box[2] is not None:
        raise RuntimeError(f"rank 0 failed while deciding for every rank: {box[2]}")
    return box[0]  # type: ignore[no-any-return]


def apply_memory_cap(device: torch.device, cap_gib: float | None) -> None:
    """`train.gpu_memory_cap_gib`: emulate a smaller card (a 24 GiB 4090D on an 80 GiB GPU)."""
    if device.type == "cuda" and cap_gib:
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, cap_gib * 2**30 / total), device)


def make_deterministic_on_cpu(device: torch.device) -> None:
    """Deterministic kernels make CPU runs repeat bit for bit (the resume tests rely on it). Not the NaN fill of
    every fresh allocation that comes with deterministic mode: it only shows reads of uninitialised memory, and it
    doubled the cost of DeepSpeed's per-micro-step bucket allocations."""
    if device.type == "cpu":
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.utils.deterministic.fill_uninitialized_memory = False  # type: ignore[attr-defined]


def environment(world_size: int, device: torch.device) -> dict[str, Any]:
    """What a run ran on (RUN_DIR/environment.json), so `pipeline plan --from-run` can plan the same cluster."""

    local = ranks_per_node(world_size)
    info: dict[str, Any] = {
        "world_size": world_size,
        "ranks_per_node": local,
        "nodes": max(1, world_size // local),
        "device": "cpu",
        "device_memory_bytes": None,
        "host_ram_bytes": host_ram_bytes(),
        "cpu_cores": os.cpu_count(),
    }
    if device.type == "cuda":
        info["device"] = torch.cuda.get_device_name(device)
        info["device_memory_bytes"] = torch.cuda.get_device_properties(device).total_memory
    for pkg in ("torch", "deepspeed", "transformers"):
        try:
            info[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            info[pkg] = None
    return info


def core_binding(physical: int, logical: int, local_ranks: int) -> tuple[list[str], int, str]:
    """How a node's CPUs are shared by its ranks' CPU Adam: (the `deepspeed` launcher's binding arguments, threads
    per rank, why). DeepSpeed's `--bind_cores_to_rank` gives rank r the logical CPUs [k*r, k*(r+1)) with k its
    PHYSICAL core count // ranks: on a 10-vCPU node shown as 5 cores x 2 threads, 4 ranks get one logical CPU each
    and 6 sit idle. So: bind only where every logical CPU gets a rank (naming them all with --bind_core_list where
    the counts differ); else leave the ranks unbound with the logical CPUs shared out as threads."""
    ranks = max(1, local_ranks)
    per = logical // ranks
    if per < 1:
        return [], 1, f"{ranks} ranks on {logical} CPUs: not bound, one thread each"
    if per * ranks != logical:
        idle = logical - per * ranks
        return [], per, f"not bound: binding {ranks} ranks to {per} of {logical} CPUs each would leave {idle} idle"
    if logical == physical:
        return ["--bind_cores_to_rank"], per, f"bound: {per} of {logical} cores per rank"
    return (
        ["--bind_cores_to_rank", "--bind_core_list", f"0-{logical - 1}"],
        per,
        f"bound: {per} of {logical} logical CPUs per rank ({physical} physical cores)",
    )


def cpu_counts() -> tuple[int, int]:
    """(physical cores, logical CPUs) of this node."""
    import psutil

    logical = psutil.cpu_count() or os.cpu_count() or 1
    return psutil.cpu_count(logical=False) or logical, logical


def share_cpu_cores(local_ranks: int, environ: dict[str, str] | os._Environ[str] = os.environ) -> int | None:
    """Threads for this rank's CPU work (DeepSpeed's CPU Adam under optimizer offload): the node's CPUs shared by
    its ranks (`core_binding`). DeepSpeed's `--bind_cores_to_rank` (which `pipeline pretrain` adds where it leaves
    no CPU idle) sets OMP_NUM_THREADS to exactly that; without it every rank starts OpenMP threads on every core, 4
    x 10 of them on a 10-core node. Returns the threads set, None when OMP_NUM_THREADS already says."""
    if "OMP_NUM_THREADS" in environ:
        return None
    _, threads, _ = core_binding(*cpu_counts(), local_ranks)
    torch.set_num_threads(threads)
    return threads


def rank_facts(dist: Dist) -> dict[str, Any]:
    """What one rank ran with (RUN_DIR/environment.json, "ranks"): its host, its NCCL/GLOO/OpenMP settings, the
    threads torch uses for its CPU work (CPU Adam under offload)."""
    import socket

    return {
        "rank": dist.rank,
        "host": socket.gethostname(),
        "torch_threads": torch.get_num_threads(),
        "env": recorded(),
    }


def exit_now(code: int) -> None:
    """Leave a rank's process with `code`, output flushed, without interpreter teardown: teardown would join
    DataLoader workers (which outlive SIGTERM so a preempted rank can save) and can hit an upstream gloo shutdown
    race that aborts about 1 in 10 clean runs at exit."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
