"""pipeline.train.checkpoint.resume: which checkpoint a launch continues from, and why it may not."""

from __future__ import annotations

import pytest

from pipeline.errors import PipelineError
from pipeline.train.checkpoint.files import Marker
from pipeline.train.checkpoint.resume import choose_resume, resume_problems

TAGS = ["step00000005", "step00000010"]
SHAPE = {"hidden_size": 64, "num_layers": 2}


def marker(**kw: object) -> Marker:
    m: Marker = {
        "step": 10,
        "consumed_samples": 80,
        "data_fingerprint": "abc",
        "seq_len": 64,
        "tokenizer_sha256": "t",
        "model_shape": SHAPE,
        "world_size": 2,
    }
    m.update(kw)  # type: ignore[typeddict-item]
    return m


def test_resume_policy_auto_never_and_tag() -> None:
    assert choose_resume("auto", TAGS, "runs/x") == "step00000010"
    assert choose_resume("auto", [], "runs/x") is None
    assert choose_resume("never", [], "runs/x") is None
    with pytest.raises(PipelineError, match="holds checkpoints but checkpoint.resume is never"):
        choose_resume("never", TAGS, "runs/x")
    assert choose_resume("step00000005", TAGS, "runs/x") == "step00000005"
    with pytest.raises(PipelineError, match="checkpoint.resume step00000007: no complete checkpoint"):
        choose_resume("step00000007", TAGS, "runs/x")


def test_resume_refuses_other_data_shape_or_zero_world() -> None:
    same = dict(data_fingerprint="abc", model_shape=SHAPE, world_size=2, zero_stage=1)
    assert resume_problems(marker(), **same) == []  # type: ignore[arg-type]
    other_data = resume_problems(marker(), **{**same, "data_fingerprint": "xyz"})[0]  # type: ignore[arg-type]
    assert "data.path holds other shards than the checkpoint was trained on (fingerprint xyz vs abc" in other_data
    # Each differing field by name with both values, not two dicts.
    wider = resume_problems(marker(), **{**same, "model_shape": {**SHAPE, "hidden_size": 192}})[0]  # type: ignore[arg-type]
    assert wider == f"model hidden_size 192 vs the checkpoint's {SHAPE['hidden_size']}"
    longer = resume_problems(marker(), **{**same, "data_fingerprint": "xyz", "seq_len": 128})  # type: ignore[arg-type]
    assert longer == ["seq_len 128 (the shards of data.path) vs the checkpoint's 64"]
    # Another world size resumes (through a universal checkpoint; tests/multiproc/test_resume_world_size.py), except
    # with the optimizer on NVMe, whose swap files the universal checkpoint does not cover.
    assert resume_problems(marker(), **{**same, "world_size": 4}) == []  # type: ignore[arg-type]
    # A field added to the shape since a checkpoint was written (model.rope) is absent there: unset here, it resumes;
    # set here, it is another model.
    newer = {**same, "model_shape": {**SHAPE, "rope": None}}
    assert resume_problems(marker(), **newer) == []  # type: ignore[arg-type]
    yarn = {**same, "model_shape": {**SHAPE, "rope": {"rope_type": "yarn"}}}
    assert resume_problems(marker(), **yarn) == ["model rope {'rope_type': 'yarn'} vs the checkpoint's None"]  # type: ignore[arg-type]
    assert "optimizer is on NVMe" in resume_problems(marker(), **{**same, "world_size": 4, "nvme_optimizer": True})[-1]  # type: ignore[arg-type]


def test_resume_of_nvme_optimizer_checkpoints_is_refused_with_the_reason() -> None:
    problems = resume_problems(
        marker(), data_fingerprint="abc", model_shape=SHAPE, world_size=2, zero_stage=3, nvme_optimizer=True
    )
    assert len(problems) == 1 and "freshly initialised weights" in problems[0] and "zero3_offload.json" in problems[0]


def test_adamw8bit_is_refused_on_another_world_size_before_any_conversion() -> None:
    same = dict(data_fingerprint="abc", model_shape=SHAPE, zero_stage=2, optimizer="adamw8bit")
    assert resume_problems(marker(), world_size=2, **same) == []  # type: ignore[arg-type]
    problems = resume_problems(marker(), world_size=4, **same)  # type: ignore[arg-type]
    assert len(problems) == 1 and "adamw8bit" in problems[0] and "Resume on 2 ranks" in problems[0]
    assert "model.init_from" in problems[0]


@pytest.mark.parametrize(
    "saved, now, refused",
    [(1, 2, False), (2, 1, False), (2, 3, True), (3, 2, True), (0, 2, True), (3, 3, False), (0, 0, False)],
)
def test_a_zero_stage_deepspeed_cannot_load_is_refused_by_name(saved: int, now: int, refused: bool) -> None:
    """DeepSpeed saves ZeRO 1 and 2 alike (they load each other's), 0 and 3 each their own way: loading across
    fails deep inside DeepSpeed (an AssertionError in its state-dict loader, measured: 2 -> 3)."""
    same = dict(data_fingerprint="abc", model_shape=SHAPE, world_size=2)
    problems = resume_problems(marker(zero_stage=saved), zero_stage=now, **same)  # type: ignore[arg-type]
    assert bool(problems) == refused, problems
    if refused:
        assert problems[0].startswith(f"ZeRO stage {now} (train.deepspeed_config) vs the checkpoint's ")
        assert "resume with the setting it was saved with" in problems[0]


def test_a_checkpoint_from_before_the_marker_said_its_stage_is_read_from_its_files(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from pipeline.train.checkpoint.files import saved_zero_layout

    layouts = {
        "zero-3": ["zero_pp_rank_0_mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt"],
        "zero-1/2": ["mp_rank_00_model_states.pt", "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt"],
        "zero-0": ["mp_rank_00_model_states.pt"],
    }
    for layout, names in layouts.items():
        tag = tmp_path / layout.replace("/", "_")
        tag.mkdir()
        for n in names:
            (tag / n).write_bytes(b"")
        assert saved_zero_layout(tmp_path, tag.name, marker()) == layout
        assert saved_zero_layout(tmp_path, tag.name, marker(zero_stage=2)) == "zero-1/2"  # the marker wins


@pytest.mark.parametrize(
    "field, saved, now",
    [("precision", "bf16", "fp32"), ("precision", "fp32", "fp16"), ("optimizer", "adamw", "muon")],
)
def test_a_changed_precision_or_optimizer_is_refused_by_name(field: str, saved: str, now: str) -> None:
    same = dict(data_fingerprint="abc", model_shape=SHAPE, world_size=2, zero_stage=2)
    problems = resume_problems(marker(**{field: saved}), **same, **{field: now})  # type: ignore[arg-type]
    name = {"precision": "train.precision", "optimizer": "optim.name"}[field]
    assert len(problems) == 1 and problems[0].startswith(f"{name} {now} vs the checkpoint's {saved}: "), problems
    # a checkpoint from before the field was recorded: not refused on it
    assert resume_problems(marker(), **same, **{field: now}) == []  # type: ignore[arg-type]
