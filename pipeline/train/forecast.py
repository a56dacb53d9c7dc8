"""What the planner says of one training config (`pipeline plan --config`) and of a finished or running run beside
what it measured (`pipeline plan --from-run`). Lives in train/ because it reads training configs and runs; the
arithmetic is pipeline.plan's."""

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
from pipeline.plan import command as plan_command
from pipeline.plan.cluster import Cluster, Stack, cluster_from_flags
from pipeline.plan.command import Echo, PlanRequest, token_amounts
from pipeline.plan.ds_json import candidate_from_ds
from pipeline.plan.estimate import Estimate, estimate, estimate_dict
from pipeline.plan.gpus import capped, lookup
from pipeline.plan.report import describe_estimate, header
from pipeline.plan.search import Plan, search
from pipeline.plan.timing import Measured, Rates, rates_from_run
from pipeline.train.setup.config import PretrainConfig, load
from pipeline.train.setup.ds_config import BatchPlan, batch_plan, load_ds_config
from pipeline.train.setup.optimizers import OPTIMIZERS


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
    shape = model_shape(cfg.model.preset, dict(cfg.model.shape), cfg.model.init_from, vocab, seq)
    if layers:
        shape = replace(shape, num_layers=layers)
    return shape, seq, source, vocab


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
    found = search(shape, seq, cluster, bp.tokens_per_step, mfu, loss_chunk_tokens=chunk, rates=rates, opt_in=opt_in)
    if cfg.train.deepspeed_config == "auto":
        if found.best is None:
            raise PipelineError("train.deepspeed_config auto: nothing fits this cluster; " + "; ".join(found.advice))
        yours = found.best
    else:
        cand = candidate_from_ds(
            load_ds_config(cfg.train.deepspeed_config),
            bp.micro_batch_size,
            bp.grad_accum,
            cfg.train.activation_checkpointing,
            OPTIMIZERS[cfg.optim.name].moment_bytes,
        )
        yours = estimate(shape, seq, cluster, cand, mfu, chunk, rates=rates)
    return Forecast(config_path, shape, seq, source, bp, cluster, yours, found)


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
    return rates_from_run(f.shape, f.seq_len, f.cluster, f.yours.candidate, Stack(), m)


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
    cfg = load(rd / "config.yaml")
    ds = json.loads((rd / "ds_config.json").read_text())
    world = int(ds["train_batch_size"]) // (
        int(ds["train_micro_batch_size_per_gpu"]) * int(ds["gradient_accumulation_steps"])
    )
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
        world,
        int(ds["gradient_accumulation_steps"]),
        int(ds["train_batch_size"]),
        seq,
    )
    chunk = cfg.train.loss_chunk_tokens or loss_chunk_tokens(shape.vocab_size)
    moments = OPTIMIZERS[cfg.optim.name].moment_bytes
    cand = candidate_from_ds(ds, bp.micro_batch_size, bp.grad_accum, cfg.train.activation_checkpointing, moments)
    yours = estimate(shape, seq, cluster, cand, mfu, chunk)
    found = search(shape, seq, cluster, bp.tokens_per_step, mfu, loss_chunk_tokens=chunk)
    got = measured(rd, bp.tokens_per_step)
    got.memory_kind = (
        "peak RSS per process (CPU run)" if env.get("device", "cpu") == "cpu" else "torch.cuda.max_memory_allocated"
    )
    return Forecast(str(rd / "config.yaml"), shape, seq, source, bp, cluster, yours, found), got, env


