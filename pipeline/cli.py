"""`pipeline` command line: each command parses its options, builds a config and calls one stage's run().

Each option is declared once: a stage's options are its config dataclass's fields (`@config_options(TokenizeConfig)`
generates them from each field's type, default, range and docstring; `config_from` builds the config back), so a new
field is a new option with no edit here; the few options that are no config's field are in pipeline/options.py."""

from __future__ import annotations

import functools
import json
import logging
import sys
from typing import Any

import click

from pipeline.data.config import CurateOptions, ShardConfig, TokenizeConfig, VocabConfig
from pipeline.errors import PipelineError
from pipeline.evaluate.config import EvalConfig, ExportConfig, HarnessConfig
from pipeline.options import (
    AS_JSON,
    HOSTFILE,
    MASTER_PORT,
    PATH,
    SCHEDULER,
    SETS,
    WHERE,
    Decorator,
    config_from,
    config_option,
    config_options,
    given_on_command_line,
    group,
    opt,
    user_errors,
)
from pipeline.plan.cluster import OPT_IN
from pipeline.plan.facts import CLUSTER_DEFAULTS, NODE_FACTS
from pipeline.plan.request import PlanRequest, ProbeRequest


def command(**settings: Any) -> Decorator:
    """A `pipeline` command whose user errors are one line (`user_errors`)."""
    return lambda fn: main.command(**settings)(user_errors(fn))


def _where(options: dict[str, Any]) -> Any:
    from pipeline.launch.command import Where

    return Where(**{k: options.pop(k) for k in ("hostfile", "num_gpus", "master_port")})


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("-v", "--verbose", is_flag=True, help="Debug logging.")
@click.version_option(package_name="pipeline")
def main(verbose: bool) -> None:
    """Pretrain GPT/LLaMA-class models with DeepSpeed: curate -> tokenize -> shard -> pretrain -> evaluate, and plan."""
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO, format="%(message)s")


@command()
@click.argument("inputs", nargs=-1, required=True, type=PATH)
@click.option(
    "--output",
    required=True,
    type=PATH,
    help="Folder: documents/ (what tokenize reads), report.json, removed/ (every removed document, by reason).",
)
@config_options(CurateOptions)
def curate(inputs: tuple[str, ...], output: str, **options: Any) -> None:
    """Stage 0: remove duplicates, near duplicates, low-quality and contaminated documents from INPUT... (what
    tokenize reads) before tokenizing: quality filters, decontamination against
    evaluation files, exact and near-duplicate removal, on Hugging Face datatrove's steps and local executor. The
    same input and options keep the same documents; a re-run replaces OUTPUT whole."""
    from pipeline.data.curate import curate as curating

    curating(list(inputs), output, config_from(CurateOptions, options), echo=click.echo)


@command()
@config_options(TokenizeConfig)
def tokenize(**options: Any) -> None:
    """Tokenize INPUT... (.jsonl, .txt, .parquet, optionally .gz/.zst; folders; globs; save_to_disk datasets)
    into a Megatron indexed dataset."""
    from pipeline.data import tokenize as tokenizing

    click.echo(tokenizing.run(config_from(TokenizeConfig, options)).summary)


@command(name="extend-vocab")
@config_options(VocabConfig)
def extend_vocab(**options: Any) -> None:
    """Extend MODEL_DIR's tokenizer with pieces of a new corpus (INPUT...) and its embeddings to match: a
    Hugging Face model folder to continue on a language its tokenizer splits into many tokens."""
    from pipeline.data.vocab import extend_vocabulary

    click.echo(extend_vocabulary(config_from(VocabConfig, options)).summary)


@command()
@click.argument("sources", nargs=-1, type=PATH)
@config_options(ShardConfig, optional=("output", "seq_len"))
@click.option("--inspect", "inspect_dir", default=None, type=PATH, help="Print the summary of a shard folder.")
@click.option(
    "--model",
    "model_dir",
    default=None,
    help="The Hugging Face model folder these shards will continue: refuse data whose tokenizer is not that model's.",
)
def shard(sources: tuple[str, ...], inspect_dir: str | None, model_dir: str | None, **options: Any) -> None:
    """Pack, split, blend and shuffle tokenized PREFIX[:WEIGHT]... into fixed-length training shards."""
    from pipeline.data import shard as shard_stage

    if inspect_dir:
        click.echo(shard_stage.describe(inspect_dir))
        return
    click.echo(shard_stage.command(sources, options, model_dir, given_on_command_line("cross_document")))


