"""What the planner says of one training config (`pipeline plan --config`) and of a finished or running run beside
what it measured (`pipeline plan --from-run`): the forecasts, rendered by pipeline.train.forecast_report. Lives in
train/ because it reads training configs and runs; the arithmetic is pipeline.plan's."""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from pipeline.data.manifest import read_shard_manifest
from pipeline.errors import PipelineError
from pipeline.model import ModelShape, loss_chunk_tokens
from pipeline.model.families import model_shape
from pipeline.plan.cluster import Cluster, Stack, trainer_stack
from pipeline.plan.command import varlen_on_cluster
from pipeline.plan.ds_json import layout_from_ds
from pipeline.plan.estimate import Estimate, estimate
from pipeline.plan.gpus import capped, lookup
from pipeline.plan.search import Plan, search
from pipeline.plan.timing import Measured, Rates, rates_from_run
from pipeline.train.checkpoint.files import run_config_text
from pipeline.train.setup.config import PretrainConfig, load
from pipeline.train.setup.ds_config import BatchPlan, batch_plan, load_ds_config
from pipeline.train.setup.optimizers import OPTIMIZERS
from pipeline.train.setup.prepare import optimizer_fit, trainer_refusals
from pipeline.train.setup.schedule import Schedule, max_steps_for


@dataclass
class Forecast:
    config: str
    shape: ModelShape
    seq_len: int
    seq_len_from: str
    batch: BatchPlan
    cluster: Cluster
    yours: Estimate
    search: Plan
    schedule: str = ""
    """The learning-rate schedule, as the run's log says it."""
    stack: Stack = Stack()
    """The config's speed switches (train.compile, train.kernels) as the planner prices them."""


def shape_and_seq(
    cfg: PretrainConfig, seq_len: int | None, layers: int | None, vocab_size: int
) -> tuple[ModelShape, int, str, int]:
    """(shape, seq_len, where seq_len came from, vocabulary): the shards' manifest when they exist, else the flag."""
    manifest_path = Path(cfg.data.path) / "manifest.json"
    if manifest_path.exists():
        manifest = read_shard_manifest(cfg.data.path)
        seq, source, vocab = (
            int(manifest["seq_len"]),
            f"the shards ({manifest_path})",
            manifest["tokenizer"]["vocab_size"],
        )
    elif seq_len:
        seq, source, vocab = seq_len, "--seq-len", vocab_size
    else:
        raise PipelineError(f"data.path {cfg.data.path}: no shards there yet; give --seq-len N")
    m = cfg.model
    shape = model_shape(
        m.preset, dict(m.shape), m.init_from, vocab, seq, m.rope, m.max_position_embeddings, architecture=m.architecture
    )
    if layers:
        shape = replace(shape, num_layers=layers)
    return shape, seq, source, vocab


def whole_documents(cfg: PretrainConfig) -> bool:
    """Whether the config's shards hold whole documents (their manifest says; False before they exist)."""
    try:
        return bool(read_shard_manifest(cfg.data.path).get("document_masks"))
    except (OSError, PipelineError):
        return False


def forecast_config(
    config_path: str,
    sets: list[str],
    cluster: Cluster,
    *,
    seq_len: int | None,
    layers: int | None,
    vocab_size: int,
    mfu: float | None,
    rates: Rates | None = None,
    opt_in: frozenset[str] = frozenset(),
) -> Forecast:
    cfg = load(config_path, sets)
    shape, seq, source, _ = shape_and_seq(cfg, seq_len, layers, vocab_size)
    cluster = replace(cluster, gpu=capped(cluster.gpu, cfg.train.gpu_memory_cap_gib))
    bp = batch_plan(cfg, cluster.world, seq)
    chunk = cfg.train.loss_chunk_tokens or loss_chunk_tokens(shape.vocab_size)
    # auto (the trainer's own choice) keeps the config's sequence-parallel size; the search beside a given JSON
    # tries every size
    auto = cfg.train.deepspeed_config == "auto"
    fixed = bp.sequence_parallel if auto else None
    stack = trainer_stack(
        cfg.train.compile,
        cfg.train.kernels,
        cfg.train.fp8,
        whole_documents=whole_documents(cfg),
        varlen=varlen_on_cluster(cfg.train.document_attention, cluster.installed),
        packages=cluster.installed,
    )
    refused = trainer_refusals(cfg, bp, "cuda")
    found = search(
        shape,
        seq,
        cluster,
        bp.tokens_per_step,
        mfu,
        loss_chunk_tokens=chunk,
        rates=rates,
        opt_in=opt_in,
        fixed_sequence=fixed,
        optimizer=optimizer_fit(cfg.optim.name),
        stack=stack,
        refused=refused,
    )
    if auto:
        if found.best is None:
            raise PipelineError("train.deepspeed_config auto: nothing fits this cluster; " + "; ".join(found.advice))
        yours = found.best
    else:
        cand = layout_from_ds(
            load_ds_config(cfg.train.deepspeed_config),
            bp.micro_batch_size,
            bp.grad_accum,
            cfg.train.activation_checkpointing,
            OPTIMIZERS[cfg.optim.name].moment_bytes,
            bp.sequence_parallel,
            cfg.train.tiled_mlp,
        )
        yours = estimate(shape, seq, cluster, cand, mfu, chunk, rates=rates, stack=stack)
        if problems := refused(cand):  # the trainer would not start it: say why beside what does not fit
            yours = replace(yours, fits=False, why_not=[*yours.why_not, *(f"refused: {p}" for p in problems)])
    schedule = Schedule.of(cfg).describe(max_steps_for(cfg, bp))
    return Forecast(config_path, shape, seq, source, bp, cluster, yours, found, schedule, stack)


