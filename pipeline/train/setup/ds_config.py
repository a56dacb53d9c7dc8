"""Batch arithmetic and DeepSpeed JSON resolution: pure functions, checked before any process group starts."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.errors import ConfigError
from pipeline.plan.cluster import (  # offload_devices: the doctor's too
    fp32_grad_accumulation,
    offload_devices,
    sequence_parallel_divides,
)
from pipeline.train.setup.config import PretrainConfig
from pipeline.train.setup.optimizers import OPTIMIZERS


@dataclass(frozen=True, slots=True)
class BatchPlan:
    micro_batch_size: int
    data_parallel_size: int
    """Replicas that each train their own samples: the world size over `sequence_parallel`."""
    grad_accum: int
    global_batch_size: int
    seq_len: int
    sequence_parallel: int = 1
    """Ranks that train one sample together, each on seq_len / sequence_parallel of its tokens."""

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch_size * self.seq_len

    @property
    def sequence_note(self) -> str:
        """What sequence parallelism makes of the batch, as the run's log and the dry run say it."""
        n = self.sequence_parallel
        return (
            f"sequence parallel {n}: {n} ranks share each sample, {self.seq_len // n} of its {self.seq_len} tokens "
            f"each; {self.data_parallel_size} data-parallel replica(s)"
        )


