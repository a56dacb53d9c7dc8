"""Every optimizer `optim.name` can name, one entry each: how it is built (by DeepSpeed from the JSON's optimizer
section, or by us and handed to `deepspeed.initialize`), which ZeRO stages and offloads it takes, whether a run
resumes on another world size (DeepSpeed's universal checkpoint re-partitions its states), and the bytes of state
per parameter the planner counts. The config's choices, the DeepSpeed JSON's checks, the engine, the resume rules
and the planner read this table; a new optimizer is an entry here and its test."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class Optimizer:
    doc: str
    zero_stages: tuple[int, ...]
    """ZeRO stages it runs under."""
    offload: bool
    """Whether its states may live on the CPU or NVMe (offload_optimizer)."""
    any_world_size: bool
    """Whether a checkpoint resumes on another number of ranks (DeepSpeed's universal checkpoint reads the states
    by name: exp_avg, exp_avg_sq)."""
    moment_bytes: float
    """State bytes per parameter besides the fp32 master weights (Adam's m and v in fp32: 8)."""
    ds_types: tuple[str, ...] = ()
    """The DeepSpeed JSON's optimizer.type values it is built from (empty: we build it, `build`)."""
    build: Callable[[list[dict[str, Any]], Any], Any] | None = None
    """(param groups, the config's optim section) -> the optimizer handed to deepspeed.initialize."""

    def problems(self, name: str, stage: int, offload: bool) -> list[str]:
        """Why this optimizer cannot run under ZeRO `stage` (with `offload` of its states)."""
        if stage in self.zero_stages and (self.offload or not offload):
            return []
        return [f"optim.name {name} cannot run with ZeRO-{stage}{' and offload' if offload else ''}: {self.doc}"]


def _adamw8bit(groups: list[dict[str, Any]], o: Any) -> Any:
    import bitsandbytes as bnb

    return bnb.optim.AdamW8bit(groups, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps)


OPTIMIZERS: dict[str, Optimizer] = {
    "adamw": Optimizer(
        "DeepSpeed's AdamW (FusedAdam on a GPU, CPUAdam when offloading): ZeRO 0-3, with or without CPU/NVMe offload",
        zero_stages=(0, 1, 2, 3),
        offload=True,
        any_world_size=True,
        moment_bytes=8.0,
        ds_types=("adamw", "adam"),
    ),
    "adamw8bit": Optimizer(
        "bitsandbytes' AdamW8bit needs its states on the GPU and unsharded parameters: ZeRO 0-2 without offload",
        zero_stages=(0, 1, 2),
        offload=False,
        # DeepSpeed's ds_to_universal reads exp_avg/exp_avg_sq by name; bitsandbytes keeps state1/state2 and
        # blockwise absmax over the flat ZeRO partition, which cannot be re-split per parameter anyway.
        any_world_size=False,
        moment_bytes=2.0 + 2 * 4 / 2048,  # m and v in 8 bits, an fp32 absmax per block of 2048 each
        build=_adamw8bit,
    ),
}
