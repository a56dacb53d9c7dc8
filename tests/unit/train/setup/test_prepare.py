"""pipeline.train.setup.prepare: the planner's card for this GPU under a memory cap."""

from __future__ import annotations

from dataclasses import replace

import pytest

from pipeline.errors import PipelineError


def test_auto_plan_uses_the_memory_cap() -> None:
    from pipeline.train.setup.prepare import planning_card

    h200 = 143 * 10**9
    assert planning_card("NVIDIA H200", h200, None).memory_gib == pytest.approx(h200 / 2**30)
    capped = planning_card("NVIDIA H200", h200, 24.0)
    assert capped.memory_gib == 24.0 and capped.bf16_tflops == 989.0
    with pytest.raises(PipelineError, match="no planner data for GPU 'NVIDIA Voodoo2'"):
        planning_card("NVIDIA Voodoo2", h200, None)


def test_a_resumed_run_of_another_length_says_its_schedule_is_re_stretched(shards) -> None:
    """An 80-step run resumed with train.max_steps 140: the cosine schedule is stretched to 140 steps, which moves
    the learning rate at the resume step; the launcher and rank 0 say so, with both rates."""
    from pipeline.train.checkpoint.resume import schedule_note
    from pipeline.train.setup.config import from_dict
    from pipeline.train.setup.prepare import prepare
    from pipeline.train.setup.schedule import lr_at

    raw = {
        "data": {"path": str(shards)},
        "batch": {"micro_batch_size": 2, "global_batch_size": 4},
        "optim": {"lr": 1e-3, "min_lr": 1e-4, "warmup_steps": 5},
        "train": {"max_steps": 140, "deepspeed_config": "ds_configs/zero1.json"},
    }
    prepared = prepare(from_dict(raw), 2)
    marker = {"step": 60, "max_steps": 80}
    note = schedule_note(prepared, marker)  # type: ignore[arg-type]
    before, now = lr_at(60, prepared.cfg, 80), lr_at(60, prepared.cfg, 140)
    assert note is not None and before < now
    assert "from 80 to 140 steps since 60" in note and f"lr at step 60: {before:.3g} before, {now:.3g} now" in note
    assert schedule_note(prepared, {"step": 60, "max_steps": 140}) is None  # type: ignore[arg-type]
    assert schedule_note(prepared, {"step": 60}) is None  # type: ignore[arg-type]  # checkpoints from before


def test_sequence_parallel_over_whole_documents_is_refused_on_sdpa_and_prepared_on_the_varlen_path(
    tokenized, tmp_path
) -> None:
    """Ulysses attention over SDPA drops the attention mask (it attends causally over the whole sample), so the
    documents of a --whole-documents sample would see each other: refused before launch with document_attention
    dense; prepared on the varlen path (auto, which the CPU always has), and at sequence parallel 1 either way."""
    from pipeline.errors import ConfigError
    from pipeline.train.setup.config import from_dict
    from pipeline.train.setup.prepare import prepare
    from tests.conftest import shard_into

    out = tmp_path / "whole"
    shard_into(
        [(tokenized, 1.0)], out, seq_len=64, split=(80.0, 10.0, 10.0), cross_document=False, whole_documents=True
    )
    train = {"max_steps": 2, "deepspeed_config": "ds_configs/zero2.json", "sequence_parallel": 2}
    raw = {
        "data": {"path": str(out)},
        "batch": {"micro_batch_size": 1, "global_batch_size": 2},
        "train": {**train, "document_attention": "dense"},
    }
    with pytest.raises(ConfigError, match=r"train.sequence_parallel 2: .*--whole-documents.*use sequence_parallel 1"):
        prepare(from_dict(raw), 2)
    prepared = prepare(from_dict({**raw, "train": train}), 2)
    assert prepared.plan.sequence_parallel == 2 and prepared.documents.kind == "varlen"
    one = prepare(from_dict({**raw, "train": {**raw["train"], "sequence_parallel": 1}}), 2)
    assert one.documents.kind == "dense" and "a 4 KiB boolean mask" in one.documents.note


