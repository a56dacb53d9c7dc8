"""The Checkpointer across two real ranks with a real DeepSpeed engine: when it saves, that a checkpoint lists
every rank's files, that a write failing on one rank stops both with one message, and that both ranks resume
from the same intact checkpoint (or refuse alike)."""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any

import pytest

from tests.distributed.runner import run_distributed
from tests.multiproc import launch

pytestmark = pytest.mark.dist


def _run(rank: int, world: int, config: str) -> Any:
    """This rank's Run of `config`, and a builder of its engine for the Checkpointer."""
    import torch

    from pipeline.train.engine import build_engine
    from pipeline.train.runtime.dist import Dist
    from pipeline.train.setup.config import load
    from pipeline.train.setup.prepare import Run, prepare

    cfg = load(config)
    run = Run.on(prepare(cfg, world), Dist(rank, world, torch.device("cpu")))
    return run, lambda ds: build_engine(cfg, ds, run.layout, run.shape, run.manifest["tokenizer"], rank)


def _save_damage_resume(rank: int, world: int, config: str) -> dict[str, Any]:
    import os

    import deepspeed.comm as dist

    from pipeline.errors import PipelineError
    from pipeline.train.checkpoint import files as ckpt
    from pipeline.train.checkpoint.checkpointer import Checkpointer
    from pipeline.train.state import TrainState

    run, build = _run(rank, world, config)
    run.run_dir.mkdir(parents=True, exist_ok=True)
    out: dict[str, Any] = {}
    saver = Checkpointer(run, data_fingerprint="fp")
    _, marker = saver.resume(build)
    out["fresh"] = marker
    saver.maybe_save(TrainState(5, 40))  # due: checkpoint.interval is 5
    saver.maybe_save(TrainState(6, 48))  # not due
    saver.maybe_save(TrainState(7, 56), stopping=True)  # a stop saves the step it stopped at
    saver.finish(TrainState(7, 56))  # already saved: nothing more
    out["tags"] = ckpt.complete_tags(run.run_dir)
    out["files"] = sorted(ckpt.read_marker(run.run_dir, "step00000007")["files"])
    out["hosts"] = {e["host"] for e in ckpt.read_marker(run.run_dir, "step00000007")["files"].values()}
    os.environ["PIPELINE_FAULT_ENOSPC_IN_SAVE"] = "10"
    try:
        saver.save(TrainState(10, 80))
    except PipelineError as e:
        out["full_disk"] = str(e)
    del os.environ["PIPELINE_FAULT_ENOSPC_IN_SAVE"]
    out["latest_after_full_disk"] = ckpt.latest_complete(run.run_dir)
    dist.barrier()
    if rank == 0:  # the newest checkpoint truncated, as a crashed copy would leave it
        victim = next((run.run_dir / "step00000007").glob("*optim_states.pt"))
        with open(victim, "r+b") as f:
            f.truncate(victim.stat().st_size // 2)
    dist.barrier()
    _, marker = Checkpointer(run, data_fingerprint="fp").resume(build)
    out["resumed"] = (marker["step"], marker["consumed_samples"]) if marker else None
    try:
        Checkpointer(run, data_fingerprint="other shards").resume(build)
    except PipelineError as e:
        out["refused"] = str(e)
    return out


def test_saves_when_due_lists_every_ranks_files_and_resumes_alike(shards: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    cfg = launch.write_config(tmp_path / "c.yaml", run_dir=run_dir, shards=shards, ds_config="zero1.json")
    got = run_distributed(_save_damage_resume, str(cfg), timeout=300)
    for out in got:
        assert out["fresh"] is None  # nothing to continue: a fresh start
        assert out["tags"] == ["step00000005", "step00000007"]
        assert any("zero_pp_rank_0" in f for f in out["files"]) and any("zero_pp_rank_1" in f for f in out["files"])
        assert out["hosts"] == {socket.gethostname()}  # each file's writer: a per-node run folder is told apart
        assert out["latest_after_full_disk"] == "step00000007"
        assert out["resumed"] == (5, 40)  # step00000007 is damaged: both ranks skip it
        assert (
            "data.path holds other shards than the checkpoint was trained on (fingerprint other shard"
            in (out["refused"])
        )
    assert got[0]["full_disk"] == got[1]["full_disk"]  # one message, on every rank
    assert "checkpoint step00000010 could not be saved (rank 1:" in got[0]["full_disk"]
    assert "step00000007 stays the latest complete checkpoint" in got[0]["full_disk"]
    assert not (run_dir / "step00000010" / "pipeline_complete.json").exists()
