"""The checkpointer of a run: when to save (every `checkpoint.interval` steps, on a stop, at the end), how (every
rank writes its shards, rank 0 the marker and `latest`, with barriers around), and resume from end to end (which
tag, whether it may be resumed, the universal form for another world size, loading, the CPU-Adam repair). The
loop only calls `resume`, `maybe_save` and `finish`; the pure rules are in pipeline.train.checkpoint.resume, the
files in pipeline.train.checkpoint.files."""

from __future__ import annotations

import contextlib
import errno
import logging
import shutil
import socket
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from pipeline.atomic import sha256_file
from pipeline.errors import PipelineError, SaidOnRankZero
from pipeline.train import faults
from pipeline.train.checkpoint import files as ckpt
from pipeline.train.checkpoint.resume import continue_from, resumable
from pipeline.train.runtime.dist import on_rank0, ranks_per_node
from pipeline.train.runtime.ds_workarounds import replay_adam_beta_powers
from pipeline.train.setup.prepare import Run
from pipeline.train.setup.schedule import Schedule, max_steps_for
from pipeline.train.setup.stages import stage_of_checkpoint
from pipeline.units import format_size

if TYPE_CHECKING:
    from pipeline.train.state import StepEnd, TrainState

log = logging.getLogger(__name__)


class Pausable(Protocol):
    def paused(self) -> contextlib.AbstractContextManager[None]: ...


