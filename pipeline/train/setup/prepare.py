"""Before the loop: everything checked before a process group starts (`prepare`), in the process that runs
`pipeline pretrain` and again on every rank, so a bad input fails in a second with one message. What it returns,
`Prepared`, is what the whole run is about; with this rank's `Dist` it becomes the `Run` the loop takes."""

from __future__ import annotations

import base64
import copy
import json
from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

import torch

from pipeline.data.manifest import ShardManifest, read_shard_manifest
from pipeline.data.tokenizer import check_tokenizer
from pipeline.errors import ConfigError, PipelineError
from pipeline.model import ModelShape, sequence_parallel_problems
from pipeline.model.families import model_shape
from pipeline.model.varlen import (
    NO_MASKS,
    DocumentAttention,
    attention_facts,
    choose_documents,
    sequence_parallel_attention_problems,
)
from pipeline.plan.cluster import Layout
from pipeline.plan.ds_json import layout_from_ds
from pipeline.plan.gpus import GPU, capped, lookup
from pipeline.train.runtime.dist import Dist, accelerator_name, host_ram_bytes, ranks_per_node
from pipeline.train.runtime.ds_workarounds import deepspeed_version_problems
from pipeline.train.runtime.sequence import SequenceShard
from pipeline.train.setup.config import PretrainConfig
from pipeline.train.setup.ds_config import BatchPlan, batch_plan, load_ds_config, resolve
from pipeline.train.setup.optimizers import OPTIMIZERS
from pipeline.train.setup.schedule import max_steps_for
from pipeline.train.setup.stages import stage_problems


@dataclass(frozen=True, kw_only=True, slots=True)
class Planned:
    """What the planner chose under `deepspeed_config: auto`: chosen once, by `pipeline pretrain` before the launch,
    and handed to every rank on its command line (`--planned`), so that no rank searches again and no two ranks
    can choose apart on nodes that differ (a node with less RAM, another card)."""

    ds: dict[str, Any]
    """The chosen DeepSpeed JSON, before its "auto" fields are filled."""
    activation_checkpointing: bool
    tiled_mlp: int
    world_size: int
    """The world it was chosen for: a relaunch on fewer hosts plans again (pipeline.launch.shrink)."""
    by: str = "each rank"
    """Who searched: each rank for itself, or `pipeline pretrain` before the launch (environment.json says)."""

    def encode(self) -> str:
        """One shell-safe word (base64 of the JSON): it passes through the launcher's ssh and pdsh unquoted."""
        text = json.dumps(
            [self.ds, self.activation_checkpointing, self.tiled_mlp, self.world_size], separators=(",", ":")
        )
        return base64.urlsafe_b64encode(text.encode()).decode()

    @classmethod
    def decode(cls, word: str) -> Planned:
        try:
            ds, checkpointing, tiles, world = json.loads(base64.urlsafe_b64decode(word.encode()))
            return cls(
                ds=ds,
                activation_checkpointing=bool(checkpointing),
                tiled_mlp=int(tiles),
                world_size=int(world),
                by="pipeline pretrain, before the launch",
            )
        except (ValueError, TypeError) as e:
            raise PipelineError(f"--planned: not a plan written by `pipeline pretrain` ({e})") from None


@dataclass(frozen=True, kw_only=True, slots=True)
class Prepared:
    """A checked run: its config (with the planner's choices filled in), the resolved DeepSpeed JSON, the batch
    arithmetic for this world size, the model's shape, the shards' manifest, how attention keeps documents apart
    and windows honoured, and the run's `layout`: the record the planner prices (pipeline.plan.cluster.Layout),
    read from the config and the JSON once, here. Everything below the preparation reads the ZeRO stage, the
    offloads, checkpointing, sequence parallelism and the tiles from it, not from the config or the JSON."""

    cfg: PretrainConfig
    ds: dict[str, Any]
    plan: BatchPlan
    shape: ModelShape
    manifest: ShardManifest
    documents: DocumentAttention
    layout: Layout
    planned: Planned | None = None
    """Under `deepspeed_config: auto`, the planner's choice this run trains with."""

    @property
    def run_dir(self) -> Path:
        return Path(self.cfg.run_dir)


@dataclass(frozen=True, kw_only=True, slots=True)
class Run(Prepared):
    """A prepared run as one rank sees it: what the loop and its parts are given."""

    dist: Dist

    @classmethod
    def on(cls, prepared: Prepared, dist: Dist) -> Run:
        return cls(**{f.name: getattr(prepared, f.name) for f in fields(Prepared)}, dist=dist)

    @property
    def sequence(self) -> SequenceShard:
        """This rank's share of each sample (the whole of it without sequence parallelism)."""
        return SequenceShard.of(self.plan.sequence_parallel, self.dist.rank)

    @property
    def replica(self) -> int:
        """This rank's data-parallel replica: the ranks of a sequence-parallel group read the same samples."""
        return self.dist.rank // self.plan.sequence_parallel


