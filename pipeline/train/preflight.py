"""What `pipeline pretrain` decides before the launcher starts, so that every mistake is in one error naming the
field and both values, exit code 2, and nothing left behind, instead of a message per rank 10-75 s in: the run
folder free (pipeline.train.setup.runlock), the shards whole (sizes, and checksums with data.verify), the checkpoint it
would continue (the rules: pipeline.train.checkpoint.resume), `model.init_from` with weights, room on the disk for the
checkpoints, and the caller's own (the quick doctor's). The ranks make the same checks through the same functions
(a run launched with `deepspeed` directly), rank 0 deciding for all."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pipeline.atomic import write_json
from pipeline.errors import PipelineError
from pipeline.train.checkpoint import files as ckpt
from pipeline.train.checkpoint.resume import continue_from, resumable
from pipeline.train.parts import tracking
from pipeline.train.runtime.dist import accelerator_name
from pipeline.train.setup.prepare import Prepared
from pipeline.train.setup.runlock import check_free
from pipeline.train.setup.schedule import max_steps_for
from pipeline.train.setup.stages import stages

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


def init_weights_problem(init_from: str | None) -> str | None:
    """`model.init_from` that the trainer could not load: a folder without .safetensors files, one whose index names
    files it lacks (an interrupted download), or one whose headers do not read."""
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

    from pipeline.model.families import model_folder_problems

    if found := model_folder_problems(src, "model.init_from", weights=True, tokenizer=False):
        return found[0]
    for f in files:
        try:
            with safe_open(str(f), "pt") as sf:
                sf.keys()
        except Exception as e:  # noqa: BLE001 - any unreadable header is the same user problem
            return f"model.init_from {f}: not a readable safetensors file ({type(e).__name__}: {e})"
    return None


EPOCHS_NOTED = 20
"""More passes over the train split than this: almost surely a budget meant for more data (a note)."""


def implausible(prepared: Prepared, per_node: int, accelerator: str) -> list[str]:
    """Values that are legal but almost surely a mistake, as notes the user sees before the launch: a model field
    the data replaces, a budget of many epochs, a learning rate whose exponent was dropped, a schedule that never
    leaves warm-up, more CPU ranks than cores."""
    cfg, plan, notes = prepared.cfg, prepared.plan, []
    given = cfg.model.shape.get("max_seq_len")
    if given is not None and int(given) < plan.seq_len:
        notes.append(
            f"note: model.shape.max_seq_len {given} is below the shards' seq_len {plan.seq_len}: the model is built "
            f"for {plan.seq_len} (RoPE extends); set {plan.seq_len}, or leave it out"
        )
    steps = max_steps_for(cfg, plan)
    train = prepared.manifest["splits"]["train"]["samples"]
    if train and (epochs := steps * plan.global_batch_size / train) > EPOCHS_NOTED:
        notes.append(
            f"note: {steps:,} steps x {plan.global_batch_size} sequences are {epochs:,.0f} passes over the "
            f"{train:,} training samples of {cfg.data.path}: the model will memorise them long before the end. "
            "Did you mean a smaller train.max_tokens / max_steps, or more data?"
        )
    if cfg.optim.lr > 0.05 or cfg.optim.lr < 1e-7:
        notes.append(
            f"note: optim.lr {cfg.optim.lr:g} is far from pretraining's 1e-5 to 1e-2; write the exponent (3e-4, not 3)"
        )
    if cfg.optim.warmup_steps >= steps:
        notes.append(
            f"note: optim.warmup_steps {cfg.optim.warmup_steps} >= the run's {steps} steps: the learning rate "
            f"never reaches optim.lr {cfg.optim.lr:g}"
        )
    cores = os.cpu_count() or 1
    if accelerator == "cpu" and per_node > cores:
        notes.append(
            f"note: {per_node} CPU ranks share this machine's {cores} cores: each step waits for the slowest; "
            f"--num-gpus {cores} or fewer runs faster"
        )
    return notes


def before_launch(prepared: Prepared, world: int, per_node: int, more: Sequence[str] = ()) -> list[str]:
    """Every check above, and the disk for the run's checkpoints, in the launching process: raises one
    PipelineError listing every problem (with `more`, the caller's: the quick doctor's failures); returns the notes
    to print (a changed schedule, a skipped damaged checkpoint)."""
    from pipeline.data.loader import ShardedDataset

    cfg, run_dir = prepared.cfg, Path(prepared.cfg.run_dir)
    check_free(run_dir)
    problems: list[str] = tracking.problems(cfg)
    if unwritable := ckpt.writable_problem(run_dir):
        problems.append(unwritable)
    elif cfg.checkpoint.enabled:  # on the first node's disk: the busiest
        size = ckpt.checkpoint_size(prepared, world, per_node)
        if problem := ckpt.space_problem(run_dir, size, cfg.checkpoint.keep_last):
            problems.append(problem)
    notes: list[str] = []
    try:
        splits = ["train"] + (["val"] if prepared.manifest["splits"]["val"]["samples"] else [])
        datasets = [ShardedDataset(cfg.data.path, split) for split in splits]  # sizes against the manifest
        datasets += [ShardedDataset(stage.path, "train") for stage in stages(cfg.data)[1:]]
        if cfg.data.verify:
            verify_shards(datasets, run_dir if run_dir.is_dir() else None, record=False)
    except PipelineError as e:
        datasets = []
        problems.append(str(e))
    found = resumable(run_dir, cfg.checkpoint.resume, cfg.checkpoint.verify, cfg.checkpoint.branch_from)
    if found is not None:
        tag, marker, warnings, folder = found
        notes += warnings
        if folder != run_dir:
            notes.append(f"branching from {folder}/{tag} (step {marker['step']}): it is read, never written")
        try:
            if note := continue_from(prepared, world, tag, marker, folder=folder):
                notes.append(note)
        except PipelineError as e:  # one of the launch's problems, said together
            problems.append(str(e))
    elif problem := init_weights_problem(cfg.model.init_from):
        problems.append(problem)
    problems += more
    if problems:
        raise PipelineError(problems[0] if len(problems) == 1 else "; ".join(problems))
    notes += implausible(prepared, per_node, accelerator_name())
    if cfg.data.verify and datasets:
        remember_verified(datasets, run_dir)  # rank 0 need not read them again (an existing run folder)
    return notes
