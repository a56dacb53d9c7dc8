"""Where a run's numbers go: one log line per interval on rank 0 (`StepLogger`), `metrics.jsonl`, TensorBoard and
the trackers the config turns on (W&B, MLflow: `MetricsSink`). MFU is counted the PaLM way (6N + 12*L*h*s FLOPs per
token, as TinyLlama and torchtitan count it)."""

from __future__ import annotations

import json
import logging
import math
import resource
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from pipeline.atomic import write_text
from pipeline.plan.gpus import peak_tflops_for_device

if TYPE_CHECKING:
    from pipeline.train.setup.prepare import Run
    from pipeline.train.state import StepEnd, TrainState

log = logging.getLogger(__name__)


class MetricsSink:
    """Rank 0 appends records to RUN_DIR/metrics.jsonl and TensorBoard; on other ranks every call is a no-op.
    On resume, lines past the checkpoint's step are dropped first so the file reads as one continuous run."""

    def __init__(
        self,
        run_dir: Path,
        *,
        rank: int,
        tensorboard: bool,
        resumed_at: int | None = None,
        trackers: Callable[[], Any] | None = None,
    ):
        self.active = rank == 0
        self._file = None
        self._writer: Any = None
        self._trackers: Any = None
        if not self.active:
            return
        if trackers is not None:
            self._trackers = trackers()  # W&B, MLflow (pipeline.train.parts.tracking), rank 0 only
        path = run_dir / "metrics.jsonl"
        if resumed_at is not None:
            truncate_metrics(path, resumed_at)
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(str(run_dir / "tb"))
        self._file = open(path, "a")  # noqa: SIM115 - held for the run, closed in close()

    def emit(self, record: dict[str, Any]) -> None:
        if self._file is not None:
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()
        if self._writer is not None:
            for k, v in record.items():
                if k != "step" and isinstance(v, (int, float)):
                    self._writer.add_scalar(k, v, record["step"])
        if self._trackers is not None:
            self._trackers.log(record)

    def close(self) -> None:
        if self._trackers is not None:
            self._trackers.close()
        if self._writer is not None:
            self._writer.close()
        if self._file is not None:
            self._file.close()


class Throughput:
    """Tokens per second since the last log line, and the ETA from the whole run's average step time."""

    def __init__(self, start_step: int):
        self.start_step = start_step
        self.t_start = self.t_log = time.perf_counter()
        self.tokens = 0

    def add(self, tokens: int) -> None:
        self.tokens += tokens

    def take(self, step: int, max_steps: int) -> tuple[float, float]:
        """(tokens/s since the last call, ETA in seconds) and restart the interval."""
        now = time.perf_counter()
        tps = self.tokens / max(now - self.t_log, 1e-9)
        eta = (now - self.t_start) / max(1, step - self.start_step) * (max_steps - step)
        self.t_log, self.tokens = now, 0
        return tps, eta


def format_line(rec: dict[str, Any], max_steps: int, eta_s: float) -> str:
    mfu = f"{rec['mfu']:.1%}" if rec.get("mfu") is not None else "n/a"
    gnorm = f"{rec['grad_norm']:.3f}" if rec.get("grad_norm") is not None else "n/a"
    return (
        f"step {rec['step']}/{max_steps} | loss {rec['loss']:.4f} | lr {rec['lr']:.2e} | gnorm {gnorm} | "
        f"tok/s {rec['tokens_per_s']:.1f} | tflops {rec['tflops_per_device']:.2f} | mfu {mfu} | "
        f"mem {rec['mem_gib']:.2f}G | eta {fmt_eta(eta_s)}"
    )


