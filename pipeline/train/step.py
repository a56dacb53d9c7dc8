"""One optimizer step: the loss over real tokens and the micro-steps of gradient accumulation."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Cross-entropy over real tokens only (labels -100 are padding); logits (B, T, V), labels (B, T).

    Returns (mean loss to backpropagate, the summed loss as a float64 tensor on the logits' device, token count).
    The sum is taken in float64 in a fixed order: a vectorised float32 sum can round differently with the
    buffer's memory alignment, which would make a resumed run's logged loss differ from the uninterrupted one by
    an ulp. Nothing here waits for the device: the count comes from `labels` (pass the host copy)."""
    labels_dev = labels.to(logits.device, non_blocking=True)
    per_token = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), labels_dev.reshape(-1),
                                ignore_index=-100, reduction="none")  # (B*T,), 0 where ignored
    count = int((labels != -100).sum()) if labels.device.type == "cpu" else int((labels_dev != -100).sum())
    total = per_token.detach().double().cumsum(0)[-1] if per_token.numel() else per_token.new_zeros((), dtype=torch.float64)
    return per_token.sum() / max(count, 1), total, count


def train_step(engine: Any, batches: Iterator[dict[str, torch.Tensor]], grad_accum: int, lr: float,
               device: torch.device) -> torch.Tensor:
    """Set the learning rate, run `grad_accum` micro-steps (forward, backward, DeepSpeed's step, which applies
    the update at the accumulation boundary) and return the mean per-token loss as a float64 device tensor."""
    for group in engine.optimizer.param_groups:
        group["lr"] = lr
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    for _ in range(grad_accum):
        batch = next(batches)
        logits = engine(input_ids=batch["input_ids"].to(device, non_blocking=True)).logits
        loss, total, tokens = lm_loss(logits, batch["labels"])
        engine.backward(loss)
        engine.step()
        loss_sum += total / max(tokens, 1)
    return loss_sum / grad_accum