def prepare(
    cfg: PretrainConfig, world_size: int, local_size: int | None = None, planned: Planned | None = None
) -> Prepared:
    """Everything checked before a process group starts: data manifest, batch arithmetic, DeepSpeed JSON, model.
    With `train.deepspeed_config: auto` the planner picks the DeepSpeed config, activation checkpointing and tiles,
    or `planned` (what `pipeline pretrain` chose for this world before the launch) is taken as it is."""
    manifest = read_shard_manifest(cfg.data.path)
    seq_len = int(manifest["seq_len"])
    plan = batch_plan(cfg, world_size, seq_len)
    shape = model_shape(
        cfg.model.preset,
        dict(cfg.model.shape),
        cfg.model.init_from,
        manifest["tokenizer"]["vocab_size"],
        seq_len,
        cfg.model.rope,
        cfg.model.max_position_embeddings,
        architecture=cfg.model.architecture,
    )
    check_tokenizer(shape, manifest["tokenizer"], f"{cfg.data.path}/manifest.json")
    whole_documents = bool(manifest.get("document_masks"))
    facts = attention_facts(shape)
    documents = choose_documents(
        cfg.train.document_attention,
        whole_documents=whole_documents,
        facts=facts,
        seq_len=seq_len,
        micro_batch_size=plan.micro_batch_size,
        device_type=accelerator_name(),
    )
    found = deepspeed_version_problems() + sequence_parallel_problems(shape, plan.sequence_parallel)
    varlen = documents.kind == "varlen"
    found += sequence_parallel_attention_problems(plan.sequence_parallel, facts, seq_len, whole_documents, varlen)
    found += stage_problems(cfg.data, manifest, max_steps_for(cfg, plan))
    if found:
        raise ConfigError(found)
    chosen = None
    if cfg.train.deepspeed_config == "auto":  # the trainer runs what the planner priced: JSON, checkpointing, tiles
        if planned is not None and planned.world_size == world_size:
            chosen, source = planned, "deepspeed config chosen by the planner before the launch"
        else:
            raw, checkpointing, tiles = auto_ds_config(
                shape, plan, world_size, cfg, local_size, documents, whole_documents
            )
            chosen = Planned(ds=raw, activation_checkpointing=checkpointing, tiled_mlp=tiles, world_size=world_size)
            source = "deepspeed config chosen by the planner"
        tiles, checkpointing = chosen.tiled_mlp, chosen.activation_checkpointing
        cfg = replace(cfg, train=replace(cfg.train, activation_checkpointing=checkpointing, tiled_mlp=tiles))
        raw = copy.deepcopy(chosen.ds)
    else:
        raw, source = load_ds_config(cfg.train.deepspeed_config), cfg.train.deepspeed_config
    ds = resolve(cfg, raw, plan, accelerator=accelerator_name(), source=source, num_params=shape.num_params())
    layout = run_layout(cfg, ds)
    return Prepared(
        cfg=cfg, ds=ds, plan=plan, shape=shape, manifest=manifest, documents=documents, layout=layout, planned=chosen
    )


def run_layout(cfg: PretrainConfig, ds: dict[str, Any]) -> Layout:
    """The Layout a config and its resolved DeepSpeed JSON describe (the JSON read by the planner's own
    `layout_from_ds`, the fields it has no place for from the config): what the planner prices for this run."""
    return layout_from_ds(
        ds,
        int(ds["train_micro_batch_size_per_gpu"]),
        int(ds["gradient_accumulation_steps"]),
        cfg.train.activation_checkpointing,
        OPTIMIZERS[cfg.optim.name].moment_bytes,
        cfg.train.sequence_parallel,
        cfg.train.tiled_mlp,
    )


def trainer_refusals(cfg: PretrainConfig, plan: BatchPlan, accelerator: str) -> Callable[[Any], list[str]]:
    """What the trainer refuses of each configuration the planner's search tries for this config (`resolve`'s
    checks on the DeepSpeed JSON the planner would write, with the config's own settings and the configuration's
    activation checkpointing): `deepspeed_config: auto` and `plan --config` never propose such a one."""
    from pipeline.plan.ds_json import ds_config

    def refused(cand: Any) -> list[str]:
        trial = replace(cfg, train=replace(cfg.train, activation_checkpointing=cand.activation_checkpointing))
        try:
            resolve(trial, ds_config(cand), plan, accelerator=accelerator)
        except ConfigError as e:
            return e.problems
        return []

    return refused