def mem_gib(device: torch.device) -> float:
    """Peak GPU memory allocated by this process; on the CPU, the process's peak RSS."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB -> GiB


def fmt_eta(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    h, m = divmod(int(seconds) // 60, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{int(seconds) % 60:02d}s"


def truncate_metrics(path: Path, step: int) -> None:
    """Drop metric lines past `step` (a resumed run's checkpoint)."""
    if not path.exists():
        return
    keep = [line for line in path.read_text().splitlines() if line and json.loads(line).get("step", 0) <= step]
    write_text(path, "".join(line + "\n" for line in keep))


class StepLogger:
    """Every `log.interval` steps (and at the last): one line on rank 0 and a record in the sink, with loss, lr,
    gradient norm, tokens/s since the last line, TFLOP/s and MFU (PaLM count) per device, peak memory, the ETA, and
    the interval's mean seconds per step (`step_s`) and per optimizer step (`optimizer_s`)."""

    def __init__(self, run: Run, engine: Any, sink: MetricsSink, start_step: int, max_steps: int):
        self.run, self.engine, self.sink, self.max_steps = run, engine, sink, max_steps
        self.throughput = Throughput(start_step)
        self.peak = peak_for(run.dist.device, run.cfg.train.peak_tflops, run.dist.rank)
        self.timings: dict[str, float] = {}
        self.timed_steps = 0

    def after_step(self, end: StepEnd) -> None:
        self.maybe_log(end.state, loss=end.loss, lr=end.lr, timings=end.timings)

    def at_end(self, state: TrainState) -> None:
        """Nothing to do at the run's end."""

    def maybe_log(self, state: TrainState, *, loss: float, lr: float, timings: dict[str, float] | None = None) -> None:
        self.throughput.add(self.run.plan.tokens_per_step)
        for k, v in (timings or {}).items():
            self.timings[k] = self.timings.get(k, 0.0) + v
        self.timed_steps += 1
        if state.step % self.run.cfg.log.interval and state.step != self.max_steps:
            return
        tps, eta = self.throughput.take(state.step, self.max_steps)
        rec = self.record(state, loss=loss, lr=lr, tokens_per_s=tps)
        # Seconds per step, training only (the interval's tokens/s also holds validation and checkpoint saves).
        rec |= {k: v / self.timed_steps for k, v in self.timings.items()}
        self.timings, self.timed_steps = {}, 0
        if self.run.dist.rank == 0:
            log.info(format_line(rec, self.max_steps, eta))
        self.sink.emit(rec)

    def record(self, state: TrainState, *, loss: float, lr: float, tokens_per_s: float) -> dict[str, Any]:
        """One metrics line: loss, lr, gradient norm, throughput, TFLOP/s and MFU (PaLM count), memory."""
        run, engine = self.run, self.engine
        tflops = tokens_per_s * run.shape.flops_per_token(run.plan.seq_len) / run.dist.world_size / 1e12
        gnorm = engine.get_global_grad_norm()
        rec = {
            "step": state.step,
            "loss": loss,
            "lr": lr,
            "grad_norm": float(gnorm) if gnorm is not None else None,
            "tokens": state.consumed_samples * run.plan.seq_len,
            "tokens_per_s": tokens_per_s,
            "tflops_per_device": tflops,
            "mfu": tflops / self.peak if self.peak else None,
            "mem_gib": mem_gib(run.dist.device),
        }
        if run.ds.get("fp16", {}).get("enabled"):
            optimizer = engine.optimizer
            rec["loss_scale"] = float(getattr(optimizer, "cur_scale", getattr(optimizer, "loss_scale", 0)))
            rec["skipped_steps"] = int(engine.skipped_steps)
        return rec


def peak_for(device: torch.device, override: float | None, rank: int) -> float | None:
    """The card's dense bf16 peak for MFU (PaLM count): `train.peak_tflops`, else the GPU table; None on the CPU
    and for a card the table does not know (MFU is then logged as n/a, with one warning)."""
    if override or device.type != "cuda":
        return override
    name = torch.cuda.get_device_name(device)
    peak = peak_tflops_for_device(name)
    if peak is None and rank == 0:
        log.warning(
            "GPU '%s' is not in the planner's table: MFU is logged as n/a; set train.peak_tflops to the "
            "card's dense bf16 TFLOP/s to see it",
            name,
        )
    return peak
