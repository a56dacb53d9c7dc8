"""One live training per run folder: a second one is refused naming the first, and a killed holder leaves no stale
lock (the kernel drops a flock with its process). The holder is a real separate process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipeline.errors import PipelineError
from pipeline.train.setup.runlock import RunLock, check_free, holder

HOLD = """
import sys, time
from pipeline.train.setup.runlock import RunLock
lock = RunLock(sys.argv[1])
lock.acquire()
print("held", flush=True)
time.sleep(600)
"""


def hold(run_dir: Path) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-c", HOLD, str(run_dir)], stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None and p.stdout.readline().strip() == "held"
    return p


def test_a_second_training_is_refused_and_a_killed_one_leaves_no_stale_lock(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    assert holder(run_dir) is None
    first = hold(run_dir)
    try:
        who = holder(run_dir)
        assert who is not None and who["pid"] == first.pid
        with pytest.raises(PipelineError, match=rf"is in use by another training \(pid {first.pid} on "):
            RunLock(run_dir).acquire()
        with pytest.raises(PipelineError, match="give this run another run_dir"):
            check_free(run_dir)
    finally:
        os.kill(first.pid, signal.SIGKILL)  # what an OOM kill or a lost node does
        first.wait()
    deadline = time.time() + 10
    while holder(run_dir) is not None and time.time() < deadline:
        time.sleep(0.05)
    lock = RunLock(run_dir)
    lock.acquire()  # free again, with no cleanup by anyone
    assert holder(run_dir) is not None  # and held by this process for others
    lock.release()
    assert holder(run_dir) is None
    check_free(tmp_path / "never-made")  # a folder that does not exist yet is free
