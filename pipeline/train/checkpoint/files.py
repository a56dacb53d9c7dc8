"""Checkpoint layout in a run folder: DeepSpeed tags `step{N:08d}`, a completion marker per tag, our own
`latest` file (same format as DeepSpeed's, written only after the marker), keep-last-K pruning, damage checks, the
universal form for another world size, and what a checkpoint costs on disk. Pure file work; the `Checkpointer`
(pipeline.train.checkpoint.checkpointer) decides when to save and what to resume from.

One job: what a checkpoint is on disk; every reader of a run folder (resume, evaluate, export, average, the
planner's disk check) reads it through here, so the layout is written down once."""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import re
import shutil
import socket
import time
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, NotRequired, TypedDict

import yaml

from pipeline.atomic import replacing_dir, seal_broken, sealed, sha256_file, text_seal_broken, write_json, write_text
from pipeline.errors import PipelineError
from pipeline.plan.memory import checkpoint_bytes
from pipeline.train import faults
from pipeline.train.setup.optimizers import OPTIMIZERS

if TYPE_CHECKING:
    from pipeline.train.setup.prepare import Prepared

log = logging.getLogger("pipeline.pretrain")
MARKER = "pipeline_complete.json"


class Marker(TypedDict):
    """What a completion marker records (and `client_state` carries, with the config beside it)."""

    step: int
    consumed_samples: int
    data_fingerprint: str
    seq_len: int
    tokenizer_sha256: str
    model_shape: dict[str, Any]
    world_size: int
    max_steps: NotRequired[int]
    """The run's length when it saved (the learning-rate schedule's); absent in checkpoints from before."""
    schedule: NotRequired[dict[str, Any]]
    """The learning-rate schedule's parameters (pipeline.train.setup.schedule.Schedule); absent before 2026-12-06."""
    zero_stage: NotRequired[int]
    """The DeepSpeed JSON's ZeRO stage (it decides the file layout); absent before 2026-12-06 (read from the files)."""
    precision: NotRequired[str]
    """train.precision (bf16 keeps its optimizer states in other files); absent before 2026-12-06."""
    optimizer: NotRequired[str]
    """optim.name; absent before 2026-12-06."""
    global_batch_size: NotRequired[int]
    """Sequences per optimizer step when it saved; absent before 2026-12-06."""
    config: NotRequired[dict[str, Any]]
    """The run's whole resolved config when it saved (each field classified against the config that continues it:
    pipeline.train.checkpoint.resume.RESUME_RULES); absent before 2026-12-07."""
    files: NotRequired[dict[str, dict[str, Any]]]
    """Every file of the checkpoint, relative to its folder: {"size": bytes, "sha256": hex (checkpoint.verify),
    "host": the host of the rank that wrote it}."""


_TAG = re.compile(r"^step(\d{8})$")


def tag_for(step: int) -> str:
    return f"step{step:08d}"


def complete_tags(run_dir: str | Path) -> list[str]:
    """Tags with a completion marker, oldest first."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return []
    tags = [p.name for p in run_dir.iterdir() if _TAG.match(p.name) and (p / MARKER).exists()]
    return sorted(tags)


def latest_complete(run_dir: str | Path) -> str | None:
    tags = complete_tags(run_dir)
    return tags[-1] if tags else None


def mark_complete(run_dir: Path, tag: str, info: Marker) -> None:
    """Rank 0, after every rank has written its shards (the caller holds a barrier)."""
    write_json(run_dir / tag / MARKER, sealed(dict(info)))
    write_text(run_dir / "latest", tag)


def read_marker(run_dir: str | Path, tag: str) -> Marker:
    """A complete checkpoint's marker, refused when it is not what the save wrote (pipeline.atomic.SEAL)."""
    path = Path(run_dir) / tag / MARKER
    marker = json.loads(path.read_text())
    if seal_broken(marker):
        raise PipelineError(
            f"{path}: changed after the save wrote it (a field edited, or a copy mixed with another run's); it no "
            f"longer says what {tag} holds: restore it, or move {tag}/ out of the run folder to resume from an "
            "earlier checkpoint"
        )
    return marker  # type: ignore[no-any-return]