def optimizer_fit(name: str) -> Any:
    """What the planner's search needs of OPTIMIZERS' entry `name`."""
    from pipeline.plan.search import OptimizerFit

    entry = OPTIMIZERS[name]
    return OptimizerFit(entry.zero_stages, entry.offload, entry.moment_bytes, name)


def planning_card(device_name: str, total_bytes: int, gpu_memory_cap_gib: float | None) -> GPU:
    """The planner's row for this GPU with the memory the run may use: the card's own, or less under
    `train.gpu_memory_cap_gib` (a 24 GiB 4090D emulated on an 80 GiB card is planned as 24 GiB)."""
    try:
        card = lookup(device_name)
    except KeyError:
        raise PipelineError(
            f"train.deepspeed_config auto: no planner data for GPU '{device_name}'; run "
            "`pipeline plan` with a known --gpu and --write-ds-config"
        ) from None
    return capped(replace(card, memory_gib=total_bytes / 2**30), gpu_memory_cap_gib)


def cpu_card(ram_bytes: float, ranks: int, gpu_memory_cap_gib: float | None = None) -> GPU:
    """A CPU rank as the planner's "card": its share of host RAM (or `gpu_memory_cap_gib`, the card a CPU test run
    emulates), a nominal 0.5 TF. Only for the arithmetic of CPU test runs; the planner's GPU physics (MFU, PCIe)
    says nothing true about them."""
    share = ram_bytes / max(1, ranks) / 2**30 * 0.8
    return GPU("CPU rank", min(share, gpu_memory_cap_gib or share), 0.5, 20.0, 0, 10.0, True)


def auto_ds_config(
    shape: ModelShape,
    plan: BatchPlan,
    world_size: int,
    cfg: PretrainConfig,
    local_size: int | None = None,
    documents: DocumentAttention = NO_MASKS,
    whole_documents: bool = False,
) -> tuple[dict[str, Any], bool, int]:
    """Plan for this machine and world: nodes from the launcher's LOCAL_SIZE, the card from torch (capped at
    train.gpu_memory_cap_gib; a CPU run counts host RAM shared by its ranks, or the cap), host RAM from the OS; the
    config's micro-batch and sequence-parallel size are kept. Returns the chosen configuration's DeepSpeed JSON,
    activation checkpointing and MLP tiles: what the trainer then runs. `local_size` (ranks per node) defaults to
    the launcher's LOCAL_SIZE. Only the stages and offloads optim.name runs under are searched, its state bytes
    priced; train.compile and train.kernels are priced per configuration as they resolve on a GPU, whole documents
    on the attention path `documents` chose; nothing the trainer refuses for this config is chosen."""
    from pipeline.plan import search as planner
    from pipeline.plan.cluster import Cluster, Stack, trainer_stack
    from pipeline.plan.ds_json import ds_config

    local = local_size or ranks_per_node(world_size)
    ram = host_ram_bytes()
    card: GPU
    varlen = documents.kind == "varlen"
    # on the CPU every speed switch falls back to transformers' modules
    stack = Stack(whole_documents=whole_documents, varlen=varlen)
    if accelerator_name() == "cuda":
        # packages as installed on this node: what it prices is what runs
        stack = trainer_stack(cfg.train.compile, cfg.train.kernels, cfg.train.fp8, whole_documents, varlen)
        card = planning_card(
            torch.cuda.get_device_name(0),
            torch.cuda.get_device_properties(0).total_memory,
            cfg.train.gpu_memory_cap_gib,
        )
    else:
        card = cpu_card(ram, local, cfg.train.gpu_memory_cap_gib)
    cluster = Cluster(max(1, world_size // local), local, card, ram)
    result = planner.search(
        shape,
        plan.seq_len,
        cluster,
        plan.tokens_per_step,
        fixed_micro=plan.micro_batch_size,
        loss_chunk_tokens=cfg.train.loss_chunk_tokens or -1,  # the run's own chunk (-1: the trainer's default)
        fixed_sequence=plan.sequence_parallel,
        optimizer=optimizer_fit(cfg.optim.name),
        stack=stack,
        refused=trainer_refusals(cfg, plan, accelerator_name()),
    )
    if result.best is None:
        raise PipelineError(
            "train.deepspeed_config auto: nothing fits this machine; see `pipeline plan` for what would: "
            + "; ".join(result.advice)
        )
    best = result.best.layout
    return ds_config(result.best), best.activation_checkpointing, best.tiled_mlp
