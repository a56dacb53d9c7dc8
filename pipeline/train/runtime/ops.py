"""DeepSpeed's compiled ops (fused Adam, CPU Adam, async I/O for NVMe, the CPU shared-memory all-reduce): which a
run needs, whether they are built, and building them ahead of a launch, in parallel, with their times.

DeepSpeed JIT-compiles an op the first time a process loads it (about a minute each, async_io nearly four here) and
caches it under TORCH_EXTENSIONS_DIR. Unset, torch keeps one cache per user that every checkout and venv shares,
and a second venv's compiler flags make it rebuild what the first built. This project keeps its own cache inside
the venv (`sys.prefix/torch_extensions`), whatever the entry point: `pipeline`, `deepspeed pipeline/pretrain.py`
on every node, or the tests. `python -m pipeline.train.runtime.ops` (what `make ops` runs) builds them ahead."""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from pipeline.plan.cluster import Layout

BUILDERS = {
    "fused_adam": "FusedAdamBuilder",
    "cpu_adam": "CPUAdamBuilder",
    "async_io": "AsyncIOBuilder",
    "deepspeed_shm_comm": "ShareMemCommBuilder",
}
"""Op name (its folder in the cache) -> DeepSpeed builder class, as the accelerator creates it."""


def extensions_dir() -> Path:
    """Where the ops are built and loaded from: TORCH_EXTENSIONS_DIR when set, else this venv's own folder."""
    return Path(os.environ.get("TORCH_EXTENSIONS_DIR") or Path(sys.prefix) / "torch_extensions")


def use_project_cache(environ: dict[str, str] | os._Environ[str] = os.environ) -> str:
    """Point TORCH_EXTENSIONS_DIR at the project's cache unless the user set it; returns the folder."""
    environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path(sys.prefix) / "torch_extensions"))
    return environ["TORCH_EXTENSIONS_DIR"]


LOCK = "lock"
"""torch's build lock in an op's folder (torch.utils.file_baton.FileBaton): created when a build starts, held open by
the building process, removed when it ends. A build stopped by a signal leaves it, and every later build waits for
it without a word."""


def lock_holders(lock: Path) -> list[int] | None:
    """The processes that hold `lock` open (a build in progress); None where that cannot be seen (no /proc)."""
    proc = Path("/proc")
    if not proc.is_dir():
        return None
    target = str(lock.resolve())
    holders = []
    for pid in (p for p in proc.iterdir() if p.name.isdigit()):
        try:
            if any(os.readlink(fd) == target for fd in (pid / "fd").iterdir()):
                holders.append(int(pid.name))
        except OSError:  # gone meanwhile, or another user's: not a build of this venv's cache
            continue
    return holders


def clear_stale_locks(names: list[str], say: Any = print) -> None:
    """Remove the build locks of `names` that no live process holds (a build stopped by a signal left them),
    saying so; say which build is in progress where one is."""
    for name in names:
        lock = extensions_dir() / name / LOCK
        if not lock.exists():
            continue
        holders = lock_holders(lock)
        if holders is None:
            say(
                f"{lock} exists: a build of {name} is in progress, or one was stopped and left it; if no build is "
                "running, delete that file (every build of the op waits for it otherwise)"
            )
        elif holders:
            say(f"a build of {name} is in progress (process {', '.join(map(str, holders))}); waiting for it to end")
        else:
            lock.unlink(missing_ok=True)
            say(f"cleared {lock}: a build of {name} was stopped before it finished and left it (no process holds it)")


def is_built(name: str) -> bool:
    return (extensions_dir() / name / f"{name}.so").is_file()


def needed(layout: Layout, accelerator: str, world_size: int = 1) -> list[str]:
    """The ops a run of this layout loads on `accelerator`."""
    ops = ["cpu_adam"] if layout.offload_optimizer != "none" else ["fused_adam"]
    if "nvme" in (layout.offload_optimizer, layout.offload_param):
        ops.append("async_io")
    if accelerator == "cpu" and world_size > 1:
        ops.append("deepspeed_shm_comm")  # DeepSpeed's CPU all-reduce between the ranks of one machine
    return ops