def zero_layout(stage: int) -> str:
    """The file layout DeepSpeed saves a ZeRO stage in: stages 1 and 2 share one (and load each other's)."""
    return {0: "zero-0", 1: "zero-1/2", 2: "zero-1/2", 3: "zero-3"}[stage]


def saved_zero_layout(run_dir: Path, tag: str, marker: Marker) -> str:
    """The layout a checkpoint was saved in: its marker's `zero_stage`; for checkpoints from before it was recorded,
    read from its file names (ZeRO-3 saves the model states per rank; 1 and 2 save optimizer shards; 0 neither)."""
    if "zero_stage" in marker:
        return zero_layout(int(marker["zero_stage"]))
    names = [p.name for p in (Path(run_dir) / tag).glob("*.pt")]
    if any(n.startswith("zero_pp_rank_") and n.endswith("_model_states.pt") for n in names):
        return "zero-3"
    return "zero-1/2" if any(n.endswith("_optim_states.pt") for n in names) else "zero-0"


def run_config_text(run_dir: str | Path) -> str:
    """RUN_DIR/config.yaml, the config the run trained with, refused when it is not what the run wrote (its seal)."""
    path = Path(run_dir) / "config.yaml"
    text = path.read_text()
    if text_seal_broken(text):
        raise PipelineError(
            f"{path}: changed after the run wrote it; it no longer says what the run trained with (its data, model "
            "and paths): restore it, or launch with your own config and leave this copy as written"
        )
    return text


