"""One optimizer step: the loss over real tokens and the micro-steps of gradient accumulation."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from pipeline.model import token_losses
from pipeline.train import faults
from pipeline.train.runtime.sequence import SequenceShard


def reduce_token_losses(
    per_token: torch.Tensor, labels: torch.Tensor, sample_tokens: int | None = None
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Per-token losses (0 where labels are -100) -> (mean loss to backpropagate, the summed loss as a float64
    tensor on the losses' device, token count). `sample_tokens`: the token count of the whole micro-batch when
    these are one sequence-parallel rank's share of it (pipeline.train.runtime.sequence); the loss to
    backpropagate is then this share's sum over that count, so the group's losses add up to the micro-batch's mean.

    The sum is taken in float64 in a fixed order: a vectorised float32 sum can round differently with the
    buffer's memory alignment, which would make a resumed run's logged loss differ from the uninterrupted one by
    an ulp. Nothing here waits for the device when `labels` is the host copy: the count comes from it. A 0-dim
    `per_token` is a fused loss's sum already (pipeline.model.kernels)."""
    count = int((labels != -100).sum())
    over = max(count if sample_tokens is None else sample_tokens, 1)
    if per_token.dim() == 0:
        return per_token / over, per_token.detach().double(), count
    total = (
        per_token.detach().double().cumsum(0)[-1] if per_token.numel() else per_token.new_zeros((), dtype=torch.float64)
    )
    return per_token.sum() / over, total, count


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The same reduction from full logits (B, T, V) and labels (B, T): the plain computation, for references."""
    per_token = token_losses(logits.reshape(-1, logits.size(-1)), labels.to(logits.device).reshape(-1))
    return reduce_token_losses(per_token, labels)


def micro_step_loss(
    engine: Any, batch: dict[str, torch.Tensor], device: torch.device, sequence: SequenceShard | None = None
) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """Forward one micro-batch through the engine with the model's chunked loss (no full logits): (the loss to
    backpropagate, this rank's summed token loss, its token count, the micro-batch's token count). Under sequence
    parallelism this rank forwards its share of the tokens (`sequence`), and the counts differ."""
    per_token, labels, sample_tokens = forward_token_losses(engine, batch, device, sequence)
    return (*reduce_token_losses(per_token, labels, sample_tokens), sample_tokens)


def forward_token_losses(
    engine: Any, batch: dict[str, torch.Tensor], device: torch.device, sequence: SequenceShard | None = None
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Forward one micro-batch (this rank's share of its tokens under sequence parallelism): (the per-token
    losses, 0 where labels are -100, or a fused loss's 0-dim sum; the labels they are over, on the host; the
    micro-batch's token count)."""
    sample_tokens = int((batch["labels"] != -100).sum())
    mine = sequence.shard(batch) if sequence is not None else batch
    labels = mine["labels"]
    extra = {"position_ids": mine["position_ids"].to(device, non_blocking=True)} if "position_ids" in mine else {}
    per_token = engine(
        input_ids=mine["input_ids"].to(device, non_blocking=True),
        loss_labels=labels.to(device, non_blocking=True),
        **extra,
    )
    return per_token, labels, sample_tokens


def train_step(
    engine: Any,
    batches: Iterator[dict[str, torch.Tensor]],
    grad_accum: int,
    lr: float,
    device: torch.device,
    poison: bool = False,
    progress: Callable[[], None] | None = None,
    timings: dict[str, float] | None = None,
    around: Any | None = None,
    sequence: SequenceShard | None = None,
    backward_scale: float = 1.0,
) -> torch.Tensor:
    """Set the learning rate (each param group's `lr_scale` of it), run `grad_accum` micro-steps (forward,
    backward, DeepSpeed's step, which applies the update at the accumulation boundary) and return the mean per-token
    loss as a float64 device tensor.
    `poison` (tests only, pipeline.train.faults) makes the first micro-step's loss NaN. `timings` gets
    "optimizer_s": the boundary's engine.step from a synchronised start to a synchronised end (the optimizer, CPU
    Adam under offload, and what it waits for), which `pipeline plan --from-run` calibrates on. `around`: a context
    each micro-step's forward and backward run in (activation offload, pipeline.train.engine). `sequence`: this
    rank's share of each sample under sequence parallelism; the loss returned is then this rank's share of the
    mean, which the group's ranks add up. `backward_scale` multiplies the loss backpropagated (not the one returned):
    pipeline.train.runtime.ds_workarounds.sequence_parallel_loss_factor says why."""
    for group in engine.optimizer.param_groups:
        group["lr"] = lr * group.get("lr_scale", 1.0)  # Muon's matrices at muon_lr's share (engine.build_engine)
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    slow = faults.seconds("SLOW_MICRO_STEP")
    for i in range(grad_accum):
        if slow:
            time.sleep(slow)
        with around if around is not None else contextlib.nullcontext():
            loss, total, _, tokens = micro_step_loss(engine, next(batches), device, sequence)
            if poison and i == 0:
                loss, total = loss * float("nan"), total * float("nan")
            engine.backward(loss * backward_scale if backward_scale != 1.0 else loss)
        if timings is not None and i == grad_accum - 1:
            synchronize(device)
            t0, c0 = time.perf_counter(), time.process_time()
            engine.step()
            synchronize(device)
            timings["optimizer_s"] = time.perf_counter() - t0
            if device.type == "cpu":  # CPU seconds: what another job on the machine does not inflate
                timings["optimizer_cpu_s"] = time.process_time() - c0
        else:
            engine.step()
        loss_sum += total / max(tokens, 1)
        if progress is not None:
            progress()  # a long step of many micro-steps is progress, not a hang (the watchdog)
    return loss_sum / grad_accum


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (a no-op on the CPU, whose ops are synchronous)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
