"""What stops a run that went wrong instead of letting it hang or train on garbage: a watchdog for a peer that
stopped answering, and the non-finite loss policy."""

from __future__ import annotations

import contextlib
import logging
import math
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from pipeline.data.loader import GlobalOrder
from pipeline.errors import PipelineError
from pipeline.train.checkpoint.files import latest_complete
from pipeline.train.setup.config import PretrainConfig
from pipeline.train.setup.ds_config import BatchPlan

if TYPE_CHECKING:
    from pipeline.train.state import StepEnd, TrainState

log = logging.getLogger(__name__)


SUPERVISOR_ENV = "PYTHON_PIPELINE_SUPERVISOR"
"""HOST:PID:START of the `pipeline pretrain` that launched the run (pipeline.launch.supervise.Supervised). The PYTHON
prefix is one DeepSpeed's multi-node runner exports to every node; the ranks of other hosts do not watch it."""


def supervisor_gone(value: str | None, host: str) -> bool:
    """Whether the launching `pipeline pretrain` of `value` (SUPERVISOR_ENV) has died: killed with SIGKILL (the
    OOM killer, `docker kill`, `kill -9`), so that nothing forwards a stop to this rank any more. False when there is
    none to watch (a launch with `deepspeed` directly) or it runs on another host."""
    if not value:
        return False
    rest = value.split(":")
    if len(rest) != 3 or rest[0] != host:
        return False
    import psutil

    try:
        p = psutil.Process(int(rest[1]))
        return abs(p.create_time() - float(rest[2])) > 0.01 or p.status() == psutil.STATUS_ZOMBIE  # pid reused
    except psutil.NoSuchProcess:
        return True
    except (ValueError, psutil.Error):
        return False


