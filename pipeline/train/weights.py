"""Initial weights: a deterministic init that is identical for every ZeRO stage and world size, and loading
weights from safetensors for continued pretraining, tensor by tensor, also into ZeRO-3 partitioned models."""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch

from pipeline.errors import PipelineError


def init_weights(model: torch.nn.Module, seed: int, rank: int, stage3: bool) -> None:
    """Deterministic init, identical for every ZeRO stage and world size: N(0, 0.02) for matrices, 1 for norms.
    Each tensor draws from its own generator seeded by (seed, index), so the result does not depend on how
    the model was partitioned."""
    import deepspeed

    for i, (_, p) in enumerate(model.named_parameters()):
        ctx = deepspeed.zero.GatheredParameters([p], modifier_rank=0) if stage3 else contextlib.nullcontext()
        with ctx, torch.no_grad():
            if rank == 0 or not stage3:
                g = torch.Generator().manual_seed(seed * 100003 + i)
                if p.dim() >= 2:
                    value = torch.empty(p.shape, dtype=torch.float32).normal_(0.0, 0.02, generator=g)
                else:
                    value = torch.ones(p.shape, dtype=torch.float32)
                p.data.copy_(value.to(p.device, p.dtype))


def load_initial_weights(model: torch.nn.Module, path: str, rank: int, stage3: bool) -> None:
    """Copy weights from a safetensors file or HF model folder, tensor by tensor (no full copy in RAM)."""
    import deepspeed
    from safetensors import safe_open

    src = Path(path)
    files = [src] if src.is_file() else sorted(src.glob("*.safetensors"))
    if not files:
        raise PipelineError(f"model.init_from {path}: no .safetensors file there")
    where = {}
    for f in files:
        with safe_open(str(f), "pt") as sf:
            for k in sf.keys():
                where[k] = f
    params = dict(model.named_parameters())
    missing = sorted(set(params) - set(where))
    if missing:
        raise PipelineError(f"model.init_from {path}: missing {len(missing)} tensors, e.g. {missing[:3]}; "
                            "the checkpoint's shape differs from model.*")
    for name, p in params.items():
        ctx = deepspeed.zero.GatheredParameters([p], modifier_rank=0) if stage3 else contextlib.nullcontext()
        with ctx, torch.no_grad():
            if rank == 0 or not stage3:
                with safe_open(str(where[name]), "pt") as sf:
                    t = sf.get_tensor(name)
                if tuple(t.shape) != tuple(p.shape):
                    raise PipelineError(f"model.init_from {path}: {name} has shape {tuple(t.shape)}, the model "
                                        f"expects {tuple(p.shape)}")
                p.data.copy_(t.to(p.device, p.dtype))