def render_config(f: Forecast, token_budget: float | None = None) -> str:
    """`pipeline plan --config`: does this run fit, with what margin, how fast, and what the search would choose."""

    e, best = f.yours, f.search.best
    lines = header(f.search) + [f"config {f.config}; seq_len {f.seq_len} from {f.seq_len_from}"]
    lines += describe_estimate(f.search, e, token_budget, title="your config")
    verdict = "FITS" if e.fits else "DOES NOT FIT"
    free = f.cluster.gpu.memory_gib - (e.gpu["reserved"] + e.gpu["margin"]) / 2**30
    lines.append(
        f"\n{verdict}: {free:+.2f} GiB per GPU beyond the {e.gpu['margin'] / 2**30:.2f} GiB margin; host RAM "
        f"{e.host['total'] / 1e9:.0f} of {0.8 * f.cluster.cpu_mem_bytes / 1e9:.0f} GB allowed per node"
    )
    if best is None:
        lines.append("the search finds nothing that fits this cluster: " + "; ".join(f.search.advice))
    elif best.candidate == e.candidate:
        lines.append("the search would choose the same configuration")
    else:
        lines.append(
            f"the search would choose: {best.candidate.label()} (buckets {best.candidate.reduce_bucket:.0e}/"
            f"{best.candidate.prefetch_bucket:.0e}/{best.candidate.max_live:.0e}): "
            f"{best.tokens_per_s:,.0f} tokens/s ({best.tokens_per_s / e.tokens_per_s:.2f}x yours), "
            f"{best.gpu['reserved'] / 2**30:.1f} GiB reserved; --write-ds-config writes it"
        )
    if notes := f.search.feature_notes():
        lines.append("DeepSpeed 0.19 offload features (each against the search's choice; planned, not measured):")
        lines += [f"  {n}" for n in notes]
    return "\n".join(lines)


def comparison(f: Forecast, got: RunMeasured) -> dict[str, Any]:
    e = f.yours
    rows = {
        "peak_memory_gib": (e.gpu["peak_allocated"] / 2**30, got.peak_memory_gib),
        "step_time_s": (e.step_time_s, got.step_time_s),
        "tokens_per_s": (e.tokens_per_s, got.tokens_per_s),
    }
    return {k: {"predicted": p, "measured": m, "ratio": m / p if p else None} for k, (p, m) in rows.items()} | {
        "step_time_range_s": list(e.step_time_range_s),
        "tokens_per_s_range": list(e.tokens_per_s_range),
        "memory_measured_as": got.memory_kind,
        "log_lines": got.records,
    }


def render_run(f: Forecast, got: RunMeasured, env: dict[str, Any]) -> str:
    """`pipeline plan --from-run`: the plan for exactly this run beside what it measured."""
    c = comparison(f, got)
    lo, hi = f.yours.step_time_range_s
    lines = [
        f"run {Path(f.config).parent}: {f.yours.candidate.label()}, {f.cluster.nodes} node(s) x "
        f"{f.cluster.gpus_per_node} {f.cluster.gpu.name}, seq {f.seq_len}, "
        f"{f.batch.tokens_per_step:,} tokens per step ({got.records} log lines)",
        "",
        f"{'':24s} {'planned':>12s} {'measured':>12s} {'measured/planned':>17s}",
    ]
    for key, label in (
        ("peak_memory_gib", "peak memory GiB"),
        ("step_time_s", "step time s"),
        ("tokens_per_s", "tokens/s"),
    ):
        row = c[key]
        lines.append(f"{label:24s} {row['predicted']:12,.3f} {row['measured']:12,.3f} {row['ratio']:17.2f}")
    lines += [
        f"\nplanned step time range {lo:,.3f}-{hi:,.3f} s; memory measured as {got.memory_kind}, planned as "
        "live tensors at the peak (torch.cuda.max_memory_allocated)"
    ]
    if env.get("device", "cpu") == "cpu":
        lines.append(
            "a CPU run: the planner's GPU model (MFU, PCIe, a nominal 0.5 TF per rank) does not describe "
            "it; the comparison checks the plumbing. On GPUs, ratios near 1 mean the plan for the rest of "
            "the cluster can be trusted; far from 1, plan the next run with --from-run: it runs at the rates "
            "this run measured."
        )
    return "\n".join(lines)


