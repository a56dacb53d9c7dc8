"""Checkpoint layout in a run folder: DeepSpeed tags `step{N:08d}`, a completion marker per tag, our own
`latest` file (same format as DeepSpeed's, written only after the marker), and keep-last-K pruning."""

from __future__ import annotations

import json
import logging
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NotRequired, TypedDict

from pipeline.atomic import write_json, write_text
from pipeline.errors import PipelineError

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
    files: NotRequired[dict[str, dict[str, Any]]]
    """Every file of the checkpoint, relative to its folder: {"size": bytes, "sha256": hex (checkpoint.verify)}."""


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
    write_json(run_dir / tag / MARKER, info)
    write_text(run_dir / "latest", tag)


def read_marker(run_dir: str | Path, tag: str) -> Marker:
    return json.loads((Path(run_dir) / tag / MARKER).read_text())


def prune(run_dir: Path, keep_last: int) -> list[str]:
    """Delete complete checkpoints beyond the newest `keep_last` and incomplete ones older than the newest
    complete one. The latest complete checkpoint is never deleted."""
    tags = complete_tags(run_dir)
    latest = tags[-1] if tags else None
    doomed = tags[: max(0, len(tags) - max(1, keep_last))]
    if latest:
        doomed += [
            p.name for p in run_dir.iterdir() if _TAG.match(p.name) and not (p / MARKER).exists() and p.name < latest
        ]
    for t in doomed:
        if t != latest:
            shutil.rmtree(run_dir / t, ignore_errors=True)
    kept = set(complete_tags(run_dir))
    for u in run_dir.glob(f"step*{UNIVERSAL}"):  # universal copies of checkpoints that are gone
        if u.name[: -len(UNIVERSAL)] not in kept:
            shutil.rmtree(u, ignore_errors=True)
    return doomed


class _GuardedWrites:
    """Stands in for DeepSpeed's checkpoint engine during one save: every file a rank writes is recorded (size,
    and sha256 when verifying), and a failed write (a full disk) is recorded instead of raised, so that this rank
    still reaches DeepSpeed's barriers and no rank hangs; the failure is raised on every rank after the save."""

    def __init__(self, inner: Any, root: Path, *, verify: bool, step: int, last_rank: bool):
        self.inner, self.root, self.verify, self.step, self.last_rank = inner, root, verify, step, last_rank
        self.files: dict[str, dict[str, Any]] = {}
        self.error: str | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def save(self, state_dict: Any, path: str) -> Any:
        import errno

        from pipeline.train import faults

        if self.error:
            return None
        try:
            if self.last_rank and faults.armed("ENOSPC_IN_SAVE", self.step):
                faults.fired()
                raise OSError(errno.ENOSPC, "No space left on device (injected by PIPELINE_FAULT_ENOSPC_IN_SAVE)")
            out = self.inner.save(state_dict, path)
        except OSError as e:
            self.error = f"{path}: {e.strerror or e}"
            Path(path).unlink(missing_ok=True)  # no half-written file that looks whole
            return None
        entry: dict[str, Any] = {"size": Path(path).stat().st_size}
        if self.verify:
            entry["sha256"] = file_sha256(Path(path))
        self.files[str(Path(path).relative_to(self.root))] = entry
        if self.last_rank and faults.armed("KILL_IN_SAVE", self.step):
            faults.kill_self()
        return out


def file_sha256(path: Path) -> str:
    import hashlib

    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


class Checkpointer:
    """Saves a DeepSpeed engine as `step{N:08d}` in the run folder: every rank writes its shards, then rank 0
    writes the marker (listing every file with its size, and sha256 under `verify`) and `latest`, and prunes to
    `keep_last`, with a barrier on either side so no rank runs ahead of a checkpoint that is not complete. A write
    that fails (a full disk) stops every rank with one message; the previous checkpoint stays the latest."""

    def __init__(
        self,
        engine: Any,
        run_dir: Path,
        *,
        keep_last: int,
        rank: int,
        world_size: int,
        config: dict[str, Any],
        last_saved: int = -1,
        enabled: bool = True,
        verify: bool = False,
        size_hint: float = 0.0,
    ):
        self.engine, self.run_dir, self.keep_last, self.rank, self.config = engine, run_dir, keep_last, rank, config
        self.world_size, self.last_saved, self.enabled, self.verify = world_size, last_saved, enabled, verify
        self.size_hint = size_hint

    def save(self, marker: Marker) -> None:
        import deepspeed.comm as dist
        import torch.distributed as tdist

        if not self.enabled:
            self.last_saved = marker["step"]
            return
        tag = tag_for(marker["step"])
        if self.rank == 0:
            (self.run_dir / tag / MARKER).unlink(missing_ok=True)  # a re-save makes the tag incomplete until done
            shutil.rmtree(self.run_dir / f"{tag}{UNIVERSAL}", ignore_errors=True)  # converted from the old files
        dist.barrier()
        guard = _GuardedWrites(
            self.engine.checkpoint_engine,
            self.run_dir / tag,
            verify=self.verify,
            step=marker["step"],
            last_rank=self.rank == self.world_size - 1,
        )
        self.engine.checkpoint_engine = guard
        try:
            self.engine.save_checkpoint(
                str(self.run_dir), tag=tag, client_state={**marker, "config": self.config}, save_latest=False
            )
        finally:
            self.engine.checkpoint_engine = guard.inner
        reports: list[Any] = [None] * self.world_size
        tdist.all_gather_object(reports, (guard.error, guard.files))
        errors = [f"rank {r}: {err}" for r, (err, _) in enumerate(reports) if err]
        if errors:
            free = shutil.disk_usage(self.run_dir).free
            latest = latest_complete(self.run_dir)
            raise PipelineError(
                f"checkpoint {tag} could not be saved ({errors[0]}); {free / 1e9:,.1f} GB free at {self.run_dir}"
                + (f", a checkpoint needs about {self.size_hint / 1e9:,.1f} GB on a node" if self.size_hint else "")
                + f". The run stops; {latest or 'no checkpoint'} stays the latest complete checkpoint and the "
                f"incomplete {tag}/ can be deleted. Free space or move run_dir, then resume with the same command"
            )
        if self.rank == 0:
            files: dict[str, dict[str, Any]] = {}
            for _, written in reports:
                files.update(written)
            mark_complete(self.run_dir, tag, {**marker, "files": files})
            prune(self.run_dir, self.keep_last)
            log.info("saved checkpoint %s/%s", self.run_dir, tag)
        dist.barrier()
        self.last_saved = marker["step"]