@dataclass
class RunMeasured:
    tokens_per_s: float
    step_time_s: float
    peak_memory_gib: float
    memory_kind: str
    records: int
    optimizer_s: float | None = None
    """Median seconds of the optimizer step (metrics.jsonl `optimizer_s`); None in runs from before it was logged."""
    steps: int = 0
    """Training steps the medians cover."""


def measured(run_dir: Path, tokens_per_step: int) -> RunMeasured:
    """The run's step time and throughput (medians over log lines, the first one left out as warm-up when there
    are more: the trainer's own `step_s` when logged, else from tokens/s), its optimizer step, and its peak memory
    (GPU: max_memory_allocated; CPU: the process's peak RSS)."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        raise PipelineError(f"{run_dir}: no metrics.jsonl yet; let the run log a few steps first")
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    rows = [r for r in rows if r.get("tokens_per_s")]
    if not rows:
        raise PipelineError(f"{path}: no training steps logged yet")
    steady = rows[1:] if len(rows) > 1 else rows
    timed = [r["step_s"] for r in steady if r.get("step_s")]
    step_s = (
        statistics.median(timed) if timed else tokens_per_step / statistics.median(r["tokens_per_s"] for r in steady)
    )
    opt = [r["optimizer_s"] for r in steady if r.get("optimizer_s")]
    steps = steady[-1]["step"] - (rows[0]["step"] if len(rows) > 1 else 0)
    return RunMeasured(
        tokens_per_step / step_s,
        step_s,
        max(r.get("mem_gib", 0.0) for r in rows),
        "",
        len(rows),
        statistics.median(opt) if opt else None,
        steps,
    )


def run_rates(f: Forecast, got: RunMeasured, env: dict[str, Any]) -> tuple[Rates | None, list[str]]:
    """The rates that reproduce the run's own step in the model (pipeline.plan.timing.rates_from_run), for the
    next plan of this cluster; None for a CPU run, whose time the GPU model does not describe."""
    if env.get("device", "cpu") == "cpu":
        return None, ["a CPU run measures no GPU rates: plans keep the fitted ones"]
    label = f"run {Path(f.config).parent}, {got.steps} steps"
    m = Measured(got.step_time_s, got.optimizer_s, label)
    return rates_from_run(f.shape, f.seq_len, f.cluster, f.yours.layout, f.stack, m)


def forecast_run(
    run_dir: str, cluster: Cluster | None, *, mfu: float | None
) -> tuple[Forecast, RunMeasured, dict[str, Any]]:
    """The plan for exactly what a run ran (its resolved config and DeepSpeed JSON, on the cluster it recorded)
    beside what it measured."""
    from pipeline.train.setup.prepare import cpu_card

    rd = Path(run_dir)
    for name in ("config.yaml", "ds_config.json"):
        if not (rd / name).is_file():
            raise PipelineError(f"{rd}: no {name}; not a run folder of `pipeline pretrain` (or it has not started)")
    env: dict[str, Any] = {}
    if (rd / "environment.json").exists():
        env = json.loads((rd / "environment.json").read_text())
    run_config_text(rd)  # refused, naming it, when it is not what the run wrote
    cfg = load(rd / "config.yaml")
    ds = json.loads((rd / "ds_config.json").read_text())
    sp = cfg.train.sequence_parallel
    replicas = int(ds["train_batch_size"]) // (
        int(ds["train_micro_batch_size_per_gpu"]) * int(ds["gradient_accumulation_steps"])
    )
    world = replicas * sp
    if cluster is None:
        if not env:
            raise PipelineError(
                f"{rd}: no environment.json (a run from before runs recorded their cluster); give "
                "--gpu and --hostfile (or --nodes and --gpus-per-node)"
            )
        per_node = int(env.get("ranks_per_node") or world)
        ram = int(env.get("host_ram_bytes") or 512 * 10**9)
        if env.get("device", "cpu") == "cpu":
            card = cpu_card(ram, per_node)
        else:
            try:
                card = lookup(env["device"])
            except KeyError:
                raise PipelineError(
                    f"{rd}/environment.json: no planner data for GPU '{env['device']}'; give --gpu"
                ) from None
            if env.get("device_memory_bytes"):
                card = replace(card, memory_gib=env["device_memory_bytes"] / 2**30)
        cluster = Cluster(max(1, world // per_node), per_node, card, ram, cpu_cores=int(env.get("cpu_cores") or 32))
    if cluster.world != world:
        raise PipelineError(f"{rd}: the run had {world} ranks, the cluster given has {cluster.world}")
    shape, seq, source, _ = shape_and_seq(cfg, None, None, 32000)
    cluster = replace(cluster, gpu=capped(cluster.gpu, cfg.train.gpu_memory_cap_gib))
    bp = BatchPlan(
        int(ds["train_micro_batch_size_per_gpu"]),
        replicas,
        int(ds["gradient_accumulation_steps"]),
        int(ds["train_batch_size"]),
        seq,
        sp,
    )
    chunk = cfg.train.loss_chunk_tokens or loss_chunk_tokens(shape.vocab_size)
    moments = OPTIMIZERS[cfg.optim.name].moment_bytes
    checkpointing = cfg.train.activation_checkpointing
    cand = layout_from_ds(ds, bp.micro_batch_size, bp.grad_accum, checkpointing, moments, sp, cfg.train.tiled_mlp)
    # whole documents on the attention path the run took (environment.json says since 2026-12-07)
    whole, varlen = whole_documents(cfg), (env.get("speed") or {}).get("attention_masks") == "varlen"
    stack = (
        trainer_stack(cfg.train.compile, cfg.train.kernels, cfg.train.fp8, whole, varlen)
        if env.get("device", "cpu") != "cpu"
        else Stack(whole_documents=whole, varlen=varlen)
    )
    yours = estimate(shape, seq, cluster, cand, mfu, chunk, stack=stack)
    found = search(shape, seq, cluster, bp.tokens_per_step, mfu, loss_chunk_tokens=chunk, stack=stack)
    got = measured(rd, bp.tokens_per_step)
    got.memory_kind = (
        "peak RSS per process (CPU run)" if env.get("device", "cpu") == "cpu" else "torch.cuda.max_memory_allocated"
    )
    forecast = Forecast(str(rd / "config.yaml"), shape, seq, source, bp, cluster, yours, found, stack=stack)
    return forecast, got, env


def calibration(run_dir: str, cluster: Cluster | None) -> tuple[Rates, Cluster, list[str]]:
    """`plan --from-run RUN --model/--config`: the rates RUN measured and the cluster to plan (RUN's own unless
    one is given; a plan for another GPU is refused: the rates describe RUN's cards and hosts). A given cluster
    of RUN's size is taken to be RUN's (its hostfile knows more of the hosts than environment.json)."""
    f, got, env = forecast_run(run_dir, None, mfu=None)
    if cluster is not None and cluster.world == f.cluster.world:
        f, got, env = forecast_run(run_dir, cluster, mfu=None)
    rates, notes = run_rates(f, got, env)
    if rates is None:
        raise PipelineError(f"{run_dir}: {notes[0]}; plan without --from-run")
    run_gpu = lookup(env["device"]).name
    if cluster is not None and cluster.gpu.name != run_gpu:
        raise PipelineError(
            f"--from-run {run_dir} measured {run_gpu}; this plan is for {cluster.gpu.name}: the rates do not carry "
            "over to another card. Plan without --from-run, or from a run on these cards"
        )
    return rates, cluster or f.cluster, notes
