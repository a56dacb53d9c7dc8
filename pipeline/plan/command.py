"""`pipeline plan` as one call: what the options ask (`PlanRequest`) -> the report, printed through `echo`, and the
exit code (0 fits, 3 nothing fits). The CLI only parses. Here: a model's plan and the fits table
(docs/planning.md); the modes that read a run or a config (`--from-run`, `--config`) are
pipeline.train.forecast_report.plan_command, the one entry of `pipeline plan`, which ends here."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import replace

from pipeline.errors import PipelineError
from pipeline.plan import report as plan_report
from pipeline.plan import search as planner
from pipeline.plan.cluster import TRAINER, Cluster
from pipeline.plan.ds_json import write_ds_config
from pipeline.plan.facts import cluster_from_flags
from pipeline.plan.request import PlanRequest
from pipeline.plan.timing import Rates
from pipeline.units import parse_count

Echo = Callable[..., None]
"""click.echo's shape: echo(text, err=False)."""


def token_amounts(tokens: str, global_batch_tokens: str) -> tuple[float, int]:
    """--tokens (1B, 100bn, 500M) and --global-batch-tokens (4M, 512K) as numbers of tokens."""
    try:
        budget = parse_count(tokens)
        gbt = int(parse_count(global_batch_tokens))
    except ValueError as e:
        raise PipelineError(str(e)) from None
    for flag, value in (("--global-batch-tokens", gbt), ("--tokens", budget)):
        if not value > 0:
            raise PipelineError(f"{flag} {value:g}: expected a positive amount")
    return budget, gbt


def plan_model_or_table(
    req: PlanRequest, echo: Echo, cluster: Cluster | None = None, rates: Rates | None = None
) -> int:
    """`pipeline plan` for a model (a preset or a Hugging Face config), or the tables of docs/planning.md and
    docs/long-context.md; the exit code. `cluster` and `rates`: measured by a run (--from-run, read by
    pipeline.train.forecast_report.plan_command, the command's one entry)."""
    budget, gbt = token_amounts(req.tokens, req.global_batch_tokens)
    if req.fits_table:
        echo(plan_report.reference_fits_table(req.flags, req.vocab_size, req.seq_len or 4096, gbt, req.mfu, budget))
        return 0
    if req.long_context_table:
        echo(plan_report.long_context_table(req.flags, gbt, req.mfu))
        return 0
    source = ""
    if cluster is None:
        cluster, source = cluster_from_flags(req.hostfile, req.nodes, req.gpus_per_node, req.flags)
        if source and not req.as_json:
            echo(source)
    return plan_model(req, cluster, rates, budget, gbt, source, echo)


def varlen_on_cluster(setting: str, packages: frozenset[str] | None = None) -> bool:
    """--document-attention (train.document_attention) as the planner prices it: auto is varlen where flash-attn is
    installed on the nodes (`packages`, the cluster's facts; None: on the machine that plans)."""
    if setting == "auto":
        if packages is not None:
            return "flash-attn" in packages
        from pipeline.model.varlen import varlen_available

        return varlen_available("cuda")
    return setting == "varlen"


def plan_model(
    req: PlanRequest, cluster: Cluster, rates: Rates | None, budget: float, gbt: int, source: str, echo: Echo
) -> int:
    seq_len = req.seq_len or 4096
    shape, note = planner.planned_shape(req.model, req.layers, req.vocab_size, seq_len)
    if note:
        echo(note, err=True)
    if shape.hf_config and not req.as_json:
        echo(shape.describe())
    stack = replace(
        TRAINER,
        whole_documents=req.whole_documents,
        varlen=varlen_on_cluster(req.document_attention, cluster.installed),
        packages=cluster.installed,
    )
    p = planner.search(
        shape,
        seq_len,
        cluster,
        gbt,
        req.mfu,
        fixed_micro=req.micro_batch_size,
        rates=rates,
        opt_in=req.opt_in,
        stack=stack,
    )
    if req.write_ds_config and p.best is not None:
        write_ds_config(p.best, req.write_ds_config, req.flags.get("nvme"))
    echo(
        json.dumps(p.to_dict() | {"cluster_facts": source}, indent=2) if req.as_json else plan_report.render(p, budget)
    )
    if req.write_ds_config and p.best is not None and not req.as_json:
        b = p.best.layout
        echo(
            f"\nwrote {req.write_ds_config}; in the pretrain config set batch.micro_batch_size: "
            f"{b.micro_batch_size}, batch.global_batch_size: "
            f"{b.micro_batch_size * b.grad_accum * cluster.world // b.sequence_parallel}"
            f", train.activation_checkpointing: {str(b.activation_checkpointing).lower()}"
            + (f", train.sequence_parallel: {b.sequence_parallel}" if b.sequence_parallel > 1 else "")
            + (f", train.tiled_mlp: {b.tiled_mlp}" if b.tiled_mlp > 1 else "")
        )
    return 0 if p.best is not None else 3