@command()
@config_option(required=True, help="Pretrain YAML config (see configs/).")
@WHERE
@SETS
@click.option(
    "--dry-run", is_flag=True, help="Resolve and print the config, batch plan and DeepSpeed JSON; no training."
)
@SCHEDULER
@opt(
    "--max-restarts",
    type=click.IntRange(0, 1000),
    default=0,
    help="Relaunch after a failed launch (a rank killed, a node lost, a hung peer), each time from the "
    "latest complete checkpoint. Not after a mistake in the input or a stop on a non-finite loss (exit 2).",
)
@opt(
    "--min-nodes",
    type=click.IntRange(1),
    default=None,
    help="With --sbatch: the job may start on, or be requeued onto, as few nodes. With --hostfile: when hosts "
    "stop answering ssh, go on with the hosts that do if there are at least this "
    "many and the plan for them fits (same global batch, resumed through the universal checkpoint); a host that "
    "answers again is taken back at the next launch; needs --max-restarts. Without it a lost host stops the run, "
    "naming it.",
)
@click.option(
    "--skip-doctor",
    is_flag=True,
    help="Launch even when the quick local checks of `pipeline doctor` (/dev/shm, the master port, disk, data) fail.",
)
def pretrain(config: str, sets: tuple[str, ...], **options: Any) -> None:
    """Check the config, data and DeepSpeed JSON here (a bad one fails in a second, with only our message), run
    the quick local checks of `pipeline doctor`, then build the `deepspeed ... pipeline/pretrain.py` command line,
    print it, and run it (again, with --max-restarts). Before a multi-node run: `pipeline doctor --hostfile H`.

    \b
    Speed on a GPU, by default (the run's log says what each resolved to, and why):
      train.compile    null: compiled decoder layers with ZeRO 0-2 (1.32x on an H200), eager with ZeRO-3
      train.attention  auto: the fastest SDPA backend timed at the model's shape at start (flash, cudnn, ...)
      train.kernels    auto: Liger Kernel's fused kernels where layers are not compiled (pip install -e '.[gpu]')
      train.document_attention  auto: whole documents and sliding windows kept by FlashAttention-2's varlen kernel
                       without a (seq x seq) mask where flash_attn is installed (pip install -e '.[flash]'), else
                       SDPA with the dense mask (not under sequence parallelism)
    e.g. --set train.compile=false --set train.attention=flash --set train.kernels=torch"""
    from pipeline import launch
    from pipeline.launch.scheduler import Scheduled

    scheduled = Scheduled(**{k: options.pop(k) for k in Scheduled.__dataclass_fields__})
    where = _where(options)
    sys.exit(launch.pretrain(config, list(sets), where, scheduled=scheduled, **options))


@command()
@config_options(EvalConfig)
@WHERE
@click.option("--launched", is_flag=True, hidden=True, help="Set by the launcher: this process is one rank.")
def evaluate(launched: bool, **options: Any) -> None:
    """Held-out loss, perplexity and bits per byte of a checkpoint, sample continuations, and RUN_DIR/loss.png.

    One process by default (bf16 on a GPU). With --num-gpus or --hostfile, the `deepspeed` launcher starts one
    rank per GPU and the model is split across them with ZeRO-3 (70B on the training cluster); the results file
    is the same."""
    from pipeline.evaluate import run as stage

    where = _where(options)
    cfg = config_from(EvalConfig, options)
    if launched:  # this process is one rank of the launch below
        from pipeline.evaluate.distributed import evaluate_on_rank
        from pipeline.train.runtime.dist import exit_now

        evaluate_on_rank(cfg)  # rank 0 writes the results file; the command that launched the ranks prints it
        exit_now(0)
    if not (where.num_gpus or where.hostfile):
        click.echo(stage.table(stage.run(cfg)))
        return
    if cfg.baseline:
        raise PipelineError(
            "--baseline evaluates the base and the continued model one after the other in one process (--device); "
            "across GPUs (--num-gpus, --hostfile) it is not built yet: evaluate the base's export separately"
        )
    from pipeline import launch

    click.echo(stage.table(launch.evaluate(cfg, where)))


@command()
@click.argument("run_dir", type=PATH)
@click.option("--output", type=PATH, default=None, help="The HTML page to write (default RUN_DIR/report.html).")
def report(run_dir: str, output: str | None) -> None:
    """One self-contained HTML page for RUN_DIR (inline SVG plots, opens offline) and its figures as JSON beside
    it: the training curves (loss, each source's validation loss, learning rate, tokens/s, MFU), every evaluation
    of the run in RUN_DIR/eval (by source, against the base model with --baseline, the needle test), the config
    and the environment."""
    from pipeline.evaluate.report import write_report

    page, figures = write_report(run_dir, output)
    click.echo(f"wrote {page} (figures: {figures})")


@command()
@config_options(ExportConfig)
def export(**options: Any) -> None:
    """Export a checkpoint (or the mean of several, --average) to a Hugging Face model folder (safetensors,
    config, tokenizer), and with --gguf to GGUF files llama.cpp runs."""
    from pipeline.evaluate.export import export_command

    for line in export_command(config_from(ExportConfig, options)):
        click.echo(line)


