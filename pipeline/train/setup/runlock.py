"""One live training per run folder. Rank 0 holds an exclusive `flock` on RUN_DIR/.lock for the whole run, and
`pipeline pretrain` looks before it launches. The kernel drops the lock when the holding process ends, however it
ends (SIGKILL, OOM kill, a lost node), so a killed run never leaves a stale lock; the file itself stays and says
who held it last."""

from __future__ import annotations

import fcntl
from pathlib import Path
from typing import Any

from pipeline.atomic import OneWriter, held_by, read_holder
from pipeline.errors import PipelineError

LOCK_NAME = ".lock"


class RunLock(OneWriter):
    """The lock of one run folder, taken with `acquire()` and held until `release()` or the process's end."""

    def __init__(self, run_dir: str | Path):
        super().__init__(Path(run_dir) / LOCK_NAME, lambda who: in_use(Path(run_dir), who))


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


def in_use(run_dir: Path, who: dict[str, Any] | None) -> str:
    return (
        f"{run_dir} is in use by another training{held_by(who)}: two runs in one folder would mix their checkpoints "
        "and metrics. Wait for it to end or stop it, or give this run another run_dir"
    )


def check_free(run_dir: str | Path) -> None:
    """Before a launch: refuse a run folder another live training holds."""
    who = holder(run_dir)
    if who is not None:
        raise PipelineError(in_use(Path(run_dir), who))
