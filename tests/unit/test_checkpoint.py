"""Checkpoint layout rules: only complete tags count, `latest` follows the marker, pruning keeps the latest."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.errors import PipelineError
from pipeline.train import checkpoint as ckpt


def _save(run: Path, step: int, complete: bool = True) -> str:
    tag = ckpt.tag_for(step)
    (run / tag).mkdir(parents=True)
    (run / tag / "mp_rank_00_model_states.pt").write_bytes(b"x")
    if complete:
        ckpt.mark_complete(run, tag, {"step": step})
    return tag


def test_incomplete_checkpoint_is_never_latest(tmp_path: Path) -> None:
    _save(tmp_path, 10)
    _save(tmp_path, 20, complete=False)  # a save that crashed half way
    assert ckpt.latest_complete(tmp_path) == "step00000010"
    assert (tmp_path / "latest").read_text() == "step00000010"
    assert ckpt.resolve_checkpoint(tmp_path) == (tmp_path, "step00000010")
    with pytest.raises(PipelineError, match="incomplete"):
        ckpt.resolve_checkpoint(tmp_path / "step00000020")


def test_prune_keeps_last_k_and_never_the_latest(tmp_path: Path) -> None:
    for s in (10, 20, 30, 40):
        _save(tmp_path, s)
    _save(tmp_path, 35, complete=False)
    ckpt.prune(tmp_path, keep_last=2)
    assert ckpt.complete_tags(tmp_path) == ["step00000030", "step00000040"]
    assert not (tmp_path / "step00000035").exists()
    ckpt.prune(tmp_path, keep_last=0)  # even a nonsensical K keeps the latest
    assert ckpt.complete_tags(tmp_path) == ["step00000040"]


def test_not_a_run_folder(tmp_path: Path) -> None:
    with pytest.raises(PipelineError, match="no complete checkpoint"):
        ckpt.resolve_checkpoint(tmp_path)
    with pytest.raises(PipelineError, match="no such run folder"):
        ckpt.resolve_checkpoint(tmp_path / "missing")


def test_a_pruned_tag_names_the_ones_that_exist(tmp_path: Path) -> None:
    for s in (30, 40):
        _save(tmp_path, s)
    with pytest.raises(PipelineError, match=r"step00000020: no such checkpoint .* holds step00000030, step00000040"):
        ckpt.resolve_checkpoint(tmp_path / "step00000020")
