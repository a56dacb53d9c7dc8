"""Validation during training: the mean token loss over the first `eval.batches` micro-batches per rank of the
val split, in a fixed order, every `eval.interval` steps and at the last."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from pipeline.data.loader import ShardedDataset, collate_samples, rank_batches
from pipeline.train.parts.metrics import MetricsSink
from pipeline.train.step import micro_step_loss

if TYPE_CHECKING:
    from pipeline.train.setup.prepare import Run
    from pipeline.train.state import StepEnd, TrainState

log = logging.getLogger(__name__)


class Validator:
    """Runs the validation pass when it is due; off when the shards have no val split or `eval.batches` is 0."""

    def __init__(
        self,
        run: Run,
        val_data: ShardedDataset | None,
        sink: MetricsSink,
        max_steps: int,
        progress: Callable[[], None] | None = None,
    ):
        self.run, self.val_data, self.sink, self.max_steps, self.progress = run, val_data, sink, max_steps, progress

    def after_step(self, end: StepEnd) -> None:
        self.maybe_run(end.engine, end.state)

    def at_end(self, state: TrainState) -> None:
        """Nothing to do at the run's end."""

    def maybe_run(self, engine: Any, state: TrainState) -> None:
        cfg = self.run.cfg.eval
        if self.val_data is None or not cfg.batches:
            return
        if state.step % cfg.interval and state.step != self.max_steps:
            return
        val_loss = validate(engine, self.val_data, self.run, self.progress)
        if self.run.dist.rank == 0:
            log.info("step %d | val loss %.4f | val ppl %.2f", state.step, val_loss, math.exp(min(val_loss, 50)))
        self.sink.emit({"step": state.step, "val_loss": val_loss})


@torch.no_grad()
def validate(engine: Any, val_data: ShardedDataset, run: Run, progress: Callable[[], None] | None = None) -> float:
    """Mean token loss over the first `eval.batches` micro-batches per rank of the val split (fixed order)."""
    import deepspeed.comm as dist

    device, plan = run.dist.device, run.plan
    engine.eval()
    totals = torch.zeros(2, dtype=torch.float64, device=device)
    # a sequence-parallel group reads one replica's batches and each of its ranks forwards its share of the tokens
    it = rank_batches(len(val_data), run.cfg.train.seed, plan.micro_batch_size, plan.data_parallel_size, run.replica, 0)
    for _ in range(run.cfg.eval.batches):
        _, loss_total, tokens, _ = micro_step_loss(engine, collate_samples(val_data, next(it)), device, run.sequence)
        totals[0] += loss_total
        totals[1] += tokens
        if progress is not None:
            progress()
    dist.all_reduce(totals)
    engine.train()
    return float(totals[0] / totals[1].clamp(min=1))
