"""The resume decision, every rule of it: which checkpoint a launch continues (`resumable`: the policy, damaged and
unshared checkpoints), whether this config may continue it (`continuation_problems`) and what changed in its
schedule (`schedule_note`). `pipeline pretrain` asks before launch (pipeline.train.preflight), rank 0's
Checkpointer asks again at start; the files themselves are pipeline.train.checkpoint.files's."""

from __future__ import annotations

from pathlib import Path
from typing import Any, NamedTuple

from pipeline.errors import PipelineError
from pipeline.train.checkpoint import files as ckpt
from pipeline.train.checkpoint.files import Marker
from pipeline.train.setup.optimizers import OPTIMIZERS
from pipeline.train.setup.prepare import Prepared
from pipeline.train.setup.schedule import Schedule, first_changed_step, learning_rate, max_steps_for
from pipeline.train.setup.stages import fingerprint_at


def choose_resume(policy: str, complete_tags: list[str], run_dir: str) -> str | None:
    """The tag to resume from under `checkpoint.resume` (auto | never | a tag), given the run folder's complete
    checkpoints (oldest first); None starts fresh."""
    if policy == "auto":
        return complete_tags[-1] if complete_tags else None
    if policy == "never":
        if complete_tags:
            raise PipelineError(
                f"{run_dir} holds checkpoints but checkpoint.resume is never; use another run_dir or resume: auto"
            )
        return None
    if policy not in complete_tags:
        raise PipelineError(f"checkpoint.resume {policy}: no complete checkpoint of that tag in {run_dir}")
    return policy


def resume_problems(
    marker: Marker,
    *,
    data_fingerprint: str,
    model_shape: dict[str, Any],
    world_size: int,
    zero_stage: int,
    nvme_optimizer: bool = False,
    optimizer: str = "adamw",
    seq_len: int | None = None,
    precision: str | None = None,
    saved_layout: str | None = None,
) -> list[str]:
    """Why this launch cannot continue the checkpoint described by `marker` (empty: it can), each naming the
    field and both values. `saved_layout`: the ZeRO file layout the checkpoint was saved in (ckpt.saved_zero_layout;
    None: the marker's own `zero_stage`, when it records one)."""
    problems = []
    # What DeepSpeed writes differently: its ZeRO layout (1 and 2 share one), the precision's optimizer files, the
    # optimizer's states. A changed one fails deep in DeepSpeed's load (an AssertionError, a missing file); said here.
    way_out = "resume with the setting it was saved with"
    if saved_layout is None and "zero_stage" in marker:
        saved_layout = ckpt.zero_layout(int(marker["zero_stage"]))
    if saved_layout is not None and saved_layout != ckpt.zero_layout(zero_stage):
        problems.append(
            f"ZeRO stage {zero_stage} (train.deepspeed_config) vs the checkpoint's {saved_layout.replace('zero-', '')}"
            f": DeepSpeed saves {saved_layout} and {ckpt.zero_layout(zero_stage)} in other files and loads neither "
            f"into the other; {way_out}"
        )
    if precision is not None and marker.get("precision", precision) != precision:
        problems.append(
            f"train.precision {precision} vs the checkpoint's {marker['precision']}: DeepSpeed keeps each "
            f"precision's optimizer states in other files; {way_out}"
        )
    if marker.get("optimizer", optimizer) != optimizer:
        problems.append(
            f"optim.name {optimizer} vs the checkpoint's {marker['optimizer']}: its optimizer states are another "
            f"optimizer's; {way_out}"
        )
    if nvme_optimizer:
        # Measured (tests/multiproc/test_pretrain.py): DeepSpeed 0.19.8 saves the NVMe swap files into the
        # checkpoint and copies them back on load, yet the resumed run trains on freshly initialised weights (its
        # loss returns to the first step's). Refuse rather than restart silently.
        problems.append(
            "the DeepSpeed config offloads the optimizer to NVMe, and DeepSpeed 0.19 resumes such "
            "checkpoints with freshly initialised weights instead of the saved ones; resuming is "
            "refused until that is fixed upstream (start a new run_dir, or train with "
            "ds_configs/zero3_offload.json, whose checkpoints resume exactly)"
        )
    if seq_len is not None and "seq_len" in marker and marker["seq_len"] != seq_len:
        problems.append(f"seq_len {seq_len} (the shards of data.path) vs the checkpoint's {marker['seq_len']}")
    elif marker["data_fingerprint"] != data_fingerprint:
        problems.append(
            f"data.path holds other shards than the checkpoint was trained on (fingerprint {data_fingerprint[:12]} "
            f"vs {marker['data_fingerprint'][:12]}: other inputs, blend, split or shard seed)"
        )
    # a field added since the checkpoint was written (e.g. `rope`) is absent there: unset (None) here is the same
    theirs = {k: None for k, v in model_shape.items() if v is None} | marker["model_shape"]
    if theirs != model_shape:
        problems.append("model " + ", ".join(differences(model_shape, theirs)))
    if marker["world_size"] != world_size and nvme_optimizer:
        problems.append(
            f"world size {world_size} differs from the checkpoint's {marker['world_size']} and the "
            "optimizer is on NVMe; DeepSpeed's universal checkpoint does not cover NVMe swap files"
        )
    if marker["world_size"] != world_size and not OPTIMIZERS[optimizer].any_world_size and zero_stage > 0:
        problems.append(
            f"world size {world_size} differs from the checkpoint's {marker['world_size']} and optim.name is "
            f"{optimizer}: DeepSpeed's universal checkpoint cannot re-partition its states. Resume "
            f"on {marker['world_size']} ranks, or export the weights (pipeline export) and start a new run_dir "
            "from them with model.init_from (the optimizer states start afresh)"
        )
    return problems


