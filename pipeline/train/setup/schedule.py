"""Pure arithmetic of a run's length and learning rate."""

from __future__ import annotations

import math

from pipeline.train.setup.config import PretrainConfig
from pipeline.train.setup.ds_config import BatchPlan


def lr_at(step: int, cfg: PretrainConfig, max_steps: int) -> float:
    """Linear warmup over `warmup_steps`, then cosine decay to `min_lr` over `decay_steps` (default: the rest of
    the run), then `min_lr`. `step` is the 0-based index of the update being applied."""
    o = cfg.optim
    if step < o.warmup_steps:
        return o.lr * (step + 1) / o.warmup_steps
    decay = o.decay_steps if o.decay_steps is not None else max(1, max_steps - o.warmup_steps)
    progress = min(1.0, (step - o.warmup_steps) / max(1, decay))
    return o.min_lr + 0.5 * (o.lr - o.min_lr) * (1 + math.cos(math.pi * progress))


def max_steps_for(cfg: PretrainConfig, plan: BatchPlan) -> int:
    if cfg.train.max_steps is not None:
        return cfg.train.max_steps
    assert cfg.train.max_tokens is not None
    return math.ceil(cfg.train.max_tokens / plan.tokens_per_step)
