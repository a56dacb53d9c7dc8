"""Batch arithmetic and DeepSpeed JSON resolution: pure functions, checked before any process group starts."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.errors import ConfigError
from pipeline.train.config import PretrainConfig


@dataclass(frozen=True, slots=True)
class BatchPlan:
    micro_batch_size: int
    data_parallel_size: int
    grad_accum: int
    global_batch_size: int
    seq_len: int

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch_size * self.seq_len


def batch_plan(cfg: PretrainConfig, world_size: int, seq_len: int) -> BatchPlan:
    b = cfg.batch
    if b.global_batch_tokens is not None:
        if b.global_batch_tokens % seq_len:
            raise ConfigError([f"batch.global_batch_tokens {b.global_batch_tokens} is not a multiple of seq_len "
                               f"{seq_len}; use {max(1, round(b.global_batch_tokens / seq_len)) * seq_len}"])
        global_batch = b.global_batch_tokens // seq_len
    else:
        assert b.global_batch_size is not None
        global_batch = b.global_batch_size
    per_step = b.micro_batch_size * world_size
    if global_batch % per_step:
        lo, hi = (global_batch // per_step) * per_step, math.ceil(global_batch / per_step) * per_step
        raise ConfigError([f"batch: global batch {global_batch} sequences is not divisible by micro_batch_size "
                           f"{b.micro_batch_size} x {world_size} data-parallel ranks = {per_step}; "
                           f"use {lo or hi} or {hi}, or change micro_batch_size"])
    return BatchPlan(b.micro_batch_size, world_size, global_batch // per_step, global_batch, seq_len)


SUPPORTED_MATRIX = """supported combinations:
  optimizer adamw     : ZeRO 0-3, with or without CPU/NVMe offload, bf16/fp16/fp32 (fp16 needs a GPU)
  optimizer adamw8bit : ZeRO 0-2 without any offload, on a GPU (bitsandbytes)
  pipeline parallelism: not supported (ZeRO-2/3 cannot be combined with it)"""


def _filled(value: Any, ours: Any, name: str, problems: list[str]) -> Any:
    if value == "auto" or value is None:
        return ours
    if value != ours:
        problems.append(f"{name} is {value} in the DeepSpeed config but {ours} from our config; set it to \"auto\"")
    return value


def resolve(cfg: PretrainConfig, ds_raw: dict[str, Any], plan: BatchPlan, *, accelerator: str,
            source: str = "deepspeed config") -> dict[str, Any]:
    """Fill the "auto" fields of a DeepSpeed config from ours and refuse unsupported combinations, listing
    every problem at once."""
    ds = json.loads(json.dumps(ds_raw))
    p: list[str] = []
    ds["train_micro_batch_size_per_gpu"] = _filled(ds.get("train_micro_batch_size_per_gpu", "auto"),
                                                   plan.micro_batch_size, "train_micro_batch_size_per_gpu", p)
    ds["gradient_accumulation_steps"] = _filled(ds.get("gradient_accumulation_steps", "auto"), plan.grad_accum,
                                                "gradient_accumulation_steps", p)
    ds["train_batch_size"] = _filled(ds.get("train_batch_size", "auto"), plan.global_batch_size,
                                     "train_batch_size", p)
    ds["gradient_clipping"] = _filled(ds.get("gradient_clipping", "auto"), cfg.optim.grad_clip, "gradient_clipping", p)
    prec = cfg.train.precision
    for key in ("bf16", "fp16"):
        sec = dict(ds.get(key, {}))
        sec["enabled"] = _filled(sec.get("enabled", "auto"), prec == key, f"{key}.enabled", p)
        ds[key] = sec
    zero = ds.setdefault("zero_optimization", {"stage": 0})
    stage = int(zero.get("stage", 0))
    offload = any(zero.get(k, {}).get("device", "none") not in ("none", None)
                  for k in ("offload_optimizer", "offload_param"))
    o = cfg.optim
    if o.name == "adamw":
        opt = ds.setdefault("optimizer", {"type": "AdamW", "params": {}})
        params = opt.setdefault("params", {})
        params["lr"] = o.lr if params.get("lr", "auto") == "auto" else params["lr"]
        params["betas"] = _filled(params.get("betas", "auto"), [o.beta1, o.beta2], "optimizer.params.betas", p)
        params["eps"] = _filled(params.get("eps", "auto"), o.eps, "optimizer.params.eps", p)
        params["weight_decay"] = _filled(params.get("weight_decay", "auto"), o.weight_decay,
                                         "optimizer.params.weight_decay", p)
        if str(opt.get("type", "")).lower() not in ("adamw", "adam"):
            p.append(f"optimizer.type {opt.get('type')}: only AdamW is supported here")
    else:
        ds.pop("optimizer", None)
        if offload or stage >= 3:
            p.append(f"optim.name adamw8bit cannot run with ZeRO-{stage}{' and offload' if offload else ''}: "
                     "bitsandbytes optimizers need their states on the GPU and unsharded parameters")
        if accelerator == "cpu":
            p.append("optim.name adamw8bit needs a CUDA GPU (bitsandbytes' 8-bit optimizers do not run on CPU)")
    if prec == "fp16" and accelerator == "cpu":
        p.append("train.precision fp16 is not supported on the CPU accelerator; use bf16 or fp32")
    if "pipeline" in ds or ds.get("pipeline_parallel_size", 1) not in (1, None):
        p.append("pipeline parallelism is not supported by this pipeline")
    if "scheduler" in ds:
        p.append("scheduler: remove it; the learning rate comes from optim.* (warmup + cosine)")
    if p:
        raise ConfigError(p + [SUPPORTED_MATRIX], source)
    ds.setdefault("steps_per_print", 10**9)
    return ds


def load_ds_config(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.exists():
        raise ConfigError([f"train.deepspeed_config {path}: no such file (see ds_configs/)"])
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError([f"{path}: not valid JSON ({e})"]) from None


def zero_stage(ds: dict[str, Any]) -> int:
    return int(ds.get("zero_optimization", {}).get("stage", 0))
