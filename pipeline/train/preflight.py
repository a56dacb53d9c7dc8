"""What `pipeline pretrain` decides before the launcher starts, so that a mistake is one line naming the field and
both values, exit code 2, and nothing left behind, instead of a message per rank 10-75 s in: the run folder free
(pipeline.train.runlock), the shards whole (sizes, and checksums with data.verify), the checkpoint it would
continue of this model, data and world, `model.init_from` with weights. The ranks make the same checks through
the same functions (a run launched with `deepspeed` directly), rank 0 deciding for all."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pipeline.atomic import write_json
from pipeline.errors import PipelineError
from pipeline.train import checkpoint as ckpt
from pipeline.train.ds_config import zero_stage
from pipeline.train.prepare import Prepared
from pipeline.train.resume import choose_resume, resume_problems
from pipeline.train.runlock import check_free
from pipeline.train.schedule import lr_at, max_steps_for
from pipeline.train.tracking import missing_packages

VERIFIED = ".shards-verified.json"
"""In the run folder: the shards whose checksums a launch verified, with the size and mtime of every file, so the
next check of the same files (rank 0 after `pipeline pretrain`, the next launch) reads them again only if they
changed."""


def verify_shards(datasets: list[Any], run_dir: Path | None, *, record: bool = True) -> None:
    """`verify()` of each dataset (every shard's sha256 against the manifest) unless `run_dir` records that these
    very files, unchanged since, were verified; with `record`, records it after a verification."""
    if run_dir is not None and _recorded(run_dir) == _stamps(datasets):
        return
    for d in datasets:
        d.verify()
    if record and run_dir is not None:
        remember_verified(datasets, run_dir)


def remember_verified(datasets: list[Any], run_dir: Path) -> None:
    if run_dir.is_dir():
        write_json(run_dir / VERIFIED, _stamps(datasets))


def _recorded(run_dir: Path) -> Any:
    try:
        return json.loads((run_dir / VERIFIED).read_text())
    except (OSError, ValueError):
        return None


def _stamps(datasets: list[Any]) -> list[dict[str, Any]]:
    return [_stamp(d) for d in datasets]


def _stamp(dataset: Any) -> dict[str, Any]:
    files = []
    for f in sorted(p for p in Path(dataset.path).iterdir() if p.is_file() and not p.name.startswith(".")):
        st = f.stat()
        files.append([f.name, st.st_size, st.st_mtime_ns])
    return {"path": str(Path(dataset.path).resolve()), "split": dataset.split, "files": files}


def resumable(run_dir: Path, policy: str, verify: bool) -> tuple[str, ckpt.Marker, list[str]] | None:
    """The checkpoint a launch continues (under `checkpoint.resume`, skipping complete ones whose files are
    damaged, with a warning each) and its marker; None when it starts fresh."""
    tags = ckpt.complete_tags(run_dir)
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
    return (tag, ckpt.read_marker(run_dir, tag), warnings) if tag else None


def continuation_problems(
    prepared: Prepared, world: int, marker: ckpt.Marker, data_fingerprint: str | None = None
) -> list[str]:
    """Why this config cannot continue `marker`'s checkpoint (pipeline.train.resume.resume_problems); the data's
    fingerprint is its shards' manifest's unless given (the trainer's, as its checkpoints record it)."""
    from pipeline.plan.cluster import offload_devices

    return resume_problems(
        marker,
        data_fingerprint=data_fingerprint or prepared.manifest["fingerprint"],
        model_shape=prepared.shape.as_dict(),
        world_size=world,
        zero_stage=zero_stage(prepared.ds),
        nvme_optimizer=offload_devices(prepared.ds).optimizer == "nvme",
        optimizer=prepared.cfg.optim.name,
        seq_len=prepared.plan.seq_len,
    )


def schedule_note(prepared: Prepared, marker: ckpt.Marker) -> str | None:
    """A resumed run whose length changed has its learning-rate schedule re-stretched: say so, with the numbers."""
    before = marker.get("max_steps")
    now = max_steps_for(prepared.cfg, prepared.plan)
    if before is None or before == now:
        return None
    step, cfg = marker["step"], prepared.cfg
    return (
        f"note: the run's length changed from {before} to {now} steps since {marker['step']}: the learning-rate "
        f"schedule is re-stretched to {now} (lr at step {step}: {lr_at(step, cfg, before):.3g} before, "
        f"{lr_at(step, cfg, now):.3g} now). Intended for extending a run; to keep the old schedule set "
        f"train.max_steps: {before}, or optim.decay_steps"
    )


def init_weights_problem(init_from: str | None) -> str | None:
    """`model.init_from` that the trainer could not load: a folder without .safetensors files, or one whose
    headers do not read."""
    if not init_from:
        return None
    src = Path(init_from)
    files = [src] if src.is_file() else sorted(src.glob("*.safetensors"))
    if not files:
        names = sorted(p.name for p in src.iterdir())[:8] if src.is_dir() else []
        listed = f"it holds {', '.join(names)}" if names else ("it is empty" if src.is_dir() else "no such folder")
        return (
            f"model.init_from {init_from}: no .safetensors file there ({listed}); download the weights "
            "too (huggingface-cli download MODEL --local-dir DIR), or convert .bin files to safetensors"
        )
    from safetensors import safe_open

    for f in files:
        try:
            with safe_open(str(f), "pt") as sf:
                sf.keys()
        except Exception as e:  # noqa: BLE001 - any unreadable header is the same user problem
            return f"model.init_from {f}: not a readable safetensors file ({type(e).__name__}: {e})"
    return None


def before_launch(prepared: Prepared, world: int) -> list[str]:
    """Every check above, in the launching process: raises one PipelineError listing every problem; returns the
    notes to print (a changed schedule, a skipped damaged checkpoint)."""
    from pipeline.data.loader import ShardedDataset

    cfg, run_dir = prepared.cfg, Path(prepared.cfg.run_dir)
    check_free(run_dir)
    problems: list[str] = missing_packages(cfg)
    notes: list[str] = []
    try:
        splits = ["train"] + (["val"] if prepared.manifest["splits"]["val"]["samples"] else [])
        datasets = [ShardedDataset(cfg.data.path, split) for split in splits]  # sizes against the manifest
        if cfg.data.verify:
            verify_shards(datasets, run_dir if run_dir.is_dir() else None, record=False)
    except PipelineError as e:
        datasets = []
        problems.append(str(e))
    found = resumable(run_dir, cfg.checkpoint.resume, cfg.checkpoint.verify)
    if found is not None:
        tag, marker, warnings = found
        notes += warnings
        if cannot := continuation_problems(prepared, world, marker):
            problems.append(
                f"cannot resume {run_dir}/{tag}: " + "; ".join(cannot) + ". Use a new run_dir to start fresh (to "
                "carry these weights onto new data or another shape: pipeline export, then model.init_from)"
            )
        elif note := schedule_note(prepared, marker):
            notes.append(note)
    elif problem := init_weights_problem(cfg.model.init_from):
        problems.append(problem)
    if problems:
        raise PipelineError(problems[0] if len(problems) == 1 else "; ".join(problems))
    if cfg.data.verify and datasets:
        remember_verified(datasets, run_dir)  # rank 0 need not read them again (an existing run folder)
    return notes
