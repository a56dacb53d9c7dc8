"""One live training per run folder. Rank 0 holds an exclusive `flock` on RUN_DIR/.lock for the whole run, and
`pipeline pretrain` looks before it launches. The kernel drops the lock when the holding process ends, however it
ends (SIGKILL, OOM kill, a lost node), so a killed run never leaves a stale lock; the file itself stays and says
who held it last."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import time
from pathlib import Path
from typing import IO, Any

from pipeline.errors import PipelineError

LOCK_NAME = ".lock"


class RunLock:
    """The lock of one run folder, taken with `acquire()` and held until `release()` or the process's end."""

    def __init__(self, run_dir: str | Path):
        self.path = Path(run_dir) / LOCK_NAME
        self._file: IO[str] | None = None

    def acquire(self) -> None:
        """Take the lock (the folder must exist) or raise naming the run that holds it."""
        f = open(self.path, "a+")  # noqa: SIM115 - held open for the run: the open file is the lock
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.close()
            raise PipelineError(in_use(self.path.parent, read_holder(self.path))) from None
        f.seek(0)
        f.truncate()
        holder = {"host": socket.gethostname(), "pid": os.getpid(), "since": time.strftime("%Y-%m-%d %H:%M:%S")}
        f.write(json.dumps(holder) + "\n")
        f.flush()
        self._file = f

    def release(self) -> None:
        if self._file is not None:
            with contextlib.suppress(OSError):
                fcntl.flock(self._file.fileno(), fcntl.LOCK_UN)
            self._file.close()
            self._file = None


def holder(run_dir: str | Path) -> dict[str, Any] | None:
    """Who holds the run folder's lock now (None: nobody; also when the folder or the file does not exist)."""
    path = Path(run_dir) / LOCK_NAME
    if not path.is_file():
        return None
    with open(path) as f:
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return read_holder(path) or {}
        fcntl.flock(f.fileno(), fcntl.LOCK_UN)
    return None


def read_holder(path: Path) -> dict[str, Any] | None:
    try:
        value = json.loads(path.read_text() or "null")
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def in_use(run_dir: Path, who: dict[str, Any] | None) -> str:
    by = f" (pid {who.get('pid')} on {who.get('host')}, since {who.get('since')})" if who else ""
    return (
        f"{run_dir} is in use by another training{by}: two runs in one folder would mix their checkpoints and "
        "metrics. Wait for it to end or stop it, or give this run another run_dir"
    )


def check_free(run_dir: str | Path) -> None:
    """Before a launch: refuse a run folder another live training holds."""
    who = holder(run_dir)
    if who is not None:
        raise PipelineError(in_use(Path(run_dir), who))
