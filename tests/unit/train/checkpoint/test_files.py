"""Checkpoint layout rules: only complete tags count, `latest` follows the marker, pruning keeps the latest."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.errors import PipelineError
from pipeline.train.checkpoint import files as ckpt


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


def _save_on_hosts(run: Path, step: int, hosts: dict[str, str], here: bool = True) -> str:
    """A complete checkpoint as a two-node run with node-local run folders leaves it on the first node: every
    rank's file is listed in the marker with the host that wrote it, and only this host's files are here."""
    import socket

    tag = ckpt.tag_for(step)
    (run / tag).mkdir(parents=True)
    files = {}
    for name, host in hosts.items():
        if host == socket.gethostname() or not here:
            (run / tag / name).write_bytes(b"shard")
        files[name] = {"size": 5, "host": host}
    ckpt.mark_complete(run, tag, {"step": step, "files": files})  # type: ignore[typeddict-item]
    return tag


def test_a_run_folder_on_each_nodes_own_disk_is_refused_naming_the_hosts(tmp_path: Path) -> None:
    """F1 of the multi-node review: the other nodes' shards are absent, not damaged. Resume, evaluate and export
    refuse, naming the hosts, instead of starting again from step 0."""
    import socket

    from pipeline.train.checkpoint.resume import resumable

    here = socket.gethostname()
    for step in (500, 1000):
        _save_on_hosts(
            tmp_path,
            step,
            {"zero_pp_rank_0_optim_states.pt": here, "zero_pp_rank_1_optim_states.pt": "node-b", "x": "node-c"},
        )
    for call in (
        lambda: resumable(tmp_path, "auto", False),
        lambda: resumable(tmp_path, "step00000500", False),
        lambda: ckpt.resolve_checkpoint(tmp_path),
        lambda: ckpt.resolve_checkpoint(tmp_path / "step00000500"),
    ):
        with pytest.raises(PipelineError) as e:
            call()
        assert "is not one folder shared by every node: checkpoint step0000" in str(e.value)
        assert f"written on node-b, node-c that {here} cannot see" in str(e.value)


def test_a_shared_run_folder_of_several_hosts_resumes(tmp_path: Path) -> None:
    from pipeline.train.checkpoint.resume import resumable

    _save_on_hosts(tmp_path, 10, {"a.pt": "node-a", "b.pt": "node-b"}, here=False)  # all visible: shared
    found = resumable(tmp_path, "auto", False)
    assert found is not None and found[0] == "step00000010"


def test_checkpoints_none_of_which_is_intact_never_restart_the_run_from_step_0(tmp_path: Path) -> None:
    import socket

    from pipeline.train.checkpoint.resume import resumable

    for step in (10, 20):
        _save_on_hosts(tmp_path, step, {"mp_rank_00_model_states.pt": socket.gethostname()})
        (tmp_path / ckpt.tag_for(step) / "mp_rank_00_model_states.pt").unlink()  # damaged on this very host
    with pytest.raises(PipelineError, match=r"holds 2 complete checkpoint\(s\) and none is intact, so the run would"):
        resumable(tmp_path, "auto", False)


def test_prune_never_deletes_the_checkpoint_just_written(tmp_path: Path) -> None:
    """After a run restarted below its newest checkpoint (an explicit checkpoint.resume of an older tag), the
    first save is kept: `latest` names it."""
    for s in (400, 500):
        _save(tmp_path, s)
    new = _save(tmp_path, 10)
    ckpt.prune(tmp_path, keep_last=1, keep=new)
    assert (tmp_path / new).is_dir() and (tmp_path / "latest").read_text() == new
    assert ckpt.complete_tags(tmp_path) == ["step00000010", "step00000500"]  # the newest step stays as well


def test_prune_orders_by_the_step_in_the_marker(tmp_path: Path) -> None:
    for s in (10, 20, 30):
        _save(tmp_path, s)
    ckpt.mark_complete(tmp_path, "step00000010", {"step": 99})  # a marker whose step its name does not say
    ckpt.prune(tmp_path, keep_last=2)
    assert ckpt.complete_tags(tmp_path) == ["step00000010", "step00000030"]


def test_a_conversion_that_cannot_fit_is_refused_before_it_starts(tmp_path: Path) -> None:
    """F4 of the multi-node review: a disk with room for the checkpoints but not the conversion (about twice the
    optimizer states), and a node whose memory cannot hold one whole shard, are said before an hour of work;
    a node that holds one shard but not two converts with one process."""
    tag = _save(tmp_path, 100)
    for rank in range(2):  # sparse files: the sizes of a real checkpoint's shards, no disk used
        with open(tmp_path / tag / f"bf16_zero_pp_rank_{rank}_mp_rank_00_optim_states.pt", "wb") as f:
            f.truncate(40 * 10**9)
    assert ckpt.conversion_plan(tmp_path, tag, free_disk=200e9, available_ram=100e9) == (2, None)
    workers, problem = ckpt.conversion_plan(tmp_path, tag, free_disk=120e9, available_ram=100e9)
    assert workers == 2 and problem is not None
    assert "needs about 160.0 GB for it" in problem and "has 120.0 GB free" in problem
    assert ckpt.conversion_plan(tmp_path, tag, free_disk=200e9, available_ram=60e9) == (1, None)
    _, problem = ckpt.conversion_plan(tmp_path, tag, free_disk=200e9, available_ram=30e9)
    assert problem is not None and "loads each optimizer shard whole (40.0 GB)" in problem
    assert "--num_extract_workers 1" in problem


@pytest.mark.parametrize(
    "spec, want",
    [
        ("last:3", ["step00000020", "step00000030", "step00000040"]),
        ("last:2", ["step00000030", "step00000040"]),
        ("40,10", ["step00000010", "step00000040"]),
        ("step00000020, step00000030", ["step00000020", "step00000030"]),
    ],
)
def test_average_names_the_newest_or_the_listed_checkpoints_oldest_first(tmp_path: Path, spec: str, want: list) -> None:
    for s in (10, 20, 30, 40):
        _save(tmp_path, s)
    _save(tmp_path, 50, complete=False)  # a save that crashed is never averaged
    assert ckpt.average_tags(tmp_path, spec) == want


@pytest.mark.parametrize(
    "spec, says",
    [
        ("last:5", r"--average last:5: .* holds step00000010, step00000020 \(the run has saved 2 so far\)"),
        ("runs/stable/step00000008,20", r"runs/stable/step00000008 is a path; --average names .*copy its folder"),
        ("last:1", "N of 2 or more"),
        ("last:x", "N of 2 or more"),
        ("10,50", r"no complete checkpoint step00000050; .* holds step00000010"),
        ("10,10", "two or more different checkpoints"),
    ],
)
def test_an_average_of_checkpoints_that_are_not_there_is_refused_naming_what_is(
    tmp_path: Path, spec: str, says: str
) -> None:
    for s in (10, 20):
        _save(tmp_path, s)
    with pytest.raises(PipelineError, match=says):
        ckpt.average_tags(tmp_path, spec)


def test_a_branch_short_of_checkpoints_to_average_says_why(tmp_path: Path) -> None:
    """A fresh branch holds only its own saves (newcomer trial 4, #68): --average last:3 says so and where the
    branch point is, instead of blaming keep_last; a run that pruned says keep_last."""
    from pipeline.atomic import write_text

    for s in (10, 12):
        _save(tmp_path, s)
    write_text(tmp_path / "config.yaml", "checkpoint: {branch_from: runs/stable/step00000008, keep_last: 10}\n")
    with pytest.raises(PipelineError, match="a branch holds only the checkpoints it saved itself; its branch point"):
        ckpt.average_tags(tmp_path, "last:3")
    write_text(tmp_path / "config.yaml", "checkpoint: {keep_last: 2}\n")
    with pytest.raises(PipelineError, match="checkpoint.keep_last 2 prunes older ones"):
        ckpt.average_tags(tmp_path, "last:3")