class Checkpointer:
    """Saves the run's engine as `step{N:08d}` and resumes it. A checkpoint counts once every rank has written its
    files and rank 0 has written the marker (listing every file with its size, and sha256 under
    `checkpoint.verify`) and `latest`; a write that fails (a full disk) stops every rank with one message, and the
    previous checkpoint stays the latest. `watchdog` is paused during saves: they are long and legitimate."""

    def __init__(self, run: Run, *, data_fingerprint: str, watchdog: Pausable | None = None):
        self.run, self.cfg, self.watchdog = run, run.cfg.checkpoint, watchdog
        self.data_fingerprint = data_fingerprint
        self.size_hint = ckpt.checkpoint_size(run, run.dist.world_size, ranks_per_node(run.dist.world_size))
        self.last_saved = -1
        self.engine: Any = None
        self.branched_from: Path | None = None
        """The source checkpoint when this launch started the run from another run's (checkpoint.branch_from)."""

    # ---- resume -------------------------------------------------------------------------------------------------

    def resume(self, build_engine: Callable[[dict[str, Any]], Any]) -> tuple[Any, ckpt.Marker | None]:
        """Decide what this launch continues (before anything heavy is built), build the engine with
        `build_engine(ds_config)`, load the checkpoint into it. Returns the engine and the marker of the
        checkpoint it continued (its step and consumed samples are where the run stands), None when fresh."""
        run, run_dir = self.run, self.run.run_dir
        found = on_rank0(self._choose)  # rank 0 reads the run folder and decides; every rank takes its answer
        ds = run.ds
        if found is None:
            self.engine = build_engine(ds)
            return self.engine, None
        tag, marker, folder = found
        load_tag, load_dir = tag, folder
        if marker["world_size"] != run.dist.world_size and run.layout.stage > 0:
            # Another world size: DeepSpeed's universal checkpoint re-partitions the optimizer states. Rank 0
            # converts once (kept beside the checkpoint for the next launch; a branch's in its own run_dir, so
            # the source run is only read); the engine loads it with load_universal.
            timeout_s = run.cfg.train.comm_timeout_minutes * 60
            load_tag = on_rank0(lambda: self._universal(folder, tag), heartbeat_s=min(60.0, timeout_s / 4))
            load_dir = run_dir
            ds = {**ds, "checkpoint": {**ds.get("checkpoint", {}), "load_universal": True}}
        self.engine = build_engine(ds)
        self.engine.load_checkpoint(
            str(load_dir), tag=load_tag, load_optimizer_states=True, load_lr_scheduler_states=False
        )
        replay_adam_beta_powers(self.engine.optimizer, run.dist.device)
        self.last_saved = marker["step"]
        self.branched_from = None if folder == run_dir else folder / tag
        if run.dist.rank == 0 and self.branched_from is not None:
            log.info(
                "branched from %s: step %d, %d samples consumed (that run is read, never written)",
                self.branched_from,
                marker["step"],
                marker["consumed_samples"],
            )
        elif run.dist.rank == 0:
            through = (
                f" (saved by {marker['world_size']} ranks, now {run.dist.world_size}: through the universal "
                f"checkpoint {load_tag})"
                if load_tag != tag
                else ""
            )
            log.info(
                "resumed from %s/%s: step %d, %d samples consumed%s",
                run_dir,
                tag,
                marker["step"],
                marker["consumed_samples"],
                through,
            )
        return self.engine, marker

    def _choose(self) -> tuple[str, ckpt.Marker, Path] | None:
        """Rank 0: the checkpoint to continue (skipping complete ones whose files are damaged, with a warning each)
        and its marker, refused when this config cannot continue it (another model, seq_len, data...; `pipeline
        pretrain` refuses it before launch), with a note when the run's length changed. Warns when the disk cannot
        hold `keep_last` checkpoints plus the next (`pipeline pretrain` refuses such a run before launch)."""
        run_dir = self.run.run_dir
        found = resumable(run_dir, self.cfg.resume, self.cfg.verify, self.cfg.branch_from)
        for w in found.warnings if found else []:
            log.warning("%s", w)
        if self.cfg.enabled and (problem := ckpt.space_problem(run_dir, self.size_hint, self.cfg.keep_last)):
            log.warning("warning: %s", problem)
        if found is None:
            return None
        tag, marker, _, folder = found
        # the data the checkpoint's last update read: the trainer's own for the first stage, else the stage's shards
        first = stage_of_checkpoint(self.run.cfg.data, marker["step"]).index == 0
        fingerprint = self.data_fingerprint if first else None
        if note := continue_from(self.run, self.run.dist.world_size, tag, marker, fingerprint, folder=folder):
            log.warning("%s", note)
        return tag, marker, folder

    def _universal(self, folder: Path, tag: str) -> str:
        """Rank 0: the universal form of `folder`/`tag` in this run's folder, converted now unless it is there
        from an earlier launch."""
        import psutil

        run_dir = self.run.run_dir
        workers = ckpt.CONVERSION_WORKERS
        if not (run_dir / f"{tag}{ckpt.UNIVERSAL}" / ckpt.MARKER).exists():
            run_dir.mkdir(parents=True, exist_ok=True)
            free, ram = shutil.disk_usage(run_dir).free, psutil.virtual_memory().available
            workers, problem = ckpt.conversion_plan(folder, tag, free, ram)
            if problem:
                raise PipelineError(problem)
        try:
            name, converted = ckpt.universal(folder, tag, workers, into=run_dir)
        except Exception as e:  # noqa: BLE001 - said on every rank by on_rank0
            raise PipelineError(
                f"converting {folder}/{tag} to a universal checkpoint failed: {type(e).__name__}: {e}"
            ) from e
        if converted:
            log.info(
                "converted %s/%s to DeepSpeed's universal checkpoint %s/%s (once; kept for later launches)",
                folder,
                tag,
                run_dir,
                name,
            )
        return name

    # ---- saving ---------------------------------------------------------------------------------------------------

    def after_step(self, end: StepEnd) -> None:
        self.maybe_save(end.state, stopping=end.stopping)

    def at_end(self, state: TrainState) -> None:
        self.finish(state)

    def maybe_save(self, state: TrainState, *, stopping: bool = False) -> None:
        """Save when the step is due (`checkpoint.interval`), or when the run is stopping and this step is not saved."""
        if state.step % self.cfg.interval == 0 or (stopping and self.last_saved != state.step):
            self.save(state)

    def finish(self, state: TrainState) -> None:
        """The end of the run: its last step is saved (once)."""
        if self.last_saved != state.step:
            self.save(state)

    def save(self, state: TrainState) -> None:
        with self.watchdog.paused() if self.watchdog else contextlib.nullcontext():
            self._save(state)

    def marker(self, state: TrainState) -> ckpt.Marker:
        run = self.run
        return {
            "step": state.step,
            "consumed_samples": state.consumed_samples,
            "data_fingerprint": self.data_fingerprint,
            "seq_len": run.plan.seq_len,
            "tokenizer_sha256": run.manifest["tokenizer"]["sha256"],
            "model_shape": run.shape.as_dict(),
            "world_size": run.dist.world_size,
            "zero_stage": run.layout.stage,
            "precision": run.cfg.train.precision,
            "optimizer": run.cfg.optim.name,
            "global_batch_size": run.plan.global_batch_size,
            "max_steps": max_steps_for(run.cfg, run.plan),
            "schedule": Schedule.of(run.cfg).as_dict(),
            "config": run.cfg.to_dict(),  # every field, classified against the next config (resume.RESUME_RULES)
        }

    def _save(self, state: TrainState) -> None:
        import deepspeed.comm as dist
        import torch.distributed as tdist

        if not self.cfg.enabled:
            self.last_saved = state.step
            return
        run_dir, rank, world = self.run.run_dir, self.run.dist.rank, self.run.dist.world_size
        marker = self.marker(state)
        tag = ckpt.tag_for(state.step)
        if rank == 0:
            (run_dir / tag / ckpt.MARKER).unlink(missing_ok=True)  # a re-save makes the tag incomplete until done
            shutil.rmtree(run_dir / f"{tag}{ckpt.UNIVERSAL}", ignore_errors=True)  # converted from the old files
        dist.barrier()
        with _guarded_writes(
            self.engine, run_dir / tag, verify=self.cfg.verify, step=state.step, last_rank=rank == world - 1
        ) as guard:
            self.engine.save_checkpoint(
                str(run_dir), tag=tag, client_state={**marker, "config": self.run.cfg.to_dict()}, save_latest=False
            )
        reports: list[Any] = [None] * world
        tdist.all_gather_object(reports, (guard.error, guard.files, socket.gethostname()))
        errors = [f"rank {r}: {err}" for r, (err, _, _) in enumerate(reports) if err]
        if errors:  # the same words on every rank; rank 0 says them (pipeline.train.main)
            free = shutil.disk_usage(run_dir).free
            latest = ckpt.latest_complete(run_dir)
            said = PipelineError if rank == 0 else SaidOnRankZero
            raise said(
                f"checkpoint {tag} could not be saved ({errors[0]}); {format_size(free)} free at {run_dir}"
                + (f", a checkpoint needs about {format_size(self.size_hint)} on a node" if self.size_hint else "")
                + f". The run stops; {latest or 'no checkpoint'} stays the latest complete checkpoint and the "
                f"incomplete {tag}/ is never resumed (delete it to free its space). Free space or move run_dir, then "
                "resume with the same command"
            )
        if rank == 0:
            files: dict[str, dict[str, Any]] = {}
            for _, written, host in reports:  # which host wrote each file: a per-node run_dir is told apart
                files.update({name: {**entry, "host": host} for name, entry in written.items()})
            ckpt.mark_complete(run_dir, tag, {**marker, "files": files})
            ckpt.prune(run_dir, self.cfg.keep_last, keep=tag)
            log.info("saved checkpoint %s/%s", run_dir, tag)
        dist.barrier()
        self.last_saved = state.step


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

    def fail(self, path: str | Path, e: BaseException) -> None:
        """Record a failed write (the first), in words that name a full disk as such."""
        if self.error:
            return
        reason = e.strerror if isinstance(e, OSError) and e.strerror else (str(e).strip().splitlines() or [""])[0]
        if "No space left" not in reason and not isinstance(e, OSError) and _disk_full(Path(path)):
            reason = f"No space left on device ({type(e).__name__}: {reason})"
        self.error = f"{path}: {reason}"

    def save(self, state_dict: Any, path: str) -> Any:
        if self.error:
            return None
        try:
            if self.last_rank and faults.armed("ENOSPC_IN_SAVE", self.step):
                faults.fired()
                raise OSError(errno.ENOSPC, "No space left on device (injected by PIPELINE_FAULT_ENOSPC_IN_SAVE)")
            out = self.inner.save(state_dict, path)
        except (OSError, RuntimeError) as e:  # torch.save reports a full disk as a RuntimeError of its zip writer
            self.fail(path, e)
            Path(path).unlink(missing_ok=True)  # no half-written file that looks whole
            return None
        entry: dict[str, Any] = {"size": Path(path).stat().st_size}
        if self.verify:
            entry["sha256"] = sha256_file(Path(path))
        self.files[str(Path(path).relative_to(self.root))] = entry
        if self.last_rank and faults.armed("KILL_IN_SAVE", self.step):
            faults.kill_self()
        return out


def _disk_full(path: Path, slack: int = 1 << 20) -> bool:
    """Whether the disk holding `path` has (almost) no space left."""
    folder = path if path.is_dir() else path.parent
    try:
        return shutil.disk_usage(folder).free < slack
    except OSError:
        return False


@contextlib.contextmanager
def _guarded_writes(engine: Any, root: Path, **kw: Any) -> Iterator[_GuardedWrites]:
    """During one save: DeepSpeed's checkpoint engine behind `_GuardedWrites`, and rank 0's copy of DeepSpeed's
    recovery scripts (zero_to_fp32.py) guarded the same way, since a full disk can fail that copy too, after the
    rank's last barrier of the save but one."""
    guard = _GuardedWrites(engine.checkpoint_engine, root, **kw)
    engine.checkpoint_engine = guard
    copy_scripts = engine._copy_recovery_script

    def guarded_copy(save_path: str) -> None:
        if not guard.error:
            try:
                copy_scripts(save_path)
            except OSError as e:
                guard.fail(save_path, e)

    engine._copy_recovery_script = guarded_copy
    try:
        yield guard
    finally:
        engine.checkpoint_engine = guard.inner
        del engine._copy_recovery_script  # the class's method again
