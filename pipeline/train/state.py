"""The run's position, which the loop moves and its parts (checkpointer, logger, validator, guards) read, and the
one hook the loop calls its parts by (`Part`: after each step, at the end)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass
class TrainState:
    """Where a run is: optimizer steps taken and training samples consumed (the data position), and whether this
    launch continued a checkpoint."""

    step: int = 0
    consumed_samples: int = 0
    resumed: bool = False


@dataclass(frozen=True)
class StepEnd:
    """What the loop hands its parts after each optimizer step (`Part.after_step`)."""

    state: TrainState
    """Where the run stands, moved past the step."""
    loss: float
    """The step's loss, averaged over the data-parallel replicas (the same on every rank)."""
    lr: float
    skipped_steps: int
    """DeepSpeed's count of updates it did not apply (a non-finite gradient), the same on every rank."""
    stopping: bool
    """A rank was asked to stop (a signal): the run saves and ends after this step."""
    timings: dict[str, float] = field(default_factory=dict)
    engine: Any = None


class Part(Protocol):
    """A part of the loop (pipeline.train.loop.Trainer.fit): each decides for itself whether its interval is due.
    A new part is a class with these two methods, registered in the one list of `Trainer.fit`."""

    def after_step(self, end: StepEnd) -> None: ...

    def at_end(self, state: TrainState) -> None: ...
