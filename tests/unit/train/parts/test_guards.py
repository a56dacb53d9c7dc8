"""pipeline.train.parts.guards: what a skipped update or a non-finite loss does to the run."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from pipeline.errors import PipelineError
from pipeline.train.parts.guards import NonFinite
from pipeline.train.setup.config import from_dict
from pipeline.train.setup.ds_config import batch_plan
from pipeline.train.state import TrainState


def _guard(precision: str, policy: str = "stop") -> NonFinite:
    cfg = from_dict(
        {
            "batch": {"micro_batch_size": 2, "global_batch_size": 4},
            "train": {"max_steps": 10, "precision": precision, "on_nonfinite": policy},
        }
    )
    return NonFinite(cfg, batch_plan(cfg, 2, 64), rank=0, train_samples=100)


def test_fp16_loss_scale_overflows_with_a_finite_loss_neither_stop_nor_count(tmp_path: Path) -> None:
    guard = _guard("fp16")
    for step, skipped in enumerate([1, 2, 2, 3, 4, 5, 6], start=1):  # overflow after overflow, as calibration does
        guard.check(3.2, skipped, TrainState(step, 4 * step), tmp_path)
    assert guard.overflows == 6 and guard.total == 0 and guard.in_a_row == 0
    with pytest.raises(PipelineError, match="step 8: loss nan"):  # a non-finite loss still stops an fp16 run
        guard.check(math.nan, 7, TrainState(8, 32), tmp_path)


def test_a_skipped_bf16_update_is_a_non_finite_gradient_and_stops(tmp_path: Path) -> None:
    guard = _guard("bf16")
    guard.check(3.2, 0, TrainState(1, 4), tmp_path)
    with pytest.raises(PipelineError, match="step 2: a non-finite gradient norm .*DeepSpeed did not apply"):
        guard.check(3.2, 1, TrainState(2, 8), tmp_path)


def test_skip_policy_counts_and_stops_after_too_many_in_a_row(tmp_path: Path) -> None:
    guard = _guard("bf16", "skip")
    for step in range(1, 4):
        guard.check(3.2, step, TrainState(step, 4 * step), tmp_path)
    assert guard.total == 3
    with pytest.raises(PipelineError, match="4 in a row > train.max_nonfinite_in_a_row"):
        guard.check(3.2, 4, TrainState(4, 16), tmp_path)


def test_a_non_finite_step_right_after_a_resume_names_the_checkpoint_too(tmp_path: Path) -> None:
    """A damaged optimizer-state file gives the same symptom as bad data: right after a resume the error says
    so, later it does not."""
    guard = _guard("bf16")
    guard.resumed_at = 90
    with pytest.raises(PipelineError, match="resumed at step 90, 2 step.s. ago: a damaged checkpoint") as e:
        guard.check(math.nan, 0, TrainState(92, 368, resumed=True), tmp_path)
    assert "checkpoint.verify: true" in str(e.value) and "lower optim.lr" in str(e.value)
    with pytest.raises(PipelineError) as later:
        guard.check(math.nan, 0, TrainState(120, 480, resumed=True), tmp_path)
    assert "resumed at step" not in str(later.value)