def differences(ours: Any, theirs: Any, path: str = "") -> list[str]:
    """Each field where two nested configs differ, by its dotted path (a model's `hf_config.rope_scaling.rope_type
    yarn vs the checkpoint's llama3`), not the two whole dicts."""
    if isinstance(ours, dict) and isinstance(theirs, dict):
        out = []
        for k in list(ours) + [k for k in theirs if k not in ours]:
            name = f"{path}.{k}" if path else str(k)
            if k not in theirs:
                out.append(f"{name} {ours[k]}, not in the checkpoint's")
            elif k not in ours:
                out.append(f"{name}: the checkpoint's {theirs[k]}, not in this model")
            elif ours[k] != theirs[k]:
                out += differences(ours[k], theirs[k], name)
        return out
    return [f"{path} {ours} vs the checkpoint's {theirs}"] if ours != theirs else []


class Found(NamedTuple):
    """The checkpoint a launch continues: its tag and marker, warnings about newer damaged ones, and the folder it
    is in (the run's own, or under `checkpoint.branch_from` another run's, which is only read)."""

    tag: str
    marker: ckpt.Marker
    warnings: list[str]
    folder: Path


def resumable(run_dir: Path, policy: str, verify: bool, branch_from: str | None = None) -> Found | None:
    """The checkpoint a launch continues (under `checkpoint.resume`, skipping complete ones whose files are
    damaged, with a warning each) and its marker; when run_dir holds none, `branch_from`'s checkpoint; None when
    it starts fresh."""
    tags = ckpt.complete_tags(run_dir)
    if not tags and branch_from and policy not in ("auto", "never"):
        raise PipelineError(
            f"checkpoint.resume {policy} with checkpoint.branch_from {branch_from}: a branch's first launch continues "
            f"branch_from's checkpoint, and {run_dir} holds none of its own yet to resume; name the checkpoint to "
            "branch from in branch_from (RUN_DIR/stepNNNNNNNN) and leave checkpoint.resume auto"
        )
    if not tags and branch_from and policy == "auto":
        source, source_tag = ckpt.resolve_checkpoint(branch_from)
        if problem := ckpt.damage(source, source_tag, verify):
            raise PipelineError(f"checkpoint.branch_from {branch_from}: {problem}")
        return Found(source_tag, ckpt.read_marker(source, source_tag), [], source)
    tag = choose_resume(policy, tags, str(run_dir))
    warnings: list[str] = []
    if tag is not None and policy == "auto":
        tag, warnings = ckpt.newest_intact(run_dir, tags, verify)
        if tag is None:  # never train again from step 0 over checkpoints, whose first save prune would then meet
            raise PipelineError(
                f"{run_dir} holds {len(tags)} complete checkpoint(s) and none is intact, so the run would start "
                f"again from step 0: {'; '.join(w.split(';')[0] for w in warnings)}. Restore the files (a copy, "
                "a mount that is missing), or move the damaged step*/ folders out of run_dir to start fresh on "
                "purpose"
            )
    elif tag is not None:
        if hosts := ckpt.unshared_hosts(run_dir, tag):
            raise ckpt.not_shared(run_dir, tag, hosts)
        if problem := ckpt.damage(run_dir, tag, verify):
            raise PipelineError(f"checkpoint.resume {tag}: {problem}")
    return Found(tag, ckpt.read_marker(run_dir, tag), warnings, Path(run_dir)) if tag else None


