"""pipeline.train.setup.stages and checkpoint.branch_from's choice: which stage trains which update, where a stage
starts reading, the refusals of stages that cannot run, and which checkpoint a branch starts from."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from pipeline.data.manifest import read_shard_manifest
from pipeline.errors import PipelineError
from pipeline.train.checkpoint import files as ckpt
from pipeline.train.checkpoint.resume import resumable
from pipeline.train.setup.stages import stage_at, stage_of_checkpoint, stage_problems, stages
from tests.conftest import shard_into


def test_each_update_trains_on_the_last_stage_begun_and_positions_count_from_it() -> None:
    data = SimpleNamespace(path="a", stages={20: "c", 8: "b"})
    assert [(s.index, s.from_step, s.path) for s in stages(data)] == [(0, 0, "a"), (1, 8, "b"), (2, 20, "c")]
    assert [stage_at(data, u).path for u in (0, 7, 8, 19, 20, 99)] == ["a", "a", "b", "b", "c", "c"]
    assert stage_of_checkpoint(data, 8).path == "a" and stage_of_checkpoint(data, 9).path == "b"
    assert stage_at(data, 8).position(consumed_samples=8 * 6, global_batch_size=6) == 0
    assert stage_at(data, 12).position(consumed_samples=12 * 6, global_batch_size=6) == 24


def test_stages_that_cannot_run_are_refused_naming_step_and_folder(
    shards: Path, tokenized: Path, tmp_path: Path
) -> None:
    other_len = tmp_path / "seq32"
    shard_into([(tokenized, 1.0)], other_len, seq_len=32)
    first = read_shard_manifest(shards)
    data = SimpleNamespace(path=str(shards), stages={0: str(shards), 50: str(shards), 5: str(other_len), 6: "nowhere"})
    found = "\n".join(stage_problems(data, first, max_steps=40))
    assert "data.stages 0: expected a step between 1 and the run's 39" in found
    assert "data.stages 50: expected a step between 1" in found
    assert f"data.stages 5: {other_len} has seq_len 32, data.path 64" in found
    assert "data.stages 6: nowhere: no such folder" in found
    assert stage_problems(SimpleNamespace(path=str(shards), stages={5: str(shards)}), first, 40) == []


def _checkpoint(run: Path, step: int) -> None:
    tag = ckpt.tag_for(step)
    (run / tag).mkdir(parents=True)
    (run / tag / "mp_rank_00_model_states.pt").write_bytes(b"x")
    ckpt.mark_complete(run, tag, {"step": step})  # type: ignore[typeddict-item]


def test_a_branch_starts_from_the_source_until_its_own_run_folder_holds_a_checkpoint(tmp_path: Path) -> None:
    source, branch = tmp_path / "stable", tmp_path / "cooldown"
    for step in (10, 20):
        _checkpoint(source, step)
    found = resumable(branch, "auto", False, str(source / "step00000010"))
    assert found is not None and (found.tag, found.folder) == ("step00000010", source)
    latest = resumable(branch, "auto", False, str(source))
    assert latest is not None and latest.tag == "step00000020"
    _checkpoint(branch, 12)  # the branch saved: from now on it resumes its own
    own = resumable(branch, "auto", False, str(source / "step00000010"))
    assert own is not None and (own.tag, own.folder) == ("step00000012", branch)
    assert resumable(tmp_path / "fresh", "auto", False, None) is None


@pytest.mark.parametrize(
    "where, says",
    [
        ("stable/step00000030", r"no such checkpoint .* holds step00000010"),
        ("nowhere", "nowhere: no such run folder or checkpoint"),
    ],
)
def test_a_branch_from_a_checkpoint_that_is_not_there_is_one_line(tmp_path: Path, where: str, says: str) -> None:
    _checkpoint(tmp_path / "stable", 10)
    (tmp_path / "cooldown").mkdir()
    with pytest.raises(PipelineError, match=says):
        resumable(tmp_path / "cooldown", "auto", False, str(tmp_path / where))


def test_a_branch_with_a_resume_tag_names_the_conflict(tmp_path: Path) -> None:
    """checkpoint.resume TAG beside branch_from on a branch's first launch (newcomer trial 4, #62): the two fields
    named together, and which one says where a branch starts."""
    _checkpoint(tmp_path / "stable", 10)
    (tmp_path / "cooldown").mkdir()
    with pytest.raises(PipelineError, match="checkpoint.resume step00000010 with checkpoint.branch_from .*leave "):
        resumable(tmp_path / "cooldown", "step00000010", False, str(tmp_path / "stable"))