def test_a_deepspeed_older_than_the_code_needs_is_one_line_naming_the_version() -> None:
    from pipeline.train.runtime.ds_workarounds import deepspeed_version_problems

    (line,) = deepspeed_version_problems("0.19.5")
    assert line.startswith("deepspeed 0.19.5 is installed; this pipeline needs 0.19.8 or later")
    assert "pip install 'deepspeed>=0.19.8,<0.20'" in line
    assert deepspeed_version_problems("0.19.8") == [] and deepspeed_version_problems("0.19.10") == []
    assert deepspeed_version_problems() == []  # the installed one


def test_a_wsd_run_extended_while_stable_resumes_with_a_clean_note_and_inside_its_decay_it_is_warned(shards) -> None:
    """The resume rule over the schedule recorded in the checkpoint: a warmup-stable-decay run extended from 100
    to 200 steps at step 60 (stable) changes no trained rate; extended at step 90 (inside the decay) it does, and
    so does a schedule changed between launches."""
    from pipeline.train.checkpoint.resume import schedule_note
    from pipeline.train.setup.config import from_dict
    from pipeline.train.setup.prepare import prepare
    from pipeline.train.setup.schedule import Schedule

    def prepared(steps: int, **optim: object):  # noqa: ANN202
        return prepare(
            from_dict(
                {
                    "data": {"path": str(shards)},
                    "batch": {"micro_batch_size": 2, "global_batch_size": 4},
                    "optim": {"lr": 1e-3, "min_lr": 1e-4, "warmup_steps": 5, "schedule": "wsd", "decay_steps": 20}
                    | optim,
                    "train": {"max_steps": steps, "deepspeed_config": "ds_configs/zero1.json"},
                }
            ),
            2,
        )

    saved = Schedule.of(prepared(100).cfg).as_dict()
    clean = schedule_note(prepared(200), {"step": 60, "max_steps": 100, "schedule": saved})  # type: ignore[arg-type]
    assert clean is not None and "continues cleanly" in clean and "stable to step 180" in clean
    late = schedule_note(prepared(200), {"step": 90, "max_steps": 100, "schedule": saved})  # type: ignore[arg-type]
    assert late is not None and "re-stretched to 200 steps from update 81 on" in late
    other = schedule_note(prepared(100, decay_shape="sqrt"), {"step": 90, "max_steps": 100, "schedule": saved})  # type: ignore[arg-type]
    assert other is not None and "decay_shape linear -> sqrt" in other and "re-stretched" in other
    assert schedule_note(prepared(100), {"step": 90, "max_steps": 100, "schedule": saved}) is None  # type: ignore[arg-type]


TILES_MODEL = {"hidden_size": 16, "num_layers": 2, "ffn_hidden_size": 4096, "num_heads": 2, "num_kv_heads": 2}
"""A model whose SwiGLU intermediates dominate its activations (ffn 256 x hidden): at seq 64 the tiled MLP (4 tiles,
one per hidden_size tokens) is what separates fitting from not."""


def tiles_only_cap(prepared) -> float:  # noqa: ANN001
    """The emulated card (GiB) between the smallest configuration the search prices untiled for this run and the
    smallest tiled one, plus the margin: only a tiled layout fits it."""
    from pipeline.plan import search as planner
    from pipeline.plan.cluster import Cluster, Stack
    from pipeline.plan.estimate import estimate
    from pipeline.plan.memory import MARGIN_MIN_BYTES
    from pipeline.train.runtime.dist import host_ram_bytes
    from pipeline.train.setup.prepare import cpu_card, optimizer_fit

    shape, plan, cfg = prepared.shape, prepared.plan, prepared.cfg
    ram = host_ram_bytes()
    c = Cluster(1, 2, cpu_card(ram, 2), ram)
    found = planner.search(
        shape,
        plan.seq_len,
        c,
        plan.tokens_per_step,
        fixed_micro=plan.micro_batch_size,
        loss_chunk_tokens=cfg.train.loss_chunk_tokens,
        fixed_sequence=1,
        optimizer=optimizer_fit(cfg.optim.name),
        stack=Stack(),
    )
    untiled = [e for e in found.ranked + found.rejected if e.layout.tiled_mlp <= 1]
    tiles = planner.mlp_tiles(plan.seq_len, shape.hidden_size)
    least = min(e.gpu["reserved"] for e in untiled)
    tiled = min(
        estimate(shape, plan.seq_len, c, replace(e.layout, tiled_mlp=tiles), None, cfg.train.loss_chunk_tokens).gpu[
            "reserved"
        ]
        for e in untiled
    )
    assert tiled < least, (tiled, least)
    return ((least + tiled) / 2 + MARGIN_MIN_BYTES) / 2**30


