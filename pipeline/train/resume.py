"""The resume decision as pure functions: which checkpoint a launch continues from, and why it may not."""

from __future__ import annotations

from typing import Any

from pipeline.errors import PipelineError
from pipeline.train.checkpoint import Marker


def choose_resume(policy: str, complete_tags: list[str], run_dir: str) -> str | None:
    """The tag to resume from under `checkpoint.resume` (auto | never | a tag), given the run folder's complete
    checkpoints (oldest first); None starts fresh."""
    if policy == "auto":
        return complete_tags[-1] if complete_tags else None
    if policy == "never":
        if complete_tags:
            raise PipelineError(
                f"{run_dir} holds checkpoints but checkpoint.resume is never; use another run_dir or resume: auto"
            )
        return None
    if policy not in complete_tags:
        raise PipelineError(f"checkpoint.resume {policy}: no complete checkpoint of that tag in {run_dir}")
    return policy


def resume_problems(
    marker: Marker,
    *,
    data_fingerprint: str,
    model_shape: dict[str, Any],
    world_size: int,
    zero_stage: int,
    nvme_optimizer: bool = False,
    optimizer: str = "adamw",
) -> list[str]:
    """Why this launch cannot continue the checkpoint described by `marker` (empty: it can)."""
    problems = []
    if nvme_optimizer:
        # Measured (tests/multiproc/test_pretrain.py): DeepSpeed 0.19.8 saves the NVMe swap files into the
        # checkpoint and copies them back on load, yet the resumed run trains on freshly initialised weights (its
        # loss returns to the first step's). Refuse rather than restart silently.
        problems.append(
            "the DeepSpeed config offloads the optimizer to NVMe, and DeepSpeed 0.19 resumes such "
            "checkpoints with freshly initialised weights instead of the saved ones; resuming is "
            "refused until that is fixed upstream (start a new run_dir, or train with "
            "ds_configs/zero3_offload.json, whose checkpoints resume exactly)"
        )
    if marker["data_fingerprint"] != data_fingerprint:
        problems.append(
            f"data fingerprint {data_fingerprint} differs from the checkpoint's "
            f"{marker['data_fingerprint']} (other shards, seq_len or seed)"
        )
    if marker["model_shape"] != model_shape:
        problems.append(f"model shape {model_shape} differs from the checkpoint's {marker['model_shape']}")
    if marker["world_size"] != world_size and nvme_optimizer:
        problems.append(
            f"world size {world_size} differs from the checkpoint's {marker['world_size']} and the "
            "optimizer is on NVMe; DeepSpeed's universal checkpoint does not cover NVMe swap files"
        )
    if marker["world_size"] != world_size and optimizer == "adamw8bit" and zero_stage > 0:
        # DeepSpeed's ds_to_universal reads exp_avg/exp_avg_sq by name; bitsandbytes keeps state1/state2 and
        # blockwise absmax over the flat ZeRO partition, which cannot be re-split per parameter anyway.
        problems.append(
            f"world size {world_size} differs from the checkpoint's {marker['world_size']} and optim.name is "
            "adamw8bit: DeepSpeed's universal checkpoint cannot re-partition bitsandbytes' 8-bit states. Resume "
            f"on {marker['world_size']} ranks, or export the weights (pipeline export) and start a new run_dir "
            "from them with model.init_from (the optimizer states start afresh)"
        )
    return problems
