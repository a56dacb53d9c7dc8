"""A rank that fails alone: the survivors' collective breaks (gloo: "Connection closed by peer"), and each survivor
says one line instead of a page of gloo's frames, so the failing rank's own error is the one a user reads. Two real
processes over gloo, through the rank's real entry (`run_as_script`)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from pipeline.doctor.cluster import rendezvous_port
from tests.conftest import ROOT

RANK = """
import os, sys, time
import torch, torch.distributed as dist
import pipeline.train.main as entry

def main(argv=None):
    rank = int(sys.argv[1])
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{sys.argv[2]}", rank=rank, world_size=2)
    dist.all_reduce(torch.ones(4))
    if rank == 0:
        raise ValueError("the failing rank's own error")
    for _ in range(100):
        dist.all_reduce(torch.ones(4))
        time.sleep(0.1)
    return 0

entry.main = main
entry.run_as_script()
"""


def test_the_survivors_of_a_failed_rank_say_one_line_not_a_traceback(tmp_path: Path) -> None:
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    port = str(rendezvous_port())
    env = {"PYTHONPATH": str(ROOT), "PATH": str(Path(sys.executable).parent), "OMP_NUM_THREADS": "1"}
    ranks = [
        subprocess.Popen([sys.executable, str(script), str(r), port], env=env, stderr=subprocess.PIPE, text=True)
        for r in (0, 1)
    ]
    failed, survivor = (p.communicate(timeout=120)[1] for p in ranks)
    assert ranks[0].returncode == 1 and "ValueError: the failing rank's own error" in failed  # its traceback stays
    assert ranks[1].returncode == 1, survivor
    assert "Traceback" not in survivor and "GLHF" not in survivor, survivor
    lines = survivor.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: a collective failed on this rank because another rank")
    assert "Connection closed by peer" in lines[0] or "Connection reset by peer" in lines[0]  # gloo says either
    assert "the first error above" in lines[0]