def test_auto_on_a_card_only_a_tiled_layout_fits_runs_the_tiles_it_priced(shards) -> None:
    """`deepspeed_config: auto` on an emulated card (train.gpu_memory_cap_gib, the CPU's stand-in for a GPU) that
    only a tiled MLP fits: the prepared run tiles as the planner chose (one record: what was priced runs), and a
    roomier card leaves it untiled."""
    from pipeline.train.setup.config import from_dict
    from pipeline.train.setup.prepare import prepare

    raw = {
        "model": {"shape": TILES_MODEL},
        "data": {"path": str(shards)},
        "batch": {"micro_batch_size": 2, "global_batch_size": 4},
        "train": {"max_steps": 2, "deepspeed_config": "auto", "loss_chunk_tokens": 48},
    }
    roomy = prepare(from_dict(raw), 2, local_size=2)
    assert roomy.cfg.train.tiled_mlp == 0
    cap = tiles_only_cap(roomy)
    tight = prepare(from_dict({**raw, "train": {**raw["train"], "gpu_memory_cap_gib": cap}}), 2, local_size=2)
    assert tight.cfg.train.tiled_mlp == 4


def test_below_the_preparation_the_run_reads_its_layout() -> None:
    """The ZeRO stage, the offloads, checkpointing, sequence parallelism and the tiles are read from the config and
    the DeepSpeed JSON once, into the run's Layout (`Prepared.layout`, the record the planner prices); the engine,
    the loop, checkpoints and the runtime read them from it, so what runs is what was priced. Read from the source:
    a new read of the config or the JSON below the preparation fails here."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[4] / "pipeline" / "train"
    below = [root / f for f in ("engine.py", "loop.py", "step.py", "state.py", "faults.py", "main.py")]
    below += [p for d in ("checkpoint", "parts", "runtime") for p in (root / d).glob("*.py")]
    reads = re.compile(  # a field read as code; a quoted name (resume.RESUME_RULES' keys) is not a read
        r"(?<![\"'])train\.(sequence_parallel|tiled_mlp|activation_checkpointing)\b|zero_stage\(|offload_devices\("
        r"|\[\"zero_optimization\"\]\[\"stage\"\]|get\(\"stage\""
    )
    found = [
        f"{p.relative_to(root.parent.parent)}:{n}: {line.strip()}"
        for p in below
        for n, line in enumerate(p.read_text().splitlines(), start=1)
        if reads.search(line)
    ]
    assert len(below) > 15 and not found, found


def test_the_prepared_layout_is_what_the_config_and_its_json_say(tmp_path) -> None:
    """prepare() reads the run's Layout through the planner's own reader: the JSON's stage and offloads, the
    config's checkpointing, sequence-parallel size and tiles, the batch the world gives."""
    import json

    from pipeline.train.setup.config import from_dict
    from pipeline.train.setup.prepare import run_layout

    ds = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 4,
        "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}},
        "activation_checkpointing": {"cpu_checkpointing": True},
    }
    train = {"sequence_parallel": 2, "tiled_mlp": 4, "activation_checkpointing": True, "max_steps": 1}
    cfg = from_dict({"batch": {"global_batch_size": 8}, "train": train})
    layout = run_layout(cfg, json.loads(json.dumps(ds)))
    assert (layout.stage, layout.offload_optimizer, layout.offload_param) == (3, "cpu", "none")
    assert (layout.micro_batch_size, layout.grad_accum, layout.sequence_parallel, layout.tiled_mlp) == (2, 4, 2, 4)
    assert layout.activation_checkpointing and layout.offload_activations