@command()
@config_options(HarnessConfig)
def harness(**options: Any) -> None:
    """Run EleutherAI's lm-evaluation-harness on a checkpoint: exported to RUN_DIR/export/TAG when that export is
    missing or stale, results in RUN_DIR/eval/TAG-lm-eval."""
    from pipeline.evaluate.harness import run_harness

    code, output = run_harness(config_from(HarnessConfig, options))
    if code != 0:
        raise PipelineError(f"lm_eval failed (exit code {code}); see its output above")
    click.echo(f"harness results: {output}")


@command()
@HOSTFILE
@config_option(
    required=False,
    help="The pretrain config about to run: its data, run folder, NVMe path and the plan's host RAM and checkpoint "
    "size are checked on each host.",
)
@SETS
@MASTER_PORT
@opt(
    "--timeout",
    default=60.0,
    help="Seconds per host for each step (ssh, checks, all-reduce).",
    type=click.FloatRange(1),
)
@AS_JSON
@click.option(
    "--write-env",
    is_flag=True,
    help="Add what the checks found (NCCL_SOCKET_IFNAME, GLOO_SOCKET_IFNAME, "
    "NCCL_P2P_DISABLE, NCCL_IB_DISABLE) to .deepspeed_env here; lines already there are kept.",
)
@click.option(
    "--slurm",
    is_flag=True,
    help="Inside a Slurm allocation (salloc, a job script): check its nodes, reached as job steps (srun), not ssh.",
)
def doctor(config: str | None, sets: tuple[str, ...], master_port: int | None, **o: Any) -> None:
    """Check a cluster before a long run: per host (every host of --hostfile or of this Slurm allocation with
    --slurm; default this machine) PASS / WARN /
    FAIL with the reason and the fix (ssh, same venv and versions, DeepSpeed ops, GPUs and P2P, the network
    interface and a measured all-reduce, ulimit -l, /dev/shm, RAM, disk, data, master port). Exit code 1 when a
    check fails."""
    from pipeline.doctor import cluster as doc

    say = functools.partial(click.echo, err=True)
    if o["slurm"] and o["hostfile"]:
        raise PipelineError("--slurm checks the nodes of this Slurm allocation; --hostfile names other hosts: give one")
    reports = doc.run(o["hostfile"], config, list(sets), master_port or 29500, o["timeout"], say, o["slurm"])
    click.echo(json.dumps([r.to_dict() for r in reports], indent=2) if o["as_json"] else doc.table(reports))
    if o["write_env"]:
        for line in doc.write_found_env(reports):
            click.echo(line, err=True)
    sys.exit(1 if doc.failed(reports) else 0)


@command()
@config_options(PlanRequest)
@group(
    *(
        click.option(f"--{k.replace('_', '-')}", default=None, show_default=CLUSTER_DEFAULTS[k], help=v)
        for k, v in NODE_FACTS.items()
    )
)
@click.option(
    "--opt-in",
    multiple=True,
    type=click.Choice(sorted(OPT_IN)),
    help="Let the choice use a DeepSpeed 0.19 offload feature that changes the numerics (repeatable); without it "
    "each is priced and shown beside the choice. Activation offload, which does not, is always considered.",
)
def plan(**options: Any) -> None:
    """Will MODEL fit the cluster, how fast will it train, and which DeepSpeed config gets there. Memory is given as
    peak allocated (what torch.cuda.max_memory_allocated reports) and reserved (what the card must hold), with a
    margin; time as a point and a low-high range beside the physical ceiling. A hostfile's `# cluster:` line
    (see hostfiles/) gives the nodes' GPU, RAM, cores, memory bandwidth, disk and network; flags override it."""
    from pipeline.train.forecast_report import plan_command

    ctx = click.get_current_context()
    given = {k for k in ctx.params if ctx.get_parameter_source(k) != click.core.ParameterSource.DEFAULT}
    if code := plan_command(PlanRequest.from_options(options, given), click.echo):
        sys.exit(code)


@command()
@config_options(ProbeRequest)
def probe(**options: Any) -> None:
    """Measure on this node what `pipeline plan` otherwise assumes: host memory bandwidth, DeepSpeed's CPU Adam
    rate on its cores and, with a GPU, pinned copy and bf16 GEMM rates. Run it on one node of the cluster (about a
    minute); plans with the same --hostfile then use it and say which figures were measured. With --config, also
    the run's own model on this node's card(s) at 2 and 4 layers (a minute or two more), extrapolated to its depth."""
    from pipeline.launch.probe import probe as probing
    from pipeline.plan.probe import report

    req = config_from(ProbeRequest, options)
    doc, path = probing(req, (lambda _: None) if req.as_json else functools.partial(click.echo, err=True))
    click.echo(json.dumps(doc, indent=2)) if req.as_json else report(doc, path, click.echo)


if __name__ == "__main__":
    main()