def continuation_problems(
    prepared: Prepared,
    world: int,
    marker: ckpt.Marker,
    data_fingerprint: str | None = None,
    saved_layout: str | None = None,
) -> list[str]:
    """Why this config cannot continue `marker`'s checkpoint (`resume_problems`); the data's fingerprint is that
    of the shards the checkpoint's last update trained on under this config's data stages, unless given."""
    return resume_problems(
        marker,
        data_fingerprint=data_fingerprint or fingerprint_at(prepared.cfg.data, marker["step"]),
        model_shape=prepared.shape.as_dict(),
        world_size=world,
        zero_stage=prepared.layout.stage,
        nvme_optimizer=prepared.layout.offload_optimizer == "nvme",
        optimizer=prepared.cfg.optim.name,
        seq_len=prepared.plan.seq_len,
        precision=prepared.cfg.train.precision,
        saved_layout=saved_layout,
    )


CHECKED = "checked"
REFUSED = "refused"
NOTED = "noted"
FREE = "free"

RESUME_RULES: dict[str, tuple[str, str]] = {
    "run_dir": (FREE, "where the run is kept"),
    "model": (CHECKED, "the model's shape against the checkpoint's (resume_problems)"),
    "data.path": (CHECKED, "the shards' fingerprint against the checkpoint's"),
    "data.stages": (CHECKED, "the stage's shards at the checkpoint's step"),
    "data.num_workers": (FREE, "how the same samples are read"),
    "data.verify": (FREE, "a check at start"),
    "batch": (CHECKED, "batch_note"),
    "optim.name": (CHECKED, "the optimizer's states against the checkpoint's"),
    "optim.lr": (CHECKED, "schedule_note"),
    "optim.min_lr": (CHECKED, "schedule_note"),
    "optim.schedule": (CHECKED, "schedule_note"),
    "optim.warmup_steps": (CHECKED, "schedule_note"),
    "optim.warmup_from": (CHECKED, "schedule_note"),
    "optim.decay_steps": (CHECKED, "schedule_note"),
    "optim.decay_ratio": (CHECKED, "schedule_note"),
    "optim.decay_shape": (CHECKED, "schedule_note"),
    "optim.weight_decay": (NOTED, "the optimizer's update from this step on"),
    "optim.beta1": (NOTED, "the optimizer's moments from this step on"),
    "optim.beta2": (NOTED, "the optimizer's moments from this step on"),
    "optim.eps": (NOTED, "the optimizer's update from this step on"),
    "optim.grad_clip": (NOTED, "the clipping of every update from this step on"),
    "optim.muon_lr": (NOTED, "the hidden matrices' learning rate from this step on"),
    "optim.muon_momentum": (NOTED, "Muon's momentum from this step on"),
    "train.max_steps": (CHECKED, "schedule_note"),
    "train.max_tokens": (CHECKED, "schedule_note"),
    "train.seed": (
        REFUSED,
        "the order the shards' samples are drawn in: the samples not yet trained would be drawn in another order, "
        "some trained twice and others never; keep the checkpoint's seed",
    ),
    "train.precision": (CHECKED, "the master weights' and states' precision against the checkpoint's"),
    "train.activation_checkpointing": (FREE, "how a step is computed, not what"),
    "train.deepspeed_config": (CHECKED, "the ZeRO stage and layout against the checkpoint's"),
    "train.gpu_memory_cap_gib": (FREE, "the memory the process may use"),
    "train.compile": (FREE, "how a step is computed, not what (equal to eager: tested)"),
    "train.attention": (FREE, "how a step is computed, not what"),
    "train.document_attention": (FREE, "how a step is computed, not what (the same masks)"),
    "train.kernels": (FREE, "how a step is computed, not what"),
    "train.fp8": (NOTED, "the decoder layers' matmul precision from this step on"),
    "train.loss_chunk_tokens": (FREE, "how the loss is computed, not what"),
    "train.tiled_mlp": (FREE, "how a step is computed, not what (exact)"),
    "train.sequence_parallel": (NOTED, "the ranks a sample is split over; the same samples and batch"),
    "train.peak_tflops": (FREE, "the MFU's denominator"),
    "train.comm_timeout_minutes": (FREE, "how long a hung peer is waited for"),
    "train.on_nonfinite": (FREE, "what a non-finite step does"),
    "train.max_nonfinite_in_a_row": (FREE, "what a non-finite step does"),
    "eval": (FREE, "validation's interval and size"),
    "checkpoint": (FREE, "when and where checkpoints are written and read"),
    "log": (FREE, "logging and tracking"),
}
"""Every config field (by its dotted path; the longest prefix applies) by what changing it between a checkpoint and
the config that continues it does: CHECKED by a check or note of its own, REFUSED with the reason, NOTED (said,
in effect from the checkpoint's step on), FREE (nothing a resume must say). A field that is in no entry fails a
test: a new field is classified where it lands."""


