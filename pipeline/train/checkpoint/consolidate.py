"""Full-precision weights of a saved checkpoint by name, read tensor by tensor: what evaluation and export load.
Any ZeRO stage (0-3, offload or not); a caller holds one tensor at a time, never the whole model."""

from __future__ import annotations

import contextlib
import io
from pathlib import Path
from typing import Any

from pipeline.errors import PipelineError


def consolidated_state(run_dir: Path, tag: str, tied: frozenset[str] = frozenset()) -> dict[str, Any]:
    """Full-precision weights of any ZeRO stage (0-3, offload or not) by name, each read when asked for
    (`materialize`), so that a caller holds one tensor at a time, not the model. `tied`: names that only repeat
    another tensor (a tied output head, `ModelShape.tied_names`), left out.

    ZeRO 1-3: DeepSpeed's own zero_to_fp32 reconstruction in lazy mode over mmap'd shards. ZeRO-0: the module
    state in mp_rank_00_model_states.pt (mmap)."""
    import torch

    ckpt_dir = Path(run_dir) / tag
    if list(ckpt_dir.glob("*_optim_states.pt")) and _zero_stage_of(ckpt_dir) > 0:
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        with contextlib.redirect_stdout(io.StringIO()):
            state = dict(get_fp32_state_dict_from_zero_checkpoint(str(run_dir), tag=tag, lazy_mode=True))
    else:
        files = sorted(ckpt_dir.glob("mp_rank_*_model_states.pt"))
        if not files:
            raise PipelineError(f"{ckpt_dir}: no DeepSpeed model states (mp_rank_00_model_states.pt)")
        state = dict(torch.load(files[0], map_location="cpu", mmap=True, weights_only=False)["module"])
    return {k: v for k, v in state.items() if k not in tied}


class Mean:
    """One weight averaged over several checkpoints, read when asked for (`materialize`): the checkpoints'
    tensors are loaded and summed one at a time in fp32, so averaging holds this tensor N+1 times at most, never a
    model."""

    def __init__(self, parts: list[Any]):
        self.parts = parts

    @property
    def shape(self) -> Any:
        return self.parts[0].shape

    def value(self) -> Any:
        total = materialize(self.parts[0]).clone()
        for part in self.parts[1:]:
            total += materialize(part)
        return total / len(self.parts)


def averaged_state(run_dir: Path, tags: list[str], tied: frozenset[str] = frozenset()) -> dict[str, Any]:
    """`consolidated_state` of the mean of checkpoints `tags` of one run (checkpoint averaging): each weight the
    fp32 mean of the checkpoints' full-precision weights, computed when asked for."""
    states = [consolidated_state(run_dir, tag, tied) for tag in tags]
    first = states[0]
    for tag, state in zip(tags[1:], states[1:], strict=True):
        differ = sorted(set(first) ^ set(state)) or [n for n in first if tuple(first[n].shape) != tuple(state[n].shape)]
        if differ:
            raise PipelineError(
                f"cannot average {run_dir}/{tags[0]} with {tag}: weights {', '.join(differ[:3])} differ in name or "
                "shape (checkpoints of one model only)"
            )
    return {name: Mean([state[name] for state in states]) for name in first}


def materialize(value: Any) -> Any:
    """One entry of `consolidated_state` or `averaged_state` as an fp32 tensor in RAM."""
    if isinstance(value, Mean):
        return value.value()
    return value.contiguous().float()


def _zero_stage_of(ckpt_dir: Path) -> int:
    import torch

    f = next(ckpt_dir.glob("*_optim_states.pt"))
    sd = torch.load(f, map_location="cpu", mmap=True, weights_only=False)
    return int(sd.get("optimizer_state_dict", {}).get("zero_stage", 0))
