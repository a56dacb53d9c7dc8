"""Before the loop: everything checked before a process group starts (`prepare`), and the process group itself
(`init_distributed`, with the device chosen from LOCAL_RANK before anything touches CUDA)."""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from datetime import timedelta
from pathlib import Path
from typing import Any, NamedTuple

import torch

from pipeline.data.manifest import ShardManifest, TokenizerInfo, read_shard_manifest
from pipeline.errors import PipelineError
from pipeline.model import ModelShape
from pipeline.model.families import model_shape
from pipeline.train.config import PretrainConfig
from pipeline.train.ds_config import BatchPlan, batch_plan, load_ds_config, resolve


def accelerator_name() -> str:
    """DeepSpeed's accelerator: DS_ACCELERATOR when set, else cuda when torch sees a GPU, else cpu."""
    name = os.environ.get("DS_ACCELERATOR")
    if name:
        return name
    return "cuda" if torch.cuda.is_available() else "cpu"


def device_for(accelerator: str, local_rank: int) -> torch.device:
    """The device of the rank that is `local_rank` on its node: GPU number `local_rank`, or the CPU."""
    if accelerator == "cpu":
        return torch.device("cpu")
    return torch.device(accelerator, local_rank)


def local_rank_from_env(environ: dict[str, str] | os._Environ[str] = os.environ) -> int:
    return int(environ.get("LOCAL_RANK", "0"))


@dataclass(frozen=True, slots=True)
class Dist:
    rank: int
    world_size: int
    device: torch.device


def init_distributed(timeout_minutes: float = 30.0) -> Dist:
    """Select this rank's GPU (from LOCAL_RANK; DeepSpeed would select it only later, inside `initialize`), start
    the process group, and release DeepSpeed's CPU shared-memory names once every rank has mapped them."""
    import deepspeed
    import deepspeed.comm as dist

    from pipeline.train.ds_workarounds import release_shm_names

    device = device_for(accelerator_name(), local_rank_from_env())
    if device.type == "cuda":
        torch.cuda.set_device(device)
    deepspeed.init_distributed(timeout=timedelta(minutes=timeout_minutes))
    rank, world = dist.get_rank(), dist.get_world_size()
    dist.barrier()  # every rank has mapped every shared-memory buffer by now
    release_shm_names(rank)
    return Dist(rank, world, device)


def apply_memory_cap(device: torch.device, cap_gib: float | None) -> None:
    """`train.gpu_memory_cap_gib`: emulate a smaller card (a 24 GiB 4090D on an 80 GiB GPU)."""
    if device.type == "cuda" and cap_gib:
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, cap_gib * 2**30 / total), device)


class Prepared(NamedTuple):
    cfg: PretrainConfig
    ds: dict[str, Any]
    plan: BatchPlan
    shape: ModelShape
    manifest: ShardManifest


def prepare(cfg: PretrainConfig, world_size: int, local_size: int | None = None) -> Prepared:
    """Everything checked before a process group starts: data manifest, batch arithmetic, DeepSpeed JSON, model.
    With `train.deepspeed_config: auto` the planner picks the DeepSpeed config (and activation checkpointing)."""
    manifest = read_shard_manifest(cfg.data.path)
    seq_len = int(manifest["seq_len"])
    plan = batch_plan(cfg, world_size, seq_len)
    shape = model_shape(
        cfg.model.preset, dict(cfg.model.shape), cfg.model.init_from, manifest["tokenizer"]["vocab_size"]
    )
    check_tokenizer(shape, manifest["tokenizer"], f"{cfg.data.path}/manifest.json")
    if seq_len > shape.max_seq_len:
        shape = replace(shape, max_seq_len=seq_len)
    if cfg.train.deepspeed_config == "auto":
        raw, checkpointing = auto_ds_config(shape, plan, world_size, cfg.train.gpu_memory_cap_gib, local_size)
        cfg = replace(cfg, train=replace(cfg.train, activation_checkpointing=checkpointing))
        source = "deepspeed config chosen by the planner"
    else:
        raw, source = load_ds_config(cfg.train.deepspeed_config), cfg.train.deepspeed_config
    ds = resolve(cfg, raw, plan, accelerator=accelerator_name(), source=source, num_params=shape.num_params())
    return Prepared(cfg, ds, plan, shape, manifest)


def planning_card(device_name: str, total_bytes: int, gpu_memory_cap_gib: float | None) -> Any:
    """The planner's row for this GPU with the memory the run may use: the card's own, or less under
    `train.gpu_memory_cap_gib` (a 24 GiB 4090D emulated on an 80 GiB card is planned as 24 GiB)."""
    from pipeline.plan.gpus import lookup

    try:
        card = lookup(device_name)
    except KeyError:
        raise PipelineError(
            f"train.deepspeed_config auto: no planner data for GPU '{device_name}'; run "
            "`pipeline plan` with a known --gpu and --write-ds-config"
        ) from None
    memory = total_bytes / 2**30
    return replace(card, memory_gib=min(memory, gpu_memory_cap_gib or memory))


