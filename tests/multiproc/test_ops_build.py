"""DeepSpeed's op builds stopped mid-way (pipeline.train.runtime.ops): a SIGTERM (docker stop, a Slurm time limit)
is one line and exit 143 with no lock left behind; a SIGKILL, which nothing can clean up after, leaves torch's build
lock, and the next build clears it with a line and finishes instead of waiting on it forever. Real builds of
DeepSpeed's CPU all-reduce op, the quickest of the four to build, into a fresh cache: the two stopped ones are
stopped while the compiler runs; the last one finds the compiled objects of the project's own build of the op
beside the lock (as a build stopped between its compile and link steps leaves them) and links them, through the
same lock, ninja and load, in seconds instead of a minute of compiling on one core."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from pipeline.train.runtime.ops import extensions_dir
from tests.multiproc import launch

pytestmark = pytest.mark.slow
OP = "deepspeed_shm_comm"


def start(env: dict[str, str]) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "pipeline.train.runtime.ops", OP, "--jobs", "1"]
    return subprocess.Popen(
        cmd,
        env=env,
        cwd=launch.ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def wait_for(path: Path, proc: subprocess.Popen, timeout: float = 120) -> None:
    t0 = time.monotonic()
    while not path.exists():
        assert proc.poll() is None, proc.communicate()[0]
        assert time.monotonic() - t0 < timeout, f"{path} never appeared"
        time.sleep(0.1)
    time.sleep(1.0)  # the compiler is running


def test_a_build_stopped_midway_never_leaves_a_later_build_waiting(tmp_path: Path) -> None:
    env = {**launch.env(), "TORCH_EXTENSIONS_DIR": str(tmp_path / "ext")}
    lock = tmp_path / "ext" / OP / "lock"

    stopped = start(env)
    wait_for(lock, stopped)
    os.kill(stopped.pid, signal.SIGTERM)  # what docker stop sends the main process
    out = stopped.communicate(timeout=120)[0]
    assert stopped.returncode == 143, out
    assert f"stopped while building DeepSpeed's {OP}; the partial builds were cleared" in out
    assert "Traceback" not in out and not lock.exists()

    killed = start(env)
    wait_for(lock, killed)
    tree = [killed.pid] + [c.pid for c in psutil.Process(killed.pid).children(recursive=True)]
    for pid in tree:  # the whole tree at once, as the OOM killer or a lost node would: nothing can clean up
        os.kill(pid, signal.SIGKILL)
    killed.wait(timeout=60)
    psutil.wait_procs([p for p in map(_alive, tree) if p is not None], timeout=60)
    assert lock.exists(), "a SIGKILL leaves torch's lock behind"

    built = extensions_dir() / OP  # `make test` builds the project's ops first; without them the build compiles
    for name in ("shm.o", "shm_interface.o", ".ninja_log", ".ninja_deps"):
        if (built / f"{OP}.so").is_file() and (built / name).is_file():
            shutil.copy2(built / name, lock.parent / name)
    again = subprocess.run(
        [sys.executable, "-m", "pipeline.train.runtime.ops", OP, "--jobs", "1"],
        env=env,
        cwd=launch.ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert again.returncode == 0, again.stdout + again.stderr
    assert f"cleared {lock}: a build of {OP} was stopped before it finished" in again.stdout
    assert f"{OP}: built in" in again.stdout and (tmp_path / "ext" / OP / f"{OP}.so").is_file()


def _alive(pid: int) -> psutil.Process | None:
    try:
        return psutil.Process(pid)
    except psutil.NoSuchProcess:
        return None
