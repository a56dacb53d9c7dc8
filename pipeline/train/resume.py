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
    seq_len: int | None = None,
) -> list[str]:
    """Why this launch cannot continue the checkpoint described by `marker` (empty: it can), each naming the
    field and both values."""
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
    if seq_len is not None and "seq_len" in marker and marker["seq_len"] != seq_len:
        problems.append(f"seq_len {seq_len} (the shards of data.path) vs the checkpoint's {marker['seq_len']}")
    elif marker["data_fingerprint"] != data_fingerprint:
        problems.append(
            f"data.path holds other shards than the checkpoint was trained on (fingerprint {data_fingerprint[:12]} "
            f"vs {marker['data_fingerprint'][:12]}: other inputs, blend, split or shard seed)"
        )
    if marker["model_shape"] != model_shape:
        theirs = marker["model_shape"]
        diff = [
            f"{k} {model_shape.get(k)} vs the checkpoint's {theirs.get(k)}"
            for k in model_shape
            if model_shape.get(k) != theirs.get(k)
        ]
        diff += [f"{k}: the checkpoint's {theirs[k]}, not in this model" for k in theirs if k not in model_shape]
        problems.append("model " + ", ".join(diff))
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