def rule_for(path: str) -> tuple[str, str] | None:
    """The entry of RESUME_RULES for a dotted field path (`optim.beta1`, `model.shape.num_layers`)."""
    parts = path.split(".")
    for n in range(len(parts), 0, -1):
        if (found := RESUME_RULES.get(".".join(parts[:n]))) is not None:
            return found
    return None


def config_changes(now: dict[str, Any], then: dict[str, Any] | None, step: int) -> tuple[list[str], str | None]:
    """Each field the continuing config changes against the checkpoint's (`then`, None for a checkpoint from
    before it was recorded), by its rule: (refusals, one note of the NOTED ones)."""
    if not then:
        return [], None
    refused, noted = [], []
    for change in differences(now, then):
        path = change.split(" ", 1)[0].rstrip(":")
        kind, why = rule_for(path) or (NOTED, "not classified")
        if kind == REFUSED:
            refused.append(f"{change}: {why}")
        elif kind == NOTED:
            noted.append(f"{change} ({why})")
    note = f"note: changed since step {step}: " + "; ".join(noted) if noted else None
    return refused, note


def continue_from(
    prepared: Prepared,
    world: int,
    tag: str,
    marker: ckpt.Marker,
    data_fingerprint: str | None = None,
    folder: Path | None = None,
) -> str | None:
    """The decision to continue checkpoint `tag`, the same before launch and on rank 0 at start: the refusal (one
    PipelineError naming every reason) when this config cannot continue it, else a note when the run's length
    changed (None when nothing changed)."""
    layout = ckpt.saved_zero_layout(folder or prepared.run_dir, tag, marker)
    refused, changed = config_changes(prepared.cfg.to_dict(), marker.get("config"), int(marker["step"]))
    if cannot := continuation_problems(prepared, world, marker, data_fingerprint, layout) + refused:
        early = {int(s): p for s, p in prepared.cfg.data.stages.items() if int(s) < int(marker["step"])}
        if early and any(c.startswith("data.path holds other shards") for c in cannot):
            s = min(early)
            cannot.append(
                f"data.stages starts {early[s]} at step {s}, before the checkpoint's step {marker['step']}: a stage "
                f"begins after the step a run continues from (continue from step {s} or earlier, or move the stage "
                "past the checkpoint)"
            )
        branching = folder is not None and folder.resolve() != prepared.run_dir.resolve()
        raise PipelineError(
            (f"cannot branch from {folder}/{tag} (checkpoint.branch_from): " if branching else "")
            + ("" if branching else f"cannot resume {prepared.run_dir}/{tag}: ")
            + "; ".join(cannot)
            + (
                ". A branch continues its source's checkpoint under this config: make the config agree on those"
                if branching
                else ". Use a new run_dir to start fresh, or checkpoint.branch_from to continue it elsewhere with "
                "this config where it agrees"
            )
            + " (to carry these weights onto new data or another shape: pipeline export, then model.init_from)"
        )
    notes = [n for n in (batch_note(prepared, marker), schedule_note(prepared, marker), changed) if n]
    return "\n".join(notes) or None