def ranks_per_node(world_size: int) -> int:
    """Ranks on this node, as the launcher says (LOCAL_SIZE), else the whole world."""
    return int(os.environ.get("LOCAL_SIZE", os.environ.get("LOCAL_WORLD_SIZE", str(world_size))))


def host_ram_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def cpu_card(ram_bytes: float, ranks: int) -> Any:
    """A CPU rank as the planner's "card": its share of host RAM, a nominal 0.5 TF. Only for the arithmetic of
    CPU test runs; the planner's GPU physics (MFU, PCIe) says nothing true about them."""
    from pipeline.plan.gpus import GPU

    return GPU("CPU rank", ram_bytes / max(1, ranks) / 2**30 * 0.8, 0.5, 20.0, 0, 10.0, True)


def environment(world_size: int, device: torch.device) -> dict[str, Any]:
    """What a run ran on (RUN_DIR/environment.json), so `pipeline plan --from-run` can plan the same cluster."""
    import importlib.metadata as md

    local = ranks_per_node(world_size)
    info: dict[str, Any] = {
        "world_size": world_size,
        "ranks_per_node": local,
        "nodes": max(1, world_size // local),
        "device": "cpu",
        "device_memory_bytes": None,
        "host_ram_bytes": host_ram_bytes(),
        "cpu_cores": os.cpu_count(),
    }
    if device.type == "cuda":
        info["device"] = torch.cuda.get_device_name(device)
        info["device_memory_bytes"] = torch.cuda.get_device_properties(device).total_memory
    for pkg in ("torch", "deepspeed", "transformers"):
        try:
            info[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            info[pkg] = None
    return info


def auto_ds_config(
    shape: ModelShape,
    plan: BatchPlan,
    world_size: int,
    gpu_memory_cap_gib: float | None = None,
    local_size: int | None = None,
) -> tuple[dict[str, Any], bool]:
    """Plan for this machine and world: nodes from the launcher's LOCAL_SIZE, the card from torch (capped at
    `gpu_memory_cap_gib`; a CPU run counts host RAM shared by its ranks), host RAM from the OS; the config's
    micro-batch is kept. `local_size` (ranks per node) defaults to the launcher's LOCAL_SIZE."""
    from pipeline.plan import search as planner
    from pipeline.plan.gpus import GPU

    local = local_size or ranks_per_node(world_size)
    ram = host_ram_bytes()
    card: GPU
    if accelerator_name() == "cuda":
        card = planning_card(
            torch.cuda.get_device_name(0), torch.cuda.get_device_properties(0).total_memory, gpu_memory_cap_gib
        )
    else:
        card = cpu_card(ram, local)
    cluster = planner.Cluster(max(1, world_size // local), local, card, ram)
    result = planner.search(shape, plan.seq_len, cluster, plan.tokens_per_step, fixed_micro=plan.micro_batch_size)
    if result.best is None:
        raise PipelineError(
            "train.deepspeed_config auto: nothing fits this machine; see `pipeline plan` for "
            "what would: " + "; ".join(result.advice)
        )
    return planner.ds_config(result.best), result.best.candidate.activation_checkpointing


def check_tokenizer(shape: ModelShape, tok: TokenizerInfo, source: str) -> None:
    """Refuse data tokenized with a tokenizer that is not the model's: ids past the model's vocabulary, different
    end/begin-of-sequence ids, or (when the model folder carries a tokenizer) a different vocabulary size. `source`
    names where the data's tokenizer was read (a shard manifest)."""
    if shape.hf_config is None:
        return
    cfg = shape.hf_config
    model = cfg.get("_name_or_path") or "the model"
    problems = []
    if tok["vocab_size"] > shape.vocab_size:
        problems.append(f"its vocabulary has {tok['vocab_size']:,} tokens, the model's embedding {shape.vocab_size:,}")
    eos = cfg.get("eos_token_id")
    eos_ids = eos if isinstance(eos, list) else [eos] if eos is not None else []
    if eos_ids and tok["eos_id"] not in eos_ids:
        problems.append(f"its end-of-sequence id is {tok['eos_id']}, the model's {eos}")
    bos = cfg.get("bos_token_id")
    if isinstance(bos, int) and tok.get("bos_id", -1) >= 0 and tok["bos_id"] != bos:
        problems.append(f"its begin-of-sequence id is {tok['bos_id']}, the model's {bos}")
    own = _model_tokenizer_size(cfg)
    if own is not None and own != tok["vocab_size"]:
        problems.append(f"it has {tok['vocab_size']:,} tokens, the model folder's own tokenizer {own:,}")
    if problems:
        raise PipelineError(
            f"{source}: the data was tokenized with {tok.get('path')}, which is not the tokenizer of "
            f"{model}: " + "; ".join(problems) + ". Re-tokenize with `pipeline tokenize --tokenizer "
            "MODEL_DIR` (the model's own tokenizer)"
        )


def _model_tokenizer_size(cfg: dict[str, Any]) -> int | None:
    folder = cfg.get("_name_or_path")
    if not folder or not Path(folder, "tokenizer_config.json").is_file():
        return None
    from pipeline.data.tokenizer import Tokenizer

    try:
        return Tokenizer(folder).vocab_size
    except PipelineError:
        return None
