"""What `pipeline plan --config` and `--from-run` print: a config's plan beside what the search would choose, a
run's plan beside what it measured and the rates it measured, for people or as JSON; and `pipeline plan` itself,
which dispatches every mode. The forecasts are pipeline.train.forecast's."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pipeline.errors import PipelineError
from pipeline.plan.cluster import Cluster
from pipeline.plan.command import Echo, PlanRequest, plan_model_or_table, token_amounts
from pipeline.plan.estimate import estimate, estimate_dict
from pipeline.plan.facts import cluster_from_flags, probe_in_use
from pipeline.plan.report import describe_estimate, header
from pipeline.plan.timing import Rates
from pipeline.train.forecast import Forecast, RunMeasured, calibration, forecast_config, forecast_run, run_rates
from pipeline.train.measured_slices import beside_plan


def render_config(f: Forecast, token_budget: float | None = None) -> str:
    """`pipeline plan --config`: does this run fit, with what margin, how fast, and what the search would choose."""

    e, best = f.yours, f.search.best
    lines = header(f.search) + [f"config {f.config}; seq_len {f.seq_len} from {f.seq_len_from}"]
    lines += [f.schedule] if f.schedule else []
    lines += describe_estimate(f.search, e, token_budget, title="your config")
    refused = any(w.startswith("refused: ") for w in e.why_not)
    verdict = "FITS" if e.fits else "REFUSED BY THE TRAINER (above)" if refused else "DOES NOT FIT"
    free = f.cluster.gpu.memory_gib - (e.gpu["reserved"] + e.gpu["margin"]) / 2**30
    lines.append(
        f"\n{verdict}: {free:+.2f} GiB per GPU beyond the {e.gpu['margin'] / 2**30:.2f} GiB margin; host RAM "
        f"{e.host['total'] / 1e9:.0f} of {0.8 * f.cluster.cpu_mem_bytes / 1e9:.0f} GB allowed per node"
    )
    if best is None:
        lines.append("the search finds nothing that fits this cluster: " + "; ".join(f.search.advice))
    elif best.layout == e.layout:
        lines.append("the search would choose the same configuration")
    else:
        lines.append(
            f"the search would choose: {best.layout.label()} (buckets {best.layout.reduce_bucket:.0e}/"
            f"{best.layout.prefetch_bucket:.0e}/{best.layout.max_live:.0e}): "
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
        f"run {Path(f.config).parent}: {f.yours.layout.label()}, {f.cluster.nodes} node(s) x "
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
    probe: Path | None = None,
) -> tuple[str, bool]:
    """`plan --config`: that run's plan beside what the search would choose, for people or as JSON; and whether
    it fits. `rates`: measured by a run (`--from-run`); `probe`: the node's probe file, whose slices of this
    config's model (`pipeline probe --config`) are shown beside the plan."""

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
    slice_lines, slices = beside_plan(config_path, sets, probe, cluster, mfu)
    if not as_json:
        return "\n".join([render_config(fc, budget), *slice_lines]), fc.yours.fits
    doc = {
        "config": config_path,
        "seq_len": fc.seq_len,
        "fits": fc.yours.fits,
        "yours": estimate_dict(fc.yours),
        "search_best": estimate_dict(fc.search.best) if fc.search.best else None,
        "measured_slices": slices,
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
    e = estimate(f.shape, f.seq_len, f.cluster, f.yours.layout, rates=rates, stack=f.stack)
    given = dict(rates.sources)
    return [a for a in e.assumed if a[0] in given]


def plan_command(req: PlanRequest, echo: Echo) -> int:
    """`pipeline plan`, every mode; the exit code. Here: `--from-run RUN` (the run's plan beside what it measured;
    with --model or --config, that planned at the run's rates on its cluster) and `--config FILE`; a model's plan
    and the tables are pipeline.plan.command.plan_model_or_table's."""
    if not (req.config or req.from_run) or req.fits_table or req.long_context_table:
        return plan_model_or_table(req, echo)
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
        return plan_model_or_table(req, echo, cluster, rates)
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
        probe=probe_in_use(req.hostfile, req.flags),
    )
    echo(text)
    return 0 if fits else 3