def batch_note(prepared: Prepared, marker: ckpt.Marker) -> str | None:
    """What a resume changes in the batch (None: nothing, or a checkpoint from before it was recorded)."""
    before, now = marker.get("global_batch_size"), prepared.plan.global_batch_size
    if before is None or before == now:
        return None
    return (
        f"note: the global batch changed from {before} to {now} sequences since step {marker['step']}: the steps "
        "from here each train on the new number (the data continues where the checkpoint stopped)"
    )


def schedule_note(prepared: Prepared, marker: ckpt.Marker) -> str | None:
    """What a resume changes in the learning rate (None: nothing): the run's length or the schedule's parameters
    changed since the checkpoint. When no update already trained would have had another rate (a warmup-stable-decay
    run extended while stable), a note saying the extension is clean; otherwise which rates move, with the numbers."""
    cfg, step = prepared.cfg, marker["step"]
    now, now_steps = Schedule.of(cfg), max_steps_for(cfg, prepared.plan)
    before_steps = marker.get("max_steps", now_steps)
    before = Schedule(**marker["schedule"]) if "schedule" in marker else now  # older checkpoints: as configured
    if before == now and before_steps == now_steps:
        return None
    what = f"the run's length changed from {before_steps} to {now_steps} steps" if before_steps != now_steps else ""
    if before != now:
        fields = [f"{k} {v} -> {now.as_dict()[k]}" for k, v in before.as_dict().items() if now.as_dict()[k] != v]
        what += ("; " if what else "") + "the schedule changed (" + ", ".join(fields) + ")"
    changed = first_changed_step(before, before_steps, now, now_steps, step - 1)
    if changed is None:
        return (
            f"note: {what} since step {step}; no update already trained would have had another rate, so the "
            f"checkpoint continues cleanly: {now.describe(now_steps)}"
        )
    return (
        f"note: {what} since {step}: the learning-rate schedule is re-stretched to {now_steps} steps from update "
        f"{changed + 1} on, including updates already trained (lr at step {step}: "
        f"{learning_rate(step, before, before_steps):.3g} before, {learning_rate(step, now, now_steps):.3g} now). "
        f"Intended for extending a run; to keep the old schedule set train.max_steps: {before_steps}, or use "
        "optim.schedule wsd, whose runs extend without changing a trained step"
    )