def config_report(
    config_path: str,
    sets: list[str],
    cluster: Cluster,
    *,
    seq_len: int | None,
    layers: int | None,
    vocab_size: int,
    mfu: float | None,
    budget: float,
    as_json: bool,
    rates: Rates | None = None,
    opt_in: frozenset[str] = frozenset(),
) -> tuple[str, bool]:
    """`plan --config`: that run's plan beside what the search would choose, for people or as JSON; and whether
    it fits. `rates`: measured by a run (`--from-run`)."""

    fc = forecast_config(
        config_path,
        sets,
        cluster,
        seq_len=seq_len,
        layers=layers,
        vocab_size=vocab_size,
        mfu=mfu,
        rates=rates,
        opt_in=opt_in,
    )
    if not as_json:
        return render_config(fc, budget), fc.yours.fits
    doc = {
        "config": config_path,
        "seq_len": fc.seq_len,
        "fits": fc.yours.fits,
        "yours": estimate_dict(fc.yours),
        "search_best": estimate_dict(fc.search.best) if fc.search.best else None,
    }
    return json.dumps(doc, indent=2), fc.yours.fits


def run_report(run_dir: str, cluster: Cluster | None, *, mfu: float | None, as_json: bool) -> str:
    """`plan --from-run`: the plan for exactly that run beside what it measured, and the rates it measured, for
    people or as JSON."""
    f, got, env = forecast_run(run_dir, cluster, mfu=mfu)
    rates, notes = run_rates(f, got, env)
    if as_json:
        doc = comparison(f, got) | {"measured_rates": rates_dict(rates), "notes": notes}
        return json.dumps(doc, indent=2)
    lines = [render_run(f, got, env), ""]
    if rates is not None and rates.sources:
        lines.append("rates this run measured (what the next plan with --from-run uses):")
        lines += [f"  {name}: {value} ({how})" for name, value, how in measured_rate_lines(f, rates)]
        lines.append(
            f"  plan another model or config on this cluster with them: pipeline plan --from-run {run_dir} "
            "--model NAME (or --config FILE)"
        )
    lines += [f"note: {n}" for n in notes]
    return "\n".join(lines)


def rates_dict(rates: Rates | None) -> dict[str, Any] | None:
    if rates is None:
        return None
    return {
        "efficiency_scale": rates.efficiency_scale,
        "offload_node_gbs": rates.offload_node_gbs,
        "cpu_adam_params_per_s": rates.cpu_adam_params_per_s,
        "sources": dict(rates.sources),
    }


def measured_rate_lines(f: Forecast, rates: Rates) -> list[tuple[str, str, str]]:
    """(figure, value, source) for the rates a run measured, as the plan with them reports them."""
    e = estimate(f.shape, f.seq_len, f.cluster, f.yours.candidate, rates=rates)
    given = dict(rates.sources)
    return [a for a in e.assumed if a[0] in given]


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


def plan(req: PlanRequest, echo: Echo) -> int:
    """`pipeline plan`, every mode; the exit code. Here: `--from-run RUN` (the run's plan beside what it measured;
    with --model or --config, that planned at the run's rates on its cluster) and `--config FILE`; a model's plan
    and the fits table are pipeline.plan.command.plan's."""
    if not (req.config or req.from_run) or req.fits_table:
        return plan_command.plan(req, echo)
    budget, _ = token_amounts(req.tokens, req.global_batch_tokens)
    cluster, source = cluster_from_flags(req.hostfile, req.nodes, req.gpus_per_node, req.flags)
    rates = None
    if req.from_run:
        asked = cluster if req.cluster_given else None
        if not (req.config or req.model_given):
            echo(run_report(req.from_run, asked, mfu=req.mfu, as_json=req.as_json))
            return 0
        if req.mfu is not None:
            raise PipelineError("give one of --mfu and --from-run: both set the compute efficiency")
        rates, cluster, notes = calibration(req.from_run, asked)
        source = f"rates and cluster measured by --from-run {req.from_run}" + ("; " + "; ".join(notes) if notes else "")
    if source and not req.as_json:
        echo(source)
    if not req.config:
        return plan_command.plan(req, echo, cluster, rates)
    text, fits = config_report(
        req.config,
        list(req.sets),
        cluster,
        seq_len=req.seq_len,
        layers=req.layers,
        vocab_size=req.vocab_size,
        mfu=req.mfu,
        budget=budget,
        as_json=req.as_json,
        rates=rates,
        opt_in=req.opt_in,
    )
    echo(text)
    return 0 if fits else 3
