"""Initial weights: a deterministic init that is identical for every ZeRO stage and world size, and loading
weights from safetensors for continued pretraining, also into ZeRO-3 partitioned models. Both go through
`fill_parameters`, which gathers ZeRO-3 parameters in groups (one collective round per group, not per tensor)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from pipeline.errors import PipelineError

GROUP_NUMEL = 2**28
"""Elements gathered at once under ZeRO-3 while filling (512 MiB in bf16): whole layers of models up to ~13B, one
matrix at a time beyond."""


def full_shape(p: torch.nn.Parameter) -> tuple[int, ...]:
    """A parameter's real shape; under ZeRO-3 its own shape is empty and `ds_shape` keeps the real one."""
    return tuple(getattr(p, "ds_shape", p.shape))


def parameter_groups(
    named: list[tuple[str, torch.nn.Parameter]], max_numel: int
) -> Iterator[list[tuple[str, torch.nn.Parameter]]]:
    """Consecutive parameters in groups of at most `max_numel` elements (a larger tensor forms its own group)."""
    group: list[tuple[str, torch.nn.Parameter]] = []
    size = 0
    for name, p in named:
        n = int(torch.Size(full_shape(p)).numel())
        if group and size + n > max_numel:
            yield group
            group, size = [], 0
        group.append((name, p))
        size += n
    if group:
        yield group


def fill_parameters(
    model: torch.nn.Module,
    value: Callable[[int, str, tuple[int, ...]], torch.Tensor] | None,
    *,
    stage3: bool,
    max_group_numel: int = GROUP_NUMEL,
) -> None:
    """Set every parameter to `value(index, name, shape)`. Under ZeRO-3 every rank must call this (the groups are
    gathered collectively), but only rank 0 passes `value` (None elsewhere): its tensors are broadcast and
    re-partitioned when each group is released. Without ZeRO-3 every rank passes `value`. `value` must not raise
    under ZeRO-3 (the other ranks would wait in the gather): check shapes and names before."""
    import deepspeed

    named = list(model.named_parameters())
    index = {name: i for i, (name, _) in enumerate(named)}
    for group in parameter_groups(named, max_group_numel):
        params = [p for _, p in group]
        ctx = deepspeed.zero.GatheredParameters(params, modifier_rank=0) if stage3 else contextlib.nullcontext()
        with ctx, torch.no_grad():
            if value is not None:
                for name, p in group:
                    p.data.copy_(value(index[name], name, tuple(p.shape)).to(p.device, p.dtype))


def init_weights(
    model: torch.nn.Module, seed: int, rank: int, stage3: bool, device: torch.device | None = None
) -> None:
    """Deterministic init, identical for every ZeRO stage and world size: N(0, 0.02) for matrices, 1 for norms.
    Each tensor draws from its own generator seeded by (seed, index), so the result does not depend on how
    the model was partitioned. On a GPU `device` the values are drawn there: a one-thread CPU generator takes
    about 10 minutes for 70B while every rank waits (the values differ from the CPU's, the same on every GPU)."""
    device = device or torch.device("cpu")

    def value(i: int, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        if len(shape) >= 2:
            g = torch.Generator(device=device).manual_seed(seed * 100003 + i)
            return torch.empty(shape, dtype=torch.float32, device=device).normal_(0.0, 0.02, generator=g)
        return torch.ones(shape, dtype=torch.float32, device=device)

    fill_parameters(model, value if rank == 0 or not stage3 else None, stage3=stage3)


def weight_mismatch(
    expected: dict[str, tuple[int, ...]], given: dict[str, tuple[int, ...]], where: str, *, extra_ok: bool = False
) -> str | None:
    """Why tensors named and shaped `given` cannot fill a model whose parameters are `expected` (None: they can).
    Checked before any collective gather: a raise inside one would leave the other ranks waiting. `extra_ok`: more
    tensors than parameters is fine (a Hugging Face folder may carry buffers we do not keep)."""
    if not extra_ok and (unexpected := sorted(set(given) - set(expected))):
        return (
            f"{where}: {len(unexpected)} unexpected tensors, e.g. {unexpected[:3]}; the model differs from its "
            "recorded shape"
        )
    if missing := sorted(set(expected) - set(given)):
        return (
            f"{where}: missing {len(missing)} tensors, e.g. {missing[:3]}; the checkpoint's shape differs from model.*"
        )
    for name, shape in expected.items():
        if tuple(given[name]) != shape:
            return f"{where}: {name} has shape {tuple(given[name])}, the model expects {shape}"
    return None


def parameter_shapes(model: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    return {name: full_shape(p) for name, p in model.named_parameters()}


def load_initial_weights(model: torch.nn.Module, path: str, rank: int, stage3: bool) -> None:
    """Copy weights from a safetensors file or HF model folder, tensor by tensor (no full copy in RAM). Names and
    shapes are checked on every rank from the files' headers before any gather."""
    from safetensors import safe_open

    src = Path(path)
    files = [src] if src.is_file() else sorted(src.glob("*.safetensors"))
    if not files:
        raise PipelineError(f"model.init_from {path}: no .safetensors file there")
    where: dict[str, Path] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    for f in files:
        with safe_open(str(f), "pt") as sf:
            for k in sf.keys():
                where[k] = f
                shapes[k] = tuple(sf.get_slice(k).get_shape())
    if problem := weight_mismatch(parameter_shapes(model), shapes, f"model.init_from {path}", extra_ok=True):
        raise PipelineError(problem)

    def value(i: int, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        with safe_open(str(where[name]), "pt") as sf:
            return sf.get_tensor(name)

    fill_parameters(model, value if rank == 0 or not stage3 else None, stage3=stage3)
