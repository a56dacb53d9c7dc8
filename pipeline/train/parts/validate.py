"""Validation during training: the mean token loss over the first `eval.batches` micro-batches per rank of the
val split, in a fixed order, every `eval.interval` steps and at the last; on a blend, each source's too."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from pipeline.data.loader import ShardedDataset, collate_samples, rank_batches
from pipeline.train.parts.metrics import MetricsSink
from pipeline.train.step import forward_token_losses, reduce_token_losses

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
        val_loss, by_source = validate(engine, self.val_data, self.run, self.progress)
        if self.run.dist.rank == 0:
            each = "".join(f" | {name} {loss:.4f}" for name, loss in by_source.items())
            log.info(
                "step %d | val loss %.4f | val ppl %.2f%s", state.step, val_loss, math.exp(min(val_loss, 50)), each
            )
        self.sink.emit(
            {"step": state.step, "val_loss": val_loss, **{f"val_loss/{name}": v for name, v in by_source.items()}}
        )


@torch.no_grad()
def validate(
    engine: Any, val_data: ShardedDataset, run: Run, progress: Callable[[], None] | None = None
) -> tuple[float, dict[str, float]]:
    """Mean token loss over the first `eval.batches` micro-batches per rank of the val split (fixed order), and
    each source's over its samples among them where the val split holds several (not under a fused loss, which
    returns only a sum: then {})."""
    import deepspeed.comm as dist

    device, plan = run.dist.device, run.plan
    engine.eval()
    names = val_data.source_names if len(val_data) and val_data.sources_of([0]) is not None else []
    names = names if len(names) > 1 else []
    totals = torch.zeros(2 + 2 * len(names), dtype=torch.float64)
    fused = False
    # a sequence-parallel group reads one replica's batches and each of its ranks forwards its share of the tokens
    it = rank_batches(len(val_data), run.cfg.train.seed, plan.micro_batch_size, plan.data_parallel_size, run.replica, 0)
    for _ in range(run.cfg.eval.batches):
        ids = next(it)
        per_token, labels, _ = forward_token_losses(engine, collate_samples(val_data, ids), device, run.sequence)
        _, total, count = reduce_token_losses(per_token, labels)  # the sum in a fixed order: resumes log alike
        totals[0] += float(total)
        totals[1] += count
        losses = per_token.detach().double().cpu()
        fused = fused or losses.dim() == 0
        if names and not fused:
            rows = losses.reshape(labels.shape).sum(dim=1)
            counts = (labels != -100).sum(dim=1).double()
            of = torch.as_tensor(val_data.sources_of(ids))
            totals[2::2].index_add_(0, of, rows)
            totals[3::2].index_add_(0, of, counts)
        if progress is not None:
            progress()
    totals = totals.to(device)
    dist.all_reduce(totals)
    engine.train()
    totals = totals.cpu()
    mean = float(totals[0] / totals[1].clamp(min=1))
    if fused or not names:
        return mean, {}
    return mean, {n: float(totals[2 + 2 * k] / totals[3 + 2 * k].clamp(min=1)) for k, n in enumerate(names)}
