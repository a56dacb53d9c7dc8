"""Where a run's numbers go: one log line per interval on rank 0, `metrics.jsonl` and TensorBoard."""

from __future__ import annotations

import json
import logging
import math
import resource
import time
from pathlib import Path
from typing import Any

import torch

from pipeline.atomic import write_text

log = logging.getLogger("pipeline.pretrain")


class MetricsSink:
    """Rank 0 appends records to RUN_DIR/metrics.jsonl and TensorBoard; on other ranks every call is a no-op.
    On resume, lines past the checkpoint's step are dropped first so the file reads as one continuous run."""

    def __init__(self, run_dir: Path, *, rank: int, tensorboard: bool, resumed_at: int | None = None):
        self.active = rank == 0
        self._file = None
        self._writer: Any = None
        if not self.active:
            return
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

    def close(self) -> None:
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
