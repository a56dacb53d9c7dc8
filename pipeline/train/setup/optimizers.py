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
    """The DeepSpeed JSON's optimizer.type values it is built from, in any case (empty: we build it, `build`); the
    first is the type an `auto` optimizer.type becomes."""
    ds_params: Callable[[Any], dict[str, Any]] | None = None
    """The config's optim section -> the DeepSpeed JSON's optimizer.params, each filling an "auto" value."""
    build: Callable[[list[dict[str, Any]], Any], Any] | None = None
    """(param groups, the config's optim section) -> the optimizer handed to deepspeed.initialize."""
    clip_note: str | None = None
    """Why DeepSpeed's gradient clipping stays off for it, whatever optim.grad_clip says (None: it clips)."""
    lr_scale: Callable[[dict[str, Any], Any], float] = lambda group, o: 1.0
    """(one of the built optimizer's param groups, the optim section) -> its learning rate over the schedule's
    (Muon's matrices train at optim.muon_lr, the rest at optim.lr: the schedule scales both)."""

    def problems(self, name: str, stage: int, offload: bool) -> list[str]:
        """Why this optimizer cannot run under ZeRO `stage` (with `offload` of its states)."""
        if stage in self.zero_stages and (self.offload or not offload):
            return []
        return [f"optim.name {name} cannot run with ZeRO-{stage}{' and offload' if offload else ''}: {self.doc}"]


def _adamw_params(o: Any) -> dict[str, Any]:
    return {"lr": o.lr, "betas": [o.beta1, o.beta2], "eps": o.eps, "weight_decay": o.weight_decay}


def _muon_params(o: Any) -> dict[str, Any]:
    # DeepSpeed's MuonWithAuxAdam: muon_lr and momentum for the matrices, adam_lr with betas and eps for the rest
    return {
        "lr": o.lr,
        "muon_lr": o.muon_lr,
        "adam_lr": o.lr,
        "momentum": o.muon_momentum,
        "betas": [o.beta1, o.beta2],
        "eps": o.eps,
        "weight_decay": o.weight_decay,
    }


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
        ds_types=("AdamW", "Adam"),
        ds_params=_adamw_params,
    ),
    "muon": Optimizer(
        "DeepSpeed's Muon (MuonWithAuxAdam: Newton-Schulz orthogonalised momentum for the 2-D hidden weights, AdamW "
        "for the embeddings, norms and output layer): ZeRO 1-3 without offload (with CPU Adam offload it diverged, "
        "DeepSpeed #8463); for runs from scratch",
        zero_stages=(1, 2, 3),
        offload=False,
        # ds_to_universal reads exp_avg/exp_avg_sq by name; Muon's matrices keep a momentum_buffer: not re-split
        any_world_size=False,
        # Muon's fp32 momentum on the matrices, Adam's 8 bytes on the embeddings and head (at most 12% of the
        # parameters of a 1B model, under 1% at 70B): counted at 12%, so that memory is never planned under
        moment_bytes=4.0 + 8.0 * 0.12,
        ds_types=("Muon",),
        ds_params=_muon_params,
        clip_note=(
            "DeepSpeed 0.19.8's ZeRO path replaces each matrix's gradient by Muon's orthogonalised update before it "
            "takes the norm, so clipping would scale the step by the norm of the updates (measured 78.8 at step 1 of "
            "a 3.4M Llama whose gradient norm there is 2.80 under AdamW): optim.grad_clip is not applied, and the "
            "logged gnorm is that of the updates"
        ),
        lr_scale=lambda group, o: o.muon_lr / o.lr if group.get("use_muon") else 1.0,
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