UNIVERSAL = ".universal"


def universal(run_dir: Path, tag: str) -> tuple[str, bool]:
    """`TAG.universal`, DeepSpeed's universal form of checkpoint `tag` (optimizer states per parameter, loadable
    by any world size), converted with its own ds_to_universal once, into a temporary folder renamed when done.
    Returns (tag to load, whether it was converted now)."""
    import contextlib
    import io
    from types import SimpleNamespace

    out = Path(run_dir) / f"{tag}{UNIVERSAL}"
    if (out / MARKER).exists():
        return out.name, False
    from deepspeed.checkpoint.ds_to_universal import main as ds_to_universal

    tmp = Path(run_dir) / f".{tag}{UNIVERSAL}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    args = SimpleNamespace(
        input_folder=str(Path(run_dir) / tag),
        output_folder=str(tmp),
        num_extract_workers=2,
        num_merge_workers=1,
        keep_temp_folder=False,
        strict=True,
        inject_missing_state=True,
    )
    with contextlib.redirect_stdout(io.StringIO()):
        ds_to_universal(args)
    (Path(run_dir) / "latest_universal").unlink(missing_ok=True)  # it names the temporary folder; not ours to keep
    write_json(tmp / MARKER, read_marker(run_dir, tag))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
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
        if verify and "sha256" in want and file_sha256(path) != want["sha256"]:
            return f"{path}: sha256 differs from the marker's (damaged)"
    return None


def newest_intact(run_dir: Path, tags: list[str], verify: bool) -> tuple[str | None, list[str]]:
    """The newest complete checkpoint whose files are intact, and a warning for each newer one skipped. Nothing is
    deleted."""
    warnings: list[str] = []
    for tag in reversed(tags):
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
        return path.parent, path.name
    if not path.is_dir():
        raise PipelineError(f"{path}: no such run folder or checkpoint")
    tag = latest_complete(path)
    if tag is None:
        raise PipelineError(
            f"{path}: holds no complete checkpoint (expected folders step00000100/ with {MARKER}); "
            "is it a run folder of `pipeline pretrain`?"
        )
    return path, tag


def consolidated_state(run_dir: Path, tag: str, tied: frozenset[str] = frozenset()) -> dict[str, Any]:
    """Full-precision weights of any ZeRO stage (0-3, offload or not) by name, each read when asked for
    (`materialize`), so that a caller holds one tensor at a time, not the model. `tied`: names that only repeat
    another tensor (a tied output head, `ModelShape.tied_names`), left out.

    ZeRO 1-3: DeepSpeed's own zero_to_fp32 reconstruction in lazy mode over mmap'd shards. ZeRO-0: the module
    state in mp_rank_00_model_states.pt (mmap)."""
    import contextlib
    import io

    import torch

    ckpt_dir = Path(run_dir) / tag
    if list(ckpt_dir.glob("*_optim_states.pt")) and _zero_stage_of(ckpt_dir) > 0:
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        with contextlib.redirect_stdout(io.StringIO()):
            state = dict(get_fp32_state_dict_from_zero_checkpoint(str(run_dir), tag=tag, lazy_mode=True))
    else:
        files = sorted(ckpt_dir.glob("mp_rank_*_model_states.pt"))
        if not files:
            raise PipelineError(f"{ckpt_dir}: no DeepSpeed model states (mp_rank_00_model_states.pt)")
        state = dict(torch.load(files[0], map_location="cpu", mmap=True, weights_only=False)["module"])
    return {k: v for k, v in state.items() if k not in tied}


def materialize(value: Any) -> Any:
    """One entry of `consolidated_state` as an fp32 tensor in RAM."""
    return value.contiguous().float()


def consolidated_tensors(run_dir: Path, tag: str, tied: frozenset[str] = frozenset()) -> Iterator[tuple[str, Any]]:
    """`consolidated_state`, one fp32 tensor at a time."""
    for name, value in consolidated_state(run_dir, tag, tied).items():
        yield name, materialize(value)


def _zero_stage_of(ckpt_dir: Path) -> int:
    import torch

    f = next(ckpt_dir.glob("*_optim_states.pt"))
    sd = torch.load(f, map_location="cpu", mmap=True, weights_only=False)
    return int(sd.get("optimizer_state_dict", {}).get("zero_stage", 0))


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
