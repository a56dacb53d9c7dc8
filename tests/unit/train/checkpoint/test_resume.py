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
    assert resume_problems(marker(), **yarn) == ["model rope {'rope_type': 'yarn'}, not in the checkpoint's"]  # type: ignore[arg-type]
    # nested configs by the dotted path of each differing field, not two whole dicts (newcomer trial 4, #53)
    hf = {"model_type": "llama", "rope_scaling": {"rope_type": "llama3", "factor": 8.0}, "vocab_size": 128256}
    saved = marker() | {"model_shape": {**SHAPE, "hf_config": hf}}
    extended = {**hf, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}
    (said,) = resume_problems(saved, **{**same, "model_shape": {**SHAPE, "hf_config": extended}})  # type: ignore[arg-type]
    assert said == (
        "model hf_config.rope_scaling.rope_type yarn vs the checkpoint's llama3, "
        "hf_config.rope_scaling.factor 4.0 vs the checkpoint's 8.0"
    )
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


def test_a_branch_that_cannot_continue_says_so_as_a_branch_and_names_an_early_stage(
    shards, tokenized, tmp_path
) -> None:  # type: ignore[no-untyped-def]
    """A branch whose data stage begins before the checkpoint it branches from (newcomer trial 4, #59, #60): the
    refusal says it is a branch, names checkpoint.branch_from, and names the stage and its step as the cause; no
    'use a new run_dir' (it is new already). A resume of the run's own checkpoint keeps its wording."""
    from pipeline.data import shard as shard_stage
    from pipeline.data.config import ShardConfig
    from pipeline.data.manifest import read_shard_manifest
    from pipeline.train.checkpoint.resume import continue_from
    from pipeline.train.setup.config import load
    from pipeline.train.setup.prepare import prepare
    from tests.multiproc import launch

    other = tmp_path / "other-shards"  # the same text shuffled with another seed: other shards
    shard_stage.run(
        ShardConfig(
            sources=((str(tokenized), 1.0),), output=str(other), seq_len=64, split=(80.0, 10.0, 10.0), seed=7,
            progress=False,
        )
    )  # fmt: skip
    stage = f"data: {{path: {shards}, num_workers: 1, stages: {{3: {other}}}}}"
    cfg = launch.write_config(tmp_path / "c.yaml", run_dir=tmp_path / "branch", shards=shards, ds_config="zero1.json")
    cfg.write_text(cfg.read_text().replace(f"data: {{path: {shards}, num_workers: 1, verify: true}}", stage))
    prepared = prepare(load(str(cfg)), 1)
    saved = marker(
        step=8,
        data_fingerprint=read_shard_manifest(shards)["fingerprint"],
        seq_len=prepared.plan.seq_len,
        model_shape=prepared.shape.as_dict(),
        world_size=1,
        zero_stage=1,
    )
    source = tmp_path / "stable"
    with pytest.raises(PipelineError) as e:
        continue_from(prepared, 1, "step00000008", saved, folder=source)
    said = str(e.value)
    assert said.startswith(f"cannot branch from {source}/step00000008 (checkpoint.branch_from): ")
    assert f"data.stages starts {other} at step 3, before the checkpoint's step 8" in said
    assert "A branch continues its source's checkpoint under this config" in said and "new run_dir" not in said
    with pytest.raises(PipelineError, match="cannot resume .*Use a new run_dir to start fresh"):
        continue_from(prepared, 1, "step00000008", saved)


def _leaves(d: dict, prefix: str = "") -> list[str]:
    out = []
    for k, v in d.items():
        path = f"{prefix}{k}"
        out += _leaves(v, path + ".") if isinstance(v, dict) and v and path.count(".") < 1 else [path]
    return out


def test_every_config_field_is_classified_for_a_resume() -> None:
    """A field that changes between a checkpoint and the config that continues it is checked, refused, noted or
    free by a rule of RESUME_RULES: a new field without one fails here, so it is classified where it lands."""
    from pipeline.train.checkpoint.resume import rule_for
    from pipeline.train.setup.config import PretrainConfig

    unclassified = [p for p in _leaves(PretrainConfig().to_dict()) if rule_for(p) is None]
    assert not unclassified, f"config fields with no resume rule: {unclassified}"


def test_a_changed_field_is_refused_noted_or_let_be_by_its_rule() -> None:
    from dataclasses import replace

    from pipeline.train.checkpoint.resume import config_changes
    from pipeline.train.setup.config import PretrainConfig

    then = PretrainConfig()
    seed = replace(then, train=replace(then.train, seed=7))
    refused, note = config_changes(seed.to_dict(), then.to_dict(), 40)
    assert (
        refused
        == [
            "train.seed 7 vs the checkpoint's 1234: the order the shards' samples are drawn in: the samples not yet "
            "trained would be drawn in another order, some trained twice and others never; keep the checkpoint's seed"
        ]
        and note is None
    )
    decay = replace(then, optim=replace(then.optim, weight_decay=0.05), log=replace(then.log, interval=1))
    refused, note = config_changes(decay.to_dict(), then.to_dict(), 40)
    assert not refused
    assert note == (
        "note: changed since step 40: optim.weight_decay 0.05 vs the checkpoint's 0.1 (the optimizer's update from "
        "this step on)"
    )
    lr = replace(then, optim=replace(then.optim, lr=1e-4))  # the schedule's own note says it, with the numbers
    assert config_changes(lr.to_dict(), then.to_dict(), 40) == ([], None)
    assert config_changes(seed.to_dict(), None, 40) == ([], None)  # a checkpoint from before configs were recorded
