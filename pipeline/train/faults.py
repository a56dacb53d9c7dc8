"""Fault injection for the tests, and only for them: environment switches that make a rank fail at a known point,
so the recovery paths run for real (a SIGKILL is a SIGKILL; a full disk is an OSError from the write).

  PIPELINE_FAULT_KILL_AT_STEP=N       rank 0 SIGKILLs itself once step N is done (and saved, if due)
  PIPELINE_FAULT_KILL_IN_SAVE=N       the last rank SIGKILLs itself in the save of step N, after its first file
  PIPELINE_FAULT_ENOSPC_IN_SAVE=N     the last rank's writes in the save of step N fail with ENOSPC
  PIPELINE_FAULT_NONFINITE_AT_STEP=N  rank 0's loss at step N is NaN
  PIPELINE_FAULT_SLOW_MICRO_STEP=S    every rank sleeps S seconds in each training micro-step (a long step)
  PIPELINE_FAULT_SLOW_CONVERSION=S    rank 0 sleeps S seconds inside the universal-checkpoint conversion
  PIPELINE_FAULT_ONCE=PATH            each fault fires once: PATH is created when one fires, none fires while it exists
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any


def armed(name: str, step: int) -> bool:
    """Whether fault `name` is set for `step` (and, under PIPELINE_FAULT_ONCE, has not fired yet)."""
    value = os.environ.get(f"PIPELINE_FAULT_{name}")
    if not value or int(value) != step:
        return False
    once = os.environ.get("PIPELINE_FAULT_ONCE")
    return not (once and Path(once).exists())


def fired() -> None:
    once = os.environ.get("PIPELINE_FAULT_ONCE")
    if once:
        Path(once).touch()


def kill_self() -> None:
    fired()
    os.kill(os.getpid(), signal.SIGKILL)


def seconds(name: str) -> float:
    """The duration a slowness switch asks for (0 when unset)."""
    return float(os.environ.get(f"PIPELINE_FAULT_{name}") or 0)


class KillAtStep:
    """The loop's part for PIPELINE_FAULT_KILL_AT_STEP: rank 0 SIGKILLs itself once that step is done (and saved,
    if due: it is the last part of the loop)."""

    def __init__(self, rank: int):
        self.rank = rank

    def after_step(self, end: Any) -> None:
        if self.rank == 0 and armed("KILL_AT_STEP", end.state.step):
            kill_self()

    def at_end(self, state: Any) -> None:
        """Nothing to do at the run's end."""