def batch_plan(cfg: PretrainConfig, world_size: int, seq_len: int) -> BatchPlan:
    """The batch arithmetic for `world_size` ranks, of which each `train.sequence_parallel` share one sample: the
    data-parallel size is world / N, and the global batch must split into micro-batches over it."""
    b = cfg.batch
    sp = cfg.train.sequence_parallel
    if found := sequence_parallel_divides(sp, world_size, seq_len):
        raise ConfigError(found)
    replicas = world_size // sp
    if b.global_batch_tokens is not None:
        if b.global_batch_tokens % seq_len:
            raise ConfigError(
                [
                    f"batch.global_batch_tokens {b.global_batch_tokens} is not a multiple of seq_len "
                    f"{seq_len}; use {max(1, round(b.global_batch_tokens / seq_len)) * seq_len}"
                ]
            )
        global_batch = b.global_batch_tokens // seq_len
    else:
        assert b.global_batch_size is not None
        global_batch = b.global_batch_size
    per_step = b.micro_batch_size * replicas
    if global_batch % per_step:
        lo, hi = (global_batch // per_step) * per_step, math.ceil(global_batch / per_step) * per_step
        micros = [m for m in range(1, 65) if global_batch % (m * replicas) == 0]
        micro_hint = (
            f"batch.micro_batch_size {' or '.join(map(str, micros[-3:]))} keeps it"
            if micros
            else f"no micro_batch_size divides it on {replicas} {'ranks' if sp == 1 else 'data-parallel replicas'}"
        )
        raise ConfigError(
            [
                f"batch: global batch {global_batch} sequences is not divisible by micro_batch_size "
                f"{b.micro_batch_size} x {replicas} data-parallel ranks = {per_step}; {micro_hint}; "
                f"or --set batch.global_batch_size={f'{lo} or {hi}' if lo else hi} (a resumed run then "
                "trains with another batch than it started with)"
            ]
        )
    return BatchPlan(b.micro_batch_size, replicas, global_batch // per_step, global_batch, seq_len, sp)


def _optimizer_lines() -> str:
    """One line per entry of the optimizer table: its ZeRO stages and whether its states may be offloaded."""
    lines = []
    for name, o in OPTIMIZERS.items():
        stages = f"{min(o.zero_stages)}-{max(o.zero_stages)}"
        lines.append(f"  optimizer {name:<10}: ZeRO {stages}, {'with or without' if o.offload else 'without'} offload")
    return "\n".join(lines)


SUPPORTED_MATRIX = f"""supported combinations:
{_optimizer_lines()}
  (pipeline.train.setup.optimizers.OPTIMIZERS; fp16 needs a GPU)
  train.compile       : ZeRO 0-2 (null: on for a CUDA GPU with ZeRO 0-2)
  train.fp8           : ZeRO 0-2, bf16, torchao
  bf16 master/states  : bf16 precision, ZeRO 1-3 (bf16_optimizer_states needs bf16_master_weights_and_grads)
  zenflow             : ZeRO 1-2 with offload_optimizer cpu, grad_accum 1, integer update/select intervals
  cpu_checkpointing   : with train.activation_checkpointing (activation_checkpointing.cpu_checkpointing)
  pipeline parallelism: not supported (ZeRO-2/3 cannot be combined with it)"""


OURS = {
    "train_micro_batch_size_per_gpu": "batch.micro_batch_size",
    "gradient_accumulation_steps": "batch.global_batch_size / (micro-batch x data-parallel ranks)",
    "train_batch_size": "batch.global_batch_size",
    "gradient_clipping": "optim.grad_clip",
    "sequence_parallel_size": "train.sequence_parallel",
}
"""The config field each DeepSpeed JSON field filled from ours comes from: a disagreement names both ways out."""


def _filled(value: Any, ours: Any, name: str, problems: list[str]) -> Any:
    if value == "auto" or value is None:
        return ours
    if value != ours:
        field = OURS.get(name)
        other = f", or set {field} to agree ({value})" if field and "/" not in field else ""
        problems.append(
            f"{name} is {value} in the DeepSpeed config but {ours} from our config ({field or 'the config'}); "
            f'set it to "auto"{other}'
        )
    return value


def resolve(
    cfg: PretrainConfig,
    ds_raw: dict[str, Any],
    plan: BatchPlan,
    *,
    accelerator: str,
    source: str = "deepspeed config",
    num_params: int | None = None,
) -> dict[str, Any]:
    """Fill the "auto" fields of a DeepSpeed config from ours and refuse unsupported combinations, listing
    every problem at once. With `num_params`, buckets larger than the model are cut to its size."""
    ds = json.loads(json.dumps(ds_raw))
    p: list[str] = []
    _fill_batch_and_precision(ds, cfg, plan, p)
    _fill_optimizer(ds, cfg, p)
    combinations = unsupported(ds, cfg, accelerator) + offload_feature_problems(ds, cfg, plan)
    if p or combinations:  # the table of what runs together, only where a combination is refused
        raise ConfigError(p + combinations, source, footer=SUPPORTED_MATRIX if combinations else "")
    explicit = (ds.get("data_types") or {}).get("grad_accum_dtype")
    if cfg.train.precision != "fp32" and fp32_grad_accumulation(zero_stage(ds), plan.grad_accum, explicit):
        ds.setdefault("data_types", {})["grad_accum_dtype"] = "fp32"
    if cfg.train.precision == "bf16" and zero_stage(ds) in (1, 2):
        # DeepSpeed's ZeRO-1/2 skip an update whose gradient norm is not finite (fp32 and fp16 always, ZeRO-3 in
        # every precision) but apply it in bf16 unless told to check: a NaN would then reach the weights.
        ds["bf16"].setdefault("check_grad_overflow", True)
    ds.setdefault("steps_per_print", 10**9)
    if num_params is not None:
        fit_buckets(ds, num_params)
    return ds


def _fill_batch_and_precision(ds: dict[str, Any], cfg: PretrainConfig, plan: BatchPlan, p: list[str]) -> None:
    for key, ours in (
        ("train_micro_batch_size_per_gpu", plan.micro_batch_size),
        ("gradient_accumulation_steps", plan.grad_accum),
        ("train_batch_size", plan.global_batch_size),
        ("gradient_clipping", cfg.optim.grad_clip if OPTIMIZERS[cfg.optim.name].clip_note is None else 0.0),
    ):
        ds[key] = _filled(ds.get(key, "auto"), ours, key, p)
    if plan.sequence_parallel > 1 or "sequence_parallel_size" in ds:
        # DeepSpeed's own batch check counts world / this as its data-parallel size, also in zero.Init (ZeRO-3),
        # which is given no process groups
        key = "sequence_parallel_size"
        ds[key] = _filled(ds.get(key, "auto"), plan.sequence_parallel, key, p)
    for key in ("bf16", "fp16"):
        sec = dict(ds.get(key, {}))
        sec["enabled"] = _filled(sec.get("enabled", "auto"), cfg.train.precision == key, f"{key}.enabled", p)
        ds[key] = sec
    ds.setdefault("zero_optimization", {"stage": 0})


def _fill_optimizer(ds: dict[str, Any], cfg: PretrainConfig, p: list[str]) -> None:
    """The JSON's optimizer section from the optimizer table: an "auto" (or absent) type becomes optim.name's
    DeepSpeed type, and each "auto" (or absent) parameter its value from the optim section; a value the JSON sets
    must agree with the config (the learning rate is the schedule's, set at every step)."""
    o, entry = cfg.optim, OPTIMIZERS[cfg.optim.name]
    if entry.build is None and entry.ds_params is not None:  # DeepSpeed builds it from the JSON's section
        section = ds.setdefault("optimizer", {"type": "auto", "params": {}})
        if section.get("type", "auto") == "auto":
            section["type"] = entry.ds_types[0]
        params = section.setdefault("params", {})
        for key, value in entry.ds_params(o).items():
            if key == "lr":
                params[key] = value if params.get(key, "auto") == "auto" else params[key]
            else:
                params[key] = _filled(params.get(key, "auto"), value, f"optimizer.params.{key}", p)
        return
    ds.pop("optimizer", None)
    # DeepSpeed's ZeRO-1/2 wrap only optimizers on its own list unless told otherwise; bitsandbytes' AdamW8bit
    # steps element-wise on the flat fp32 partition ZeRO hands it, which is all ZeRO-1/2 need of it.
    if zero_stage(ds) in (1, 2):
        ds["zero_allow_untested_optimizer"] = True


def unsupported(ds: dict[str, Any], cfg: PretrainConfig, accelerator: str) -> list[str]:
    """Why this DeepSpeed config cannot run with our config on this accelerator (empty: it can)."""
    p = []
    stage, offload, train = zero_stage(ds), offload_devices(ds).any, cfg.train
    opt_type = str((ds.get("optimizer") or {}).get("type", ""))
    optimizer = OPTIMIZERS[cfg.optim.name]
    if optimizer.ds_types and opt_type.lower() not in {t.lower() for t in optimizer.ds_types}:
        p.append(
            f"optimizer.type {opt_type}: optim.name {cfg.optim.name} is built from {optimizer.ds_types[0]}; set "
            'optimizer.type to "auto" (the optimizer table then writes it) or remove the optimizer section'
        )
    p += optimizer.problems(cfg.optim.name, stage, offload)
    if train.fp8 and stage == 3:
        p.append(
            "train.fp8 with ZeRO-3: not supported (torchao's float8 layers read their weight whole, which ZeRO-3 "
            "partitions; untested here); use ZeRO-1/2 or train.fp8: false"
        )
    if train.compile is True and stage == 3:
        p.append(
            "train.compile with ZeRO-3: not supported yet (ZeRO-3's parameter hooks break the compiled "
            "graphs); use ZeRO-1/2 or compile: false"
        )
    if train.on_nonfinite == "skip" and stage == 0:
        p.append(
            "train.on_nonfinite skip needs ZeRO 1-3 (DeepSpeed drops a non-finite update there); with ZeRO-0 use stop"
        )
    if train.on_nonfinite == "skip" and cfg.optim.grad_clip == 0:
        p.append(
            "train.on_nonfinite skip needs optim.grad_clip > 0: DeepSpeed finds a non-finite gradient through "
            "the norm it computes for clipping"
        )
    if train.precision == "fp16" and accelerator == "cpu":
        p.append("train.precision fp16 is not supported on the CPU accelerator; use bf16 or fp32")
    if "pipeline" in ds or ds.get("pipeline_parallel_size", 1) not in (1, None):
        p.append("pipeline parallelism is not supported by this pipeline")
    if "scheduler" in ds:
        p.append("scheduler: remove it; the learning rate comes from optim.* (warmup + cosine)")
    if train.sequence_parallel > 1 and stage == 3 and (ds["zero_optimization"].get("reduce_scatter") is False):
        p.append(
            "zero_optimization.reduce_scatter false with train.sequence_parallel and ZeRO-3: DeepSpeed then averages "
            "some gradient buckets over the data-parallel replicas and others over every rank; remove the key "
            "(pipeline.train.runtime.ds_workarounds.sequence_parallel_loss_factor)"
        )
    return p


def offload_feature_problems(ds: dict[str, Any], cfg: PretrainConfig, plan: BatchPlan) -> list[str]:
    """DeepSpeed 0.19's offload features (bf16 master weights and optimizer states, ZenFlow, activation offload)
    in combinations that cannot run, or would not do what the config says, each with the fix."""
    p = []
    stage, offload = zero_stage(ds), offload_devices(ds)
    bf16 = ds.get("bf16") or {}
    master, states = bf16.get("bf16_master_weights_and_grads") is True, bf16.get("bf16_optimizer_states") is True
    if states and not master:
        p.append("bf16.bf16_optimizer_states needs bf16.bf16_master_weights_and_grads: true as well")
    if (master or states) and cfg.train.precision != "bf16":
        p.append(
            f"bf16.bf16_master_weights_and_grads / bf16_optimizer_states need train.precision bf16, not "
            f"{cfg.train.precision}"
        )
    if (master or states) and stage == 0:
        p.append("bf16.bf16_master_weights_and_grads / bf16_optimizer_states need ZeRO 1-3")
    zenflow = (ds.get("zero_optimization") or {}).get("zenflow")
    if zenflow is not None:
        every = cfg.checkpoint.interval if cfg.checkpoint.enabled else 0
        p += _zenflow_problems(zenflow, stage, offload.optimizer, plan, every)
    if (ds.get("activation_checkpointing") or {}).get("cpu_checkpointing") is True and not (
        cfg.train.activation_checkpointing
    ):
        p.append(
            "activation_checkpointing.cpu_checkpointing moves the checkpointed layer inputs to host memory: it "
            "needs train.activation_checkpointing: true"
        )
    return p


def _zenflow_problems(
    zenflow: Any, stage: int, optimizer_device: str, plan: BatchPlan, checkpoint_interval: int
) -> list[str]:
    if not isinstance(zenflow, dict):
        return ['zero_optimization.zenflow: expected an object such as {"topk_ratio": 0.1, "update_interval": 4}']
    p = []
    if optimizer_device != "cpu":
        p.append(
            "zero_optimization.zenflow needs offload_optimizer.device cpu: ZenFlow splits the optimizer between "
            "the GPU (the top-k gradient columns) and CPU Adam (the rest)"
        )
    if stage == 3:
        # Measured: DeepSpeed 0.19.8's ZeRO-3 ZenFlow never gathers the embedding for the first forward here
        # (IndexError in F.embedding on every rank; DeepSpeed #7796 is another open ZeRO-3 ZenFlow crash).
        p.append(
            "zero_optimization.zenflow with ZeRO-3 does not run in DeepSpeed 0.19.8 (its first forward fails); "
            "use ZeRO-2 with offload_optimizer cpu"
        )
    interval, select = zenflow.get("update_interval", "auto"), zenflow.get("select_interval", "auto")
    strategy = zenflow.get("select_strategy", "auto")
    if not isinstance(interval, int) or isinstance(interval, bool) or interval < 1:
        p.append(
            f"zero_optimization.zenflow.update_interval {interval!r}: give a whole number of steps (the CPU update of "
            "the other columns comes every that many steps; checkpoints then fall on its boundaries)"
        )
    if strategy != "step" or not isinstance(select, int) or isinstance(select, bool):
        p.append(
            f"zero_optimization.zenflow: select_strategy {strategy!r} / select_interval {select!r}: use "
            '"select_strategy": "step" with a whole select_interval (the pipeline hands DeepSpeed no dataloader, so '
            "its epoch-based choices never reselect the columns)"
        )
    elif isinstance(interval, int) and interval >= 1 and select < interval:
        p.append(f"zero_optimization.zenflow.select_interval {select} is below update_interval {interval}")
    if plan.grad_accum != 1:
        per_step = plan.micro_batch_size * plan.data_parallel_size
        p.append(
            f"zero_optimization.zenflow with {plan.grad_accum} micro-steps per step: ZenFlow updates the top-k "
            "columns at every micro-step and accumulates the rest over update_interval steps, so it takes the place "
            f"of gradient accumulation. Set batch.global_batch_size {per_step} (micro_batch_size x ranks) and "
            f"zenflow.update_interval {plan.grad_accum} to keep {plan.global_batch_size} sequences per full update"
        )
    elif isinstance(interval, int) and interval >= 1 and checkpoint_interval and checkpoint_interval % interval:
        p.append(
            f"checkpoint.interval {checkpoint_interval} is not a multiple of zenflow.update_interval {interval}: a "
            "checkpoint between two CPU updates leaves out the gradients gathered since the last one"
        )
    return p


# Sizes in elements that DeepSpeed allocates whole, whatever the model's size.
BUCKET_FIELDS = ("reduce_bucket_size", "allgather_bucket_size", "stage3_prefetch_bucket_size", "sub_group_size")


def fit_buckets(ds: dict[str, Any], num_params: int) -> dict[str, Any]:
    """Cut bucket sizes to the parameter count: a bucket can never hold more than the whole model, and DeepSpeed
    allocates each one whole (ZeRO-1/2 allocate `reduce_bucket_size` afresh at every micro-step, twice with
    `overlap_comm`). A 5e8 bucket for a 1M-parameter model costs 4 GB of memory, and on the CPU the zeroing of
    those pages is most of a step. The results do not change: reductions are element-wise. Unset fields take
    DeepSpeed's defaults (5e8), so they are set too."""
    zero = ds.get("zero_optimization", {})
    stage = int(zero.get("stage", 0))
    if stage == 0:
        return ds
    fields = BUCKET_FIELDS if stage == 3 else ("reduce_bucket_size", "allgather_bucket_size")
    for key in fields:
        value = zero.get(key, 5e8)
        if isinstance(value, (int, float)) and value > num_params:
            zero[key] = int(num_params)
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
