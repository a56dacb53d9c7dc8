"""The run's position, which the loop moves and its parts (checkpointer, logger, validator, guards) read."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class TrainState:
    """Where a run is: optimizer steps taken and training samples consumed (the data position), and whether this
    launch continued a checkpoint."""

    step: int = 0
    consumed_samples: int = 0
    resumed: bool = False