def _build_one(name: str) -> tuple[str, float, str | None]:
    """Build `name` in its own process (so several build at once); (name, seconds, error or None)."""
    code = (
        "from deepspeed.accelerator import get_accelerator\n"
        f"b = get_accelerator().create_op_builder({BUILDERS[name]!r})\n"
        "import sys\n"
        "if b is None or not b.is_compatible(verbose=False): sys.exit(3)\n"
        "b.load(verbose=False)\n"
    )
    env = {**os.environ, "PATH": str(Path(sys.executable).parent) + os.pathsep + os.environ.get("PATH", "")}
    started = time.monotonic()
    proc = subprocess.Popen(  # its own process group, so that stopping it stops its compilers too
        [sys.executable, "-c", code],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    _RUNNING[name] = proc
    _, stderr = proc.communicate()
    _RUNNING.pop(name, None)
    seconds = time.monotonic() - started
    if proc.returncode == 3:
        return name, seconds, "not buildable here (see `ds_report`)"
    if proc.returncode != 0:
        return name, seconds, (stderr.strip().splitlines() or [f"exit code {proc.returncode}"])[-1]
    return name, seconds, None


_RUNNING: dict[str, subprocess.Popen[str]] = {}
"""The builds this process started, by op: stopped with it (`_stop_builds`)."""


def _stop_builds(signum: int, frame: Any) -> None:
    """SIGTERM (docker stop, a Slurm time limit) or SIGINT while building: stop the builds and their compilers,
    clear the locks they leave, say so in one line, exit 143 (130), instead of dying silently with every later
    build waiting on the locks."""
    import signal

    building = list(_RUNNING.items())  # before the kills: each build's thread drops its entry once its proc ends
    for name, proc in building:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        (extensions_dir() / name / LOCK).unlink(missing_ok=True)
    print(
        f"stopped while building DeepSpeed's {', '.join(n for n, _ in building) or 'ops'}; the partial builds were "
        "cleared and the "
        "next launch builds them again",
        file=sys.stderr,
        flush=True,
    )
    os._exit(128 + signum)


def build(names: list[str], jobs: int = 2, say: Any = print) -> list[tuple[str, float, str | None]]:
    """Build the ops of `names` that are not built yet, `jobs` at a time (each op compiles on one core), after
    clearing the locks that stopped builds left; a SIGTERM meanwhile stops them cleanly (`_stop_builds`)."""
    import signal
    import threading

    use_project_cache()
    clear_stale_locks(names, say)
    todo = [n for n in names if not is_built(n)]
    main = threading.current_thread() is threading.main_thread()
    before = {sig: signal.signal(sig, _stop_builds) for sig in (signal.SIGTERM, signal.SIGINT)} if main and todo else {}
    try:
        with ThreadPoolExecutor(max(1, jobs)) as pool:
            return list(pool.map(_build_one, todo))
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("ops", nargs="*", default=list(BUILDERS), help=f"ops to build (default: {', '.join(BUILDERS)})")
    ap.add_argument("--jobs", type=int, default=max(1, min(4, os.cpu_count() or 1)))
    ap.add_argument("--optional", nargs="*", default=["async_io"], help="ops whose failure is reported, not fatal")
    args = ap.parse_args(argv)
    folder = use_project_cache()
    print(f"DeepSpeed ops in {folder}: building {', '.join(n for n in args.ops if not is_built(n)) or 'none'}")
    failed = False
    for name, seconds, error in build(args.ops, args.jobs):
        print(f"  {name}: " + (f"built in {seconds:.0f} s" if error is None else f"not built ({error})"))
        failed |= error is not None and name not in args.optional
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
