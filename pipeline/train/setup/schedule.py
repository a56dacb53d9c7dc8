"""Pure arithmetic of a run's length and learning rate: the schedules as one closed table (`SCHEDULES`), the
parameters of a run's schedule as one value (`Schedule`), and the rate at each step (`lr_at`)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from pipeline.train.setup.config import PretrainConfig
from pipeline.train.setup.ds_config import BatchPlan

DEFAULT_DECAY_RATIO = 0.2
"""warmup-stable-decay without decay_steps or decay_ratio decays over the last 20% of the run (Hägele et al.,
arXiv 2405.18392: a 20% cooldown matches cosine)."""

SHAPES: dict[str, Callable[[float], float]] = {
    "linear": lambda p: 1.0 - p,
    "sqrt": lambda p: 1.0 - math.sqrt(p),
    "cosine": lambda p: 0.5 * (1.0 + math.cos(math.pi * p)),
}
"""A decay's shape: the share of (lr - min_lr) left at progress p in [0, 1]."""


@dataclass(frozen=True, slots=True)
class Schedule:
    """The learning rate of a run, every parameter of it: what a checkpoint records, so that a resume can tell
    whether any step already trained would have had another rate."""

    name: str
    lr: float
    min_lr: float
    warmup_steps: int
    warmup_start: float
    """The rate warmup starts from: 0 for a run from scratch, min_lr to rewarm a model's weights."""
    decay_steps: int | None
    decay_ratio: float | None
    decay_shape: str

    @classmethod
    def of(cls, cfg: PretrainConfig) -> Schedule:
        o = cfg.optim
        rewarm = o.warmup_from == "min_lr" or (o.warmup_from == "auto" and cfg.model.init_from is not None)
        return cls(
            o.schedule,
            o.lr,
            o.min_lr,
            o.warmup_steps,
            o.min_lr if rewarm else 0.0,
            o.decay_steps,
            o.decay_ratio,
            o.decay_shape,
        )

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def decay_start(self, max_steps: int) -> int:
        """The first step of warmup-stable-decay's final decay."""
        length = self.decay_steps or round((self.decay_ratio or DEFAULT_DECAY_RATIO) * max_steps)
        return max(self.warmup_steps, max_steps - max(1, length))

    def describe(self, max_steps: int) -> str:
        """One line for the run's log and `pipeline plan`."""
        warm = f"warmup {self.warmup_steps} steps from {self.warmup_start:.3g}"
        if self.name == "cosine":
            decay = self.decay_steps or max(1, max_steps - self.warmup_steps)
            return f"schedule cosine: {warm} to {self.lr:.3g}, cosine to {self.min_lr:.3g} over {decay} steps"
        if self.name == "constant":
            return f"schedule constant: {warm} to {self.lr:.3g}, then {self.lr:.3g}"
        start = self.decay_start(max_steps)
        return (
            f"schedule wsd: {warm} to {self.lr:.3g}, stable to step {start}, {self.decay_shape} decay to "
            f"{self.min_lr:.3g} over steps {start + 1}-{max_steps}"
        )


def _cosine(s: Schedule, step: int, max_steps: int) -> float:
    decay = s.decay_steps if s.decay_steps is not None else max(1, max_steps - s.warmup_steps)
    progress = min(1.0, (step - s.warmup_steps) / max(1, decay))
    return s.min_lr + (s.lr - s.min_lr) * SHAPES["cosine"](progress)


def _wsd(s: Schedule, step: int, max_steps: int) -> float:
    start = s.decay_start(max_steps)
    if step < start:
        return s.lr
    progress = min(1.0, (step - start + 1) / max(1, max_steps - start))  # the run's last update is at min_lr
    return s.min_lr + (s.lr - s.min_lr) * SHAPES[s.decay_shape](progress)


@dataclass(frozen=True, slots=True)
class ScheduleKind:
    after_warmup: Callable[[Schedule, int, int], float]
    fixed_horizon: bool
    """Whether the run's length shapes the rate of every step after warmup (cosine), so that lengthening a run
    changes rates already trained; warmup-stable-decay and constant change only what is still to come."""
    summary: str


SCHEDULES: dict[str, ScheduleKind] = {
    "cosine": ScheduleKind(
        _cosine, True, "linear warmup, cosine decay to min_lr over decay_steps (default: the rest of the run)"
    ),
    "wsd": ScheduleKind(
        _wsd,
        False,
        "warmup-stable-decay: linear warmup, lr until the decay, then decay_shape (linear, sqrt, cosine) to min_lr "
        "over the last decay_steps (or decay_ratio of the run, default 0.2); extendable while stable, and a cooldown "
        "can be branched from any stable checkpoint",
    ),
    "constant": ScheduleKind(lambda s, step, n: s.lr, False, "linear warmup, then lr to the end"),
}
"""The learning-rate schedules, a closed set: `optim.schedule` names one."""


def learning_rate(step: int, s: Schedule, max_steps: int) -> float:
    """The rate of update `step` (0-based): linear warmup from `warmup_start` over `warmup_steps`, then the
    schedule's own shape."""
    if step < s.warmup_steps:
        return s.warmup_start + (s.lr - s.warmup_start) * (step + 1) / s.warmup_steps
    return SCHEDULES[s.name].after_warmup(s, step, max_steps)


def lr_at(step: int, cfg: PretrainConfig, max_steps: int) -> float:
    """The rate of update `step` (0-based) under the config's schedule for a run of `max_steps`."""
    return learning_rate(step, Schedule.of(cfg), max_steps)


def first_changed_step(before: Schedule, before_steps: int, now: Schedule, now_steps: int, upto: int) -> int | None:
    """The first of updates 0..upto (inclusive) whose rate differs between two schedules (None: all equal): a
    resume at step `upto` keeps every trained rate when the answer is None or `upto` itself."""
    for step in range(upto + 1):
        if learning_rate(step, before, before_steps) != learning_rate(step, now, now_steps):
            return step
    return None


def max_steps_for(cfg: PretrainConfig, plan: BatchPlan) -> int:
    if cfg.train.max_steps is not None:
        return cfg.train.max_steps
    assert cfg.train.max_tokens is not None
    return math.ceil(cfg.train.max_tokens / plan.tokens_per_step)