def marker_step(run_dir: Path, tag: str) -> int:
    """The step a complete checkpoint's marker records (its tag's number for markers without one)."""
    try:
        return int(read_marker(run_dir, tag)["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return int(tag[len("step") :])


def prune(run_dir: Path, keep_last: int, keep: str | None = None) -> list[str]:
    """Delete complete checkpoints beyond the newest `keep_last` by the step their markers record, and incomplete
    ones older than the newest complete one. Never deleted: the newest complete checkpoint and `keep` (the tag
    just written, which `latest` names, even when older steps' checkpoints of an earlier attempt are newer)."""
    tags = sorted(complete_tags(run_dir), key=lambda t: (marker_step(run_dir, t), t))
    latest = tags[-1] if tags else None
    doomed = tags[: max(0, len(tags) - max(1, keep_last))]
    if latest:
        doomed += [
            p.name for p in run_dir.iterdir() if _TAG.match(p.name) and not (p / MARKER).exists() and p.name < latest
        ]
    doomed = [t for t in doomed if t not in (latest, keep)]
    for t in doomed:
        shutil.rmtree(run_dir / t, ignore_errors=True)
    kept = set(complete_tags(run_dir))
    for u in run_dir.glob(f"step*{UNIVERSAL}"):  # universal copies of checkpoints that are gone
        if u.name[: -len(UNIVERSAL)] not in kept:
            shutil.rmtree(u, ignore_errors=True)
    return doomed


UNIVERSAL = ".universal"
CONVERSION_WORKERS = 2
"""Processes DeepSpeed's ds_to_universal extracts the optimizer shards with; each loads one whole shard."""


def conversion_plan(run_dir: Path, tag: str, free_disk: float, available_ram: float) -> tuple[int, str | None]:
    """Whether this node can convert `tag` to the universal form, before an hour of conversion finds out: (the
    extraction processes to use, the problem or None). DeepSpeed writes every parameter's fragments into a
    temporary folder, then the merged states beside them (about twice the optimizer states on the run folder's
    disk), and each extraction process loads one whole optimizer shard into host memory (104 GB for a 70B ZeRO-3
    shard of 8 ranks: more than a 120 GB node has free). Fewer processes when only that fits."""
    folder = Path(run_dir) / tag
    sizes = {p.name: p.stat().st_size for p in folder.iterdir() if p.is_file()} if folder.is_dir() else {}
    optim = [n for name, n in sizes.items() if "optim_states" in name]
    need_disk = 2 * sum(optim) + sum(n for name, n in sizes.items() if "optim_states" not in name)
    largest = max(optim, default=0)
    problems = []
    if need_disk > free_disk:
        problems.append(
            f"the run folder's disk needs about {need_disk / 1e9:,.1f} GB for it (twice the optimizer states: "
            f"fragments, then merged) and has {free_disk / 1e9:,.1f} GB free; free space there, or resume on the "
            "world size that saved it"
        )
    workers = max(1, min(CONVERSION_WORKERS, int(available_ram // largest) if largest else CONVERSION_WORKERS))
    if largest > available_ram:
        problems.append(
            f"DeepSpeed loads each optimizer shard whole ({largest / 1e9:,.1f} GB) into this node's host memory, "
            f"which has {available_ram / 1e9:,.1f} GB available; convert on a node with more memory "
            f"(python -m deepspeed.checkpoint.ds_to_universal --input_folder {folder} --output_folder "
            f"{folder}{UNIVERSAL} --num_extract_workers 1), or resume on the world size that saved it"
        )
    if not problems:
        return workers, None
    return workers, f"cannot convert {folder} for another world size here: " + "; ".join(problems)


def universal(run_dir: Path, tag: str, workers: int = CONVERSION_WORKERS, into: Path | None = None) -> tuple[str, bool]:
    """`TAG.universal`, DeepSpeed's universal form of checkpoint `tag` (optimizer states per parameter, loadable
    by any world size), converted with its own ds_to_universal once, into a temporary folder renamed when done;
    beside the checkpoint, or in `into` (a branch's own run folder). Returns (tag to load, whether it was
    converted now)."""

    into = Path(into or run_dir)
    out = into / f"{tag}{UNIVERSAL}"
    if (out / MARKER).exists():
        return out.name, False
    from deepspeed.checkpoint.ds_to_universal import main as ds_to_universal

    if slow := faults.seconds("SLOW_CONVERSION"):
        time.sleep(slow)
    with replacing_dir(out) as tmp:
        args = SimpleNamespace(
            input_folder=str(Path(run_dir) / tag),
            output_folder=str(tmp),
            num_extract_workers=workers,
            num_merge_workers=1,
            keep_temp_folder=False,
            strict=True,
            inject_missing_state=True,
        )
        with contextlib.redirect_stdout(io.StringIO()):
            ds_to_universal(args)
        (into / "latest_universal").unlink(missing_ok=True)  # it names the temporary folder; not ours
        write_json(tmp / MARKER, read_marker(run_dir, tag))
    return out.name, True


def damage(run_dir: Path, tag: str, verify: bool) -> str | None:
    """What is wrong with a complete checkpoint's files against its marker (None: intact). Sizes always; sha256
    when `verify` and the marker has them. Markers from before files were listed are taken as they are."""
    files = read_marker(run_dir, tag).get("files") or {}
    for name, want in sorted(files.items()):
        path = Path(run_dir) / tag / name
        if not path.is_file():
            return f"{path}: missing"
        size = path.stat().st_size
        if size != want["size"]:
            return f"{path}: {size:,} bytes, the marker says {want['size']:,} (truncated or damaged)"
        if verify and "sha256" in want and sha256_file(path) != want["sha256"]:
            return f"{path}: sha256 differs from the marker's (damaged)"
    return None


def unshared_hosts(run_dir: Path, tag: str) -> list[str]:
    """The hosts whose files of checkpoint `tag` this host cannot see: written there, absent here. Each rank
    writes its own shards into run_dir, so a run folder on each node's own disk holds only that node's share; its
    other files are not damaged, they are elsewhere."""
    here = socket.gethostname()
    files = read_marker(run_dir, tag).get("files") or {}
    return sorted(
        {
            str(entry["host"])
            for name, entry in files.items()
            if entry.get("host") not in (None, here) and not (Path(run_dir) / tag / name).is_file()
        }
    )


def not_shared(run_dir: Path, tag: str, hosts: list[str]) -> PipelineError:
    shown = ", ".join(hosts[:4]) + (f" and {len(hosts) - 4} more" if len(hosts) > 4 else "")
    return PipelineError(
        f"run_dir {run_dir} is not one folder shared by every node: checkpoint {tag} has files written on {shown} "
        f"that {socket.gethostname()} cannot see. Every rank writes its own shards there, and resuming, evaluating "
        "or exporting needs them all in one place: put run_dir (and data.path) on storage every node mounts at the "
        "same path (NFS, a cluster file system), copy each node's step*/ folders into it, then run the same command "
        "(`pipeline doctor --hostfile H` checks it)"
    )


def newest_intact(run_dir: Path, tags: list[str], verify: bool) -> tuple[str | None, list[str]]:
    """The newest complete checkpoint whose files are intact, and a warning for each newer one skipped. Nothing is
    deleted. A checkpoint whose missing files were written on other hosts is refused (`not_shared`): the run
    folder is per node, and every older checkpoint is split the same way."""
    warnings: list[str] = []
    for tag in reversed(tags):
        if hosts := unshared_hosts(run_dir, tag):
            raise not_shared(run_dir, tag, hosts)
        problem = damage(run_dir, tag, verify)
        if problem is None:
            return tag, warnings
        warnings.append(f"checkpoint {tag} skipped: {problem}; resuming from an earlier one (nothing deleted)")
    return None, warnings


def resolve_checkpoint(path: str | Path) -> tuple[Path, str]:
    """RUN_DIR or RUN_DIR/TAG -> (run_dir, tag), refusing paths that are not complete checkpoints."""
    path = Path(path)
    if _TAG.match(path.name) and path.is_dir():
        if not (path / MARKER).exists():
            raise PipelineError(
                f"{path}: checkpoint is incomplete (still being written, or its save crashed); "
                f"use an earlier tag or the run folder {path.parent}"
            )
        if hosts := unshared_hosts(path.parent, path.name):
            raise not_shared(path.parent, path.name, hosts)
        return path.parent, path.name
    if not path.is_dir():
        there = complete_tags(path.parent) if _TAG.match(path.name) else []
        if there:
            raise PipelineError(
                f"{path}: no such checkpoint (kept ones are pruned by checkpoint.keep_last); {path.parent} holds "
                f"{', '.join(there)}: give one of them, or the run folder for the latest"
            )
        raise PipelineError(f"{path}: no such run folder or checkpoint")
    tag = latest_complete(path)
    if tag is None:
        raise PipelineError(
            f"{path}: holds no complete checkpoint (expected folders step00000100/ with {MARKER}); "
            "is it a run folder of `pipeline pretrain`?"
        )
    if hosts := unshared_hosts(path, tag):
        raise not_shared(path, tag, hosts)
    return path, tag


def average_tags(run_dir: Path, spec: str) -> list[str]:
    """The checkpoints of `run_dir` that `--average SPEC` names, oldest first: `last:N` (the N newest complete
    ones) or a comma list of tags or steps (step00000100,step00000200 or 100,200); refused naming what the run
    folder holds when they are not there."""
    tags = complete_tags(run_dir)
    held = f"{run_dir} holds {', '.join(tags) or 'no complete checkpoint'}"
    if spec.startswith("last:"):
        try:
            n = int(spec[5:])
        except ValueError:
            n = 0
        if n < 2:
            raise PipelineError(f"--average {spec}: expected last:N with N of 2 or more, e.g. last:3")
        if n > len(tags):
            raise PipelineError(f"--average {spec}: {held} ({_why_few(run_dir, len(tags))})")
        return sorted(tags[-n:], key=lambda t: marker_step(run_dir, t))
    chosen = []
    for part in (p.strip() for p in spec.split(",") if p.strip()):
        if "/" in part:
            raise PipelineError(
                f"--average {spec}: {part} is a path; --average names {run_dir}'s own checkpoints (tags or steps). To "
                f"average in another run's checkpoint (a branch point), copy its folder into {run_dir} first"
            )
        tag = tag_for(int(part)) if part.isdigit() else part
        if tag not in tags:
            raise PipelineError(f"--average {spec}: no complete checkpoint {tag}; {held}")
        chosen.append(tag)
    if len(set(chosen)) < 2:
        raise PipelineError(f"--average {spec}: name two or more different checkpoints, or last:N")
    return sorted(set(chosen), key=lambda t: marker_step(run_dir, t))


def _why_few(run_dir: Path, held: int) -> str:
    """Why a run holds fewer checkpoints than asked: a branch's branch point stays in its source, keep_last pruned
    older ones, or the run has saved only these."""
    try:
        config = yaml.safe_load(run_config_text(run_dir)) or {}
    except (OSError, PipelineError, yaml.YAMLError):
        config = {}
    section = config.get("checkpoint") or {}
    if section.get("branch_from"):
        return (
            f"a branch holds only the checkpoints it saved itself; its branch point stays in "
            f"{section['branch_from']}: average fewer, wait for more saves, or copy the branch point's folder in"
        )
    keep = section.get("keep_last")
    if isinstance(keep, int) and keep <= held:
        return f"checkpoint.keep_last {keep} prunes older ones"
    return f"the run has saved {held} so far"


def writable_problem(run_dir: Path) -> str | None:
    """Whether this process can write the run folder (or create it in its nearest existing parent): a read-only
    mount or a folder of another user would otherwise show as a disk with no space, or fail at the first write."""
    folder = Path(run_dir).absolute()
    while not folder.exists():
        folder = folder.parent
    if os.statvfs(folder).f_flag & os.ST_RDONLY:
        return f"run_dir {run_dir}: {folder} is on a read-only file system; put run_dir on a writable disk"
    if not os.access(folder, os.W_OK | os.X_OK):
        return (
            f"run_dir {run_dir}: no permission to write in {folder} (owned by uid {folder.stat().st_uid}, you are "
            f"{os.getuid()}); put run_dir where you can write, or fix the folder's owner or mode"
        )
    return None


def space_problem(run_dir: Path, per_node_bytes: float, keep_last: int) -> str | None:
    """Whether this node's disk at `run_dir` holds `keep_last` checkpoints plus the one being written (a save never
    deletes the previous checkpoint first). Checkpoints already in the run folder count toward that budget."""
    folder = Path(run_dir).absolute()
    while not folder.exists():
        folder = folder.parent
    existing = (
        sum(f.stat().st_size for d in Path(run_dir).glob("step*") if d.is_dir() for f in d.rglob("*") if f.is_file())
        if Path(run_dir).is_dir()
        else 0
    )
    need = (keep_last + 1) * per_node_bytes - existing
    free = shutil.disk_usage(folder).free
    if need <= free:
        return None
    return (
        f"run_dir {run_dir}: a checkpoint is {per_node_bytes / 1e9:,.1f} GB on this node; keeping {keep_last} "
        f"while the next is written needs {need / 1e9:,.1f} GB more, and {folder} has {free / 1e9:,.1f} GB free. "
        "Put run_dir on a larger disk or a shared mount, set checkpoint.keep_last lower, use more nodes (ZeRO "
        "spreads the optimizer shards), or a smaller model; checkpoint.enabled: false runs without saving"
    )


def checkpoint_size(prepared: Prepared, world_size: int, ranks_per_node: int) -> float:
    """Bytes one checkpoint puts on the busiest node (the first), by the planner's count."""

    module_bytes = 4 if prepared.cfg.train.precision == "fp32" else 2
    state_bytes = 4 + OPTIMIZERS[prepared.cfg.optim.name].moment_bytes
    sizes = checkpoint_bytes(
        prepared.shape, prepared.layout.stage, world_size, ranks_per_node, module_bytes, state_bytes
    )
    return sizes["per_node"]