class Watchdog:
    """Exits this rank when it makes no progress (a micro-step, a validation batch) within `timeout_s`
    (train.comm_timeout_minutes): a peer that hangs
    (SIGSTOP, a stuck driver) leaves the others waiting in a collective that may never time out (DeepSpeed's CPU
    shared-memory all-reduce spins), so the launch would hang forever. Exiting makes the launcher stop every rank
    and the launch fail. Saves are long and legitimate: the watchdog is paused around them.

    It also watches the `pipeline pretrain` that launched the run (SUPERVISOR_ENV): killed, it can no longer
    forward a stop, and the ranks would train on headless, holding the run folder and the GPUs. This rank then
    stops as on SIGTERM (the ranks agree, save and exit), within `SUPERVISOR_POLL_S` and a step."""

    SUPERVISOR_POLL_S = 2.0

    def __init__(self, timeout_s: float, rank: int, launch_log: Path | None = None):
        import socket

        self.timeout_s, self.rank, self.launch_log = timeout_s, rank, launch_log
        self._last = time.monotonic()
        self._paused = 0
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="pipeline-watchdog", daemon=True)
        self._supervisor = os.environ.get(SUPERVISOR_ENV)
        self._host = socket.gethostname()

    def start(self) -> None:
        self.beat()
        self._thread.start()

    def beat(self) -> None:
        self._last = time.monotonic()

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1
            self.beat()

    def stop(self) -> None:
        self._done.set()

    def _watch(self) -> None:
        while not self._done.wait(min(self.SUPERVISOR_POLL_S, self.timeout_s / 4)):
            if self._supervisor and supervisor_gone(self._supervisor, self._host):
                self._supervisor = None
                self._orphaned()
            idle = time.monotonic() - self._last
            if not self._paused and idle > self.timeout_s:
                print(
                    f"error: rank {self.rank}: no training step finished for {idle:.0f} s, not even a micro-step "
                    f"(train.comm_timeout_minutes {self.timeout_s / 60:g}); another rank has hung or died. "
                    "Exiting so that the launch fails instead of hanging; resume with the same command",
                    file=sys.stderr,
                    flush=True,
                )
                os._exit(3)

    def _orphaned(self) -> None:
        """The launching command is gone: stop as on the SIGTERM it would have forwarded, and since its reader of
        this rank's output went with it, write what follows to RUN_DIR/logs/launch.log instead of a dead pipe."""
        os.kill(os.getpid(), signal.SIGTERM)
        with contextlib.suppress(OSError):
            if self.launch_log is not None:
                self.launch_log.parent.mkdir(parents=True, exist_ok=True)
                fd = os.open(self.launch_log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
                os.dup2(fd, sys.stdout.fileno())
                os.dup2(fd, sys.stderr.fileno())
                os.close(fd)
            # Said by each rank that notices: the first to notice stops them all (they agree at the step's end), so
            # rank 0's own watcher may never poll again before the run has saved and exited.
            print(
                f"rank {self.rank}: the `pipeline pretrain` that launched this run is gone (killed, or its session "
                "ended): every rank saves at the end of its step and stops; the same command resumes",
                file=sys.stderr,
                flush=True,
            )


class NonFinite:
    """`train.on_nonfinite`. DeepSpeed does not apply an update whose gradient norm is not finite (ZeRO 1-3; it
    counts it in `skipped_steps`, the same on every rank), so the weights stay good; this decides what the run
    does about it, from values every rank has (the all-reduced loss and the skip count), so all ranks agree.

    fp16 is the exception: dynamic loss scaling overflows by design (it doubles the scale after a run of clean
    steps until one overflows, then skips that step and halves it), so there a skipped update with a finite loss is
    the loss scaler at work and counts for nothing; a non-finite loss still does."""

    RIGHT_AFTER_RESUME = 3
    """Steps after a resume in which a non-finite step points at the checkpoint as much as at the data."""

    def __init__(
        self,
        cfg: PretrainConfig,
        plan: BatchPlan,
        rank: int,
        train_samples: int,
        skipped_steps: int = 0,
        resumed_at: int | None = None,
        run_dir: Path | None = None,
    ):
        self.cfg, self.plan, self.rank, self.train_samples = cfg, plan, rank, train_samples
        self.resumed_at = resumed_at
        self.run_dir = run_dir
        self.skipped_before = skipped_steps
        self.in_a_row = 0
        self.total = 0
        self.overflows = 0
        """fp16 loss-scale overflows seen in this launch (normal; logged in metrics as skipped_steps)."""

    def after_step(self, end: StepEnd) -> None:
        self.check(
            end.loss, end.skipped_steps, end.state, Path(self.cfg.run_dir) if self.run_dir is None else self.run_dir
        )

    def at_end(self, state: TrainState) -> None:
        """Nothing to do at the run's end."""

    def check(self, loss: float, skipped_steps: int, state: TrainState, run_dir: Path) -> None:
        """After each step, with the loss every rank agrees on and DeepSpeed's count of skipped updates: stop
        (raise) or count and log a dropped update."""
        dropped = skipped_steps > self.skipped_before
        self.skipped_before = skipped_steps
        if dropped and math.isfinite(loss) and self.cfg.train.precision == "fp16":
            self.overflows += 1  # the loss scaler found an overflow and lowered the scale: by design
            dropped = False
        if math.isfinite(loss) and not dropped:
            self.in_a_row = 0
            return
        self.in_a_row += 1
        self.total += 1
        step = state.step
        what = f"loss {loss}" if not math.isfinite(loss) else "a non-finite gradient norm"
        ids = self.sample_ids(state.consumed_samples)
        shown = ", ".join(map(str, ids[:16])) + (f", ... ({len(ids)} samples)" if len(ids) > 16 else "")
        applied = "DeepSpeed did not apply that update" if dropped else "that update may have been applied"
        if self.cfg.train.on_nonfinite == "stop" or self.in_a_row > self.cfg.train.max_nonfinite_in_a_row:
            latest = latest_complete(run_dir)
            why = (
                "train.on_nonfinite is stop"
                if self.cfg.train.on_nonfinite == "stop"
                else f"{self.in_a_row} in a row > train.max_nonfinite_in_a_row"
            )
            resumed = ""
            if self.resumed_at is not None and step - self.resumed_at <= self.RIGHT_AFTER_RESUME:
                resumed = (
                    f" This launch resumed at step {self.resumed_at}, {step - self.resumed_at} step(s) ago: a damaged "
                    "checkpoint (its optimizer states) does the same. Check it with checkpoint.verify: true (every "
                    "file's sha256, when the save recorded them), or resume from the one before "
                    "(checkpoint.resume: TAG)."
                )
            raise PipelineError(
                f"step {step}: {what} ({why}); {applied} and nothing was saved, so {latest or 'no checkpoint'} "
                f"stays the latest. The step's samples (train split ids): {shown}. Look at them, lower optim.lr, "
                f"or set train.on_nonfinite: skip; then resume with the same command.{resumed}"
            )
        if self.rank == 0:
            log.warning(
                "step %d: %s; %s (skipped %d in a row, %d in this launch); samples %s",
                step,
                what,
                applied,
                self.in_a_row,
                self.total,
                shown,
            )

    def sample_ids(self, consumed_samples: int) -> list[int]:
        """The train-split sample ids of the step just taken (the loader's order is the same for any world size)."""
        order = GlobalOrder(self.train_samples, self.cfg.train.seed)
        start = consumed_samples - self.plan.global_batch_size
        return [order[start + i] for i in range(self.plan.global_batch_size)]
