"""A configuration as DeepSpeed JSON and back: `plan --write-ds-config` writes the chosen one, and `plan --config`
or a run reads what a DeepSpeed JSON describes into a Layout to price it."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from pipeline.atomic import write_json
from pipeline.plan.cluster import (
    ZENFLOW_TOPK,
    Layout,
    offload_devices,
)

if TYPE_CHECKING:  # the trainer reads a run's Layout through this module at every rank's start: no planner there
    from pipeline.plan.estimate import Estimate


def layout_from_ds(
    ds: dict[str, Any],
    micro_batch_size: int,
    grad_accum: int,
    activation_checkpointing: bool,
    moment_bytes: float = 8.0,
    sequence_parallel: int = 1,
    tiled_mlp: int = 0,
) -> Layout:
    """The configuration a DeepSpeed JSON describes; fields it leaves out (or "auto") take DeepSpeed's defaults.
    `moment_bytes`: the optimizer's (pipeline.train.setup.optimizers), which the JSON does not say;
    `sequence_parallel`: the config's train.sequence_parallel (the JSON's sequence_parallel_size when it says);
    `tiled_mlp`: the config's train.tiled_mlp (the JSON has no field for it)."""
    zero = ds.get("zero_optimization") or {}

    def num(key: str, default: float) -> float:
        v = zero.get(key, default)
        return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else default

    offload = offload_devices(ds)
    stage = zero.get("stage", 0)
    zenflow = zero.get("zenflow") or {}
    interval = zenflow.get("update_interval", 0) if isinstance(zenflow, dict) else 0
    return Layout(
        int(stage) if isinstance(stage, int) else 0,
        offload.optimizer,
        offload.param,
        activation_checkpointing,
        micro_batch_size,
        grad_accum,
        num("reduce_bucket_size", 5e8),
        num("stage3_prefetch_bucket_size", 5e7),
        num("stage3_max_live_parameters", 1e9),
        num("sub_group_size", 1e9),
        num("stage3_max_reuse_distance", 1e9),
        (ds.get("data_types") or {}).get("grad_accum_dtype"),
        bf16_master=(ds.get("bf16") or {}).get("bf16_master_weights_and_grads") is True,
        bf16_optimizer_states=(ds.get("bf16") or {}).get("bf16_optimizer_states") is True,
        pin_memory=all(
            (zero.get(k) or {}).get("pin_memory", True) is not False for k in ("offload_param", "offload_optimizer")
        ),
        offload_activations=(ds.get("activation_checkpointing") or {}).get("cpu_checkpointing") is True,
        moment_bytes=moment_bytes,
        sequence_parallel=sp if isinstance(sp := ds.get("sequence_parallel_size"), int) else sequence_parallel,
        zenflow_interval=(interval if isinstance(interval, int) else grad_accum) if zenflow else 0,
        tiled_mlp=tiled_mlp,
    )


def ds_config(e: Estimate | Layout, nvme_path: str = "/local_nvme") -> dict[str, Any]:
    """A DeepSpeed JSON for the chosen configuration; batch and precision fields stay "auto" for pretrain."""
    cand = e if isinstance(e, Layout) else e.layout
    zero: dict[str, Any] = {
        "stage": cand.stage,
        "overlap_comm": True,
        "contiguous_gradients": True,
        "reduce_bucket_size": cand.reduce_bucket,
    }
    if cand.stage == 3:
        zero.update(
            {
                "stage3_prefetch_bucket_size": cand.prefetch_bucket,
                "stage3_max_live_parameters": cand.max_live,
                "stage3_max_reuse_distance": cand.max_reuse or cand.max_live,
                "stage3_param_persistence_threshold": 1e5,
                "sub_group_size": cand.sub_group,
                "stage3_gather_16bit_weights_on_model_save": False,
            }
        )
    for key, dev in (("offload_optimizer", cand.offload_optimizer), ("offload_param", cand.offload_param)):
        if dev != "none":
            zero[key] = {"device": dev, "pin_memory": True}
            if dev == "nvme":
                zero[key]["nvme_path"] = nvme_path
    if cand.zenflow_interval:
        zero["zenflow"] = {
            "topk_ratio": ZENFLOW_TOPK,
            "select_strategy": "step",
            "select_interval": cand.zenflow_interval,
            "update_interval": cand.zenflow_interval,
            "overlap_step": True,
            "full_warm_up_rounds": 0,
        }
    ds: dict[str, Any] = {
        "train_batch_size": "auto",
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "bf16": {"enabled": "auto"}
        | ({"bf16_master_weights_and_grads": True} if cand.bf16_master else {})
        | ({"bf16_optimizer_states": True} if cand.bf16_optimizer_states else {}),
        "fp16": {"enabled": "auto", "loss_scale": 0},
        "optimizer": {
            "type": "auto",  # the optimizer table writes it (pipeline.train.setup.ds_config)
            "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"},
        },
        "zero_optimization": zero,
        "steps_per_print": 10**9,
    }
    if cand.offload_activations:
        ds["activation_checkpointing"] = {"cpu_checkpointing": True}
    if cand.sequence_parallel > 1:  # with train.sequence_parallel set to the same (the trainer checks)
        ds["sequence_parallel_size"] = cand.sequence_parallel
    if "nvme" in (cand.offload_optimizer, cand.offload_param):
        ds["aio"] = {
            "block_size": 1048576,
            "queue_depth": 8,
            "thread_count": 1,
            "single_submit": False,
            "overlap_events": True,
        }
    return ds


def write_ds_config(e: Estimate, path: str, nvme: str | None = None) -> None:
    """`plan --write-ds-config`: the chosen configuration's DeepSpeed JSON, with `nvme` as the swap folder when it
    is one (else /local_nvme, to be edited)."""

    write_json(path, ds_config(e, nvme if nvme and os.path.isdir(nvme) else "/local_nvme"))
