"""`pipeline` command line: each command parses its options, builds a config and calls one stage's run()."""

from __future__ import annotations

import functools
import json
import logging
import sys
from collections.abc import Callable
from typing import Any

import click

from pipeline.errors import PipelineError
from pipeline.plan.cluster import CLUSTER_DEFAULTS


def _user_errors(fn: Callable[..., Any]) -> Callable[..., Any]:
    """User errors become one line on stderr and exit code 2; no traceback."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except PipelineError as e:
            click.echo(f"error: {e}", err=True)
            sys.exit(2)
        except KeyboardInterrupt:
            click.echo("interrupted; no partial outputs were left under final names", err=True)
            sys.exit(130)
        except (click.exceptions.Exit, click.ClickException, SystemExit):
            raise
        except Exception:
            import traceback

            traceback.print_exc()
            click.echo(
                "error: an internal error, not a mistake in your input: this is a bug in pipeline; please "
                "report it with the traceback above",
                err=True,
            )
            sys.exit(1)

    return wrapper


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("-v", "--verbose", is_flag=True, help="Debug logging.")
@click.version_option(package_name="pipeline")
def main(verbose: bool) -> None:
    """Pretrain GPT/LLaMA-class models with DeepSpeed: tokenize -> shard -> pretrain -> evaluate, and plan."""
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO, format="%(message)s")


@main.command()
@click.argument("inputs", nargs=-1, required=True)
@click.option("--output-prefix", required=True, help="Writes PREFIX.bin, PREFIX.idx and PREFIX.manifest.json.")
@click.option(
    "--tokenizer",
    type=str,
    default=None,
    help="An existing sentencepiece .model file or a local Hugging Face tokenizer folder.",
)
@click.option(
    "--train-tokenizer",
    is_flag=True,
    help="Train a sentencepiece tokenizer on the inputs (saved as PREFIX.tokenizer.model).",
)
@click.option("--vocab-size", type=click.IntRange(300, 1_000_000), default=32000, show_default=True)
@click.option("--model-type", type=click.Choice(["bpe", "unigram"]), default="bpe", show_default=True)
@click.option(
    "--sample-docs",
    type=click.IntRange(min=1),
    default=100_000,
    show_default=True,
    help="Documents sampled (seeded) to train the tokenizer on.",
)
@click.option("--seed", type=int, default=1234, show_default=True)
@click.option("--text-key", default="text", show_default=True, help="JSON field / parquet column holding the text.")
@click.option(
    "--workers",
    type=click.IntRange(1, 512),
    default=1,
    show_default=True,
    help="Encoding processes; output is identical for any count.",
)
@click.option("--append-eos/--no-append-eos", default=True, show_default=True, help="End each document with </s>.")
@click.option(
    "--on-error",
    type=click.Choice(["skip", "fail"]),
    default="skip",
    show_default=True,
    help="skip: count bad records by reason and go on; fail: stop at the first (exit 2).",
)
@click.option(
    "--max-record-bytes",
    default="256MB",
    show_default=True,
    help="A JSON line is parsed whole; a longer one is a bad record (--on-error applies). .txt files "
    "and long texts are read and encoded in pieces whatever their size.",
)
@_user_errors
def tokenize(
    inputs: tuple[str, ...],
    output_prefix: str,
    tokenizer: str | None,
    train_tokenizer: bool,
    vocab_size: int,
    model_type: str,
    sample_docs: int,
    seed: int,
    text_key: str,
    workers: int,
    append_eos: bool,
    on_error: str,
    max_record_bytes: str,
) -> None:
    """Tokenize INPUT... (.jsonl, .txt, .parquet, optionally .gz/.zst; folders; globs; save_to_disk datasets)
    into a Megatron indexed dataset."""
    from pipeline.data import tokenize as tokenizing
    from pipeline.data.config import TokenizeConfig
    from pipeline.units import parse_size

    try:
        max_record = parse_size(max_record_bytes)
    except ValueError as e:
        raise PipelineError(f"--max-record-bytes: {e}") from None
    cfg = TokenizeConfig(
        inputs=inputs,
        output_prefix=output_prefix,
        tokenizer=tokenizer,
        train_tokenizer=train_tokenizer,
        vocab_size=vocab_size,
        model_type=model_type,
        sample_docs=sample_docs,
        seed=seed,
        text_key=text_key,
        workers=workers,
        append_eos=append_eos,
        on_error=on_error,
        max_record_bytes=max_record,
    )
    result = tokenizing.run(cfg)
    click.echo(result.summary)


def _parse_sources(specs: tuple[str, ...]) -> tuple[tuple[tuple[str, float], ...], bool]:
    out, given = [], False
    for spec in specs:
        prefix, sep, weight = spec.rpartition(":")
        if sep and prefix and not weight.replace(".", "", 1).isdigit():
            prefix, sep = spec, ""
        if sep and prefix:
            try:
                out.append((prefix, float(weight)))
                given = True
                continue
            except ValueError:
                pass
        out.append((spec, 1.0))
    return tuple(out), given


@main.command()
@click.argument("sources", nargs=-1)
@click.option("--output", "output", type=str, help="Folder for the shards and manifest.json.")
@click.option(
    "--seq-len",
    type=click.IntRange(8, 1_048_576),
    help="Tokens per training sample (each stores seq_len + 1 for the labels).",
)
@click.option("--split", default="98,1,1", show_default=True, help="train,val,test ratios, by document.")
@click.option("--seed", type=int, default=1234, show_default=True)
@click.option(
    "--num-shards", type=click.IntRange(min=1), default=None, help="Shards per split (default: by --shard-size)."
)
@click.option("--shard-size", default="512MB", show_default=True, help="Target bytes per shard file.")
@click.option(
    "--no-cross-document",
    is_flag=True,
    help="Never let a sample cross a document boundary: pad and mask the padding out of the loss.",
)
@click.option("--overwrite", is_flag=True, help="Replace shards made with other arguments.")
@click.option("--inspect", "inspect_dir", type=str, default=None, help="Print the summary of a shard folder.")
@click.option(
    "--model",
    "model_dir",
    type=str,
    default=None,
    help="The Hugging Face model folder these shards will continue: refuse data whose tokenizer is not that model's.",
)
@_user_errors
def shard(
    sources: tuple[str, ...],
    output: str | None,
    seq_len: int | None,
    split: str,
    seed: int,
    num_shards: int | None,
    shard_size: str,
    no_cross_document: bool,
    overwrite: bool,
    inspect_dir: str | None,
    model_dir: str | None,
) -> None:
    """Pack, split, blend and shuffle tokenized PREFIX[:WEIGHT]... into fixed-length training shards."""
    from pipeline.data import shard as shard_stage
    from pipeline.data.config import ShardConfig
    from pipeline.units import parse_size

    if inspect_dir:
        click.echo(shard_stage.describe(inspect_dir))
        return
    if not sources or not output or not seq_len:
        raise PipelineError("give PREFIX[:WEIGHT]..., --output DIR and --seq-len N (or --inspect DIR)")
    try:
        ratios = tuple(float(x) for x in split.split(","))
        size = parse_size(shard_size)
    except ValueError as e:
        raise PipelineError(f"--split/--shard-size: {e}") from None
    if len(ratios) != 3:
        raise PipelineError(f"--split {split}: expected three ratios train,val,test such as 98,1,1")
    parsed, given = _parse_sources(sources)
    if model_dir:
        from pipeline.data.manifest import read_tokenize_manifest
        from pipeline.data.tokenizer import check_tokenizer
        from pipeline.model import families

        model = families.shape_from_config(families.read_config(model_dir), model_dir)
        for prefix, _ in parsed:
            check_tokenizer(model, read_tokenize_manifest(prefix)["tokenizer"], f"{prefix}.manifest.json")
    cfg = ShardConfig(
        sources=parsed,
        output=output,
        seq_len=seq_len,
        split=ratios,  # type: ignore[arg-type]
        seed=seed,
        num_shards=num_shards,
        shard_size_bytes=size,
        cross_document=not no_cross_document,
        overwrite=overwrite,
        weights_given=given,
    )
    result = shard_stage.run(cfg)
    if result.skipped:
        click.echo(f"{output}: shards are up to date (fingerprint {result.manifest['fingerprint']}); nothing to do")
    else:
        click.echo(shard_stage.describe(output))


@main.command(context_settings={"ignore_unknown_options": True})
@click.option("--config", "config_path", required=True, help="Pretrain YAML config (see configs/).")
@click.option("--hostfile", default=None, help="DeepSpeed hostfile (multi-node; DeepSpeed reaches hosts by ssh).")
@click.option(
    "--num-gpus",
    type=click.IntRange(min=1),
    default=None,
    help="Ranks on this machine when no hostfile is given (CPU runs: processes).",
)
@click.option(
    "--master-port", type=click.IntRange(1, 65535), default=None, help="Rendezvous port (default: DeepSpeed's 29500)."
)
@click.option("--set", "sets", multiple=True, help="Override a config field: section.key=value (repeatable).")
@click.option(
    "--dry-run", is_flag=True, help="Resolve and print the config, batch plan and DeepSpeed JSON; no training."
)
@click.option(
    "--max-restarts",
    type=click.IntRange(0, 1000),
    default=0,
    show_default=True,
    help="Relaunch after a failed launch (a rank killed, a node lost, a hung peer), each time from the "
    "latest complete checkpoint. Not after a mistake in the input or a stop on a non-finite loss (exit 2).",
)
@click.option(
    "--skip-doctor",
    is_flag=True,
    help="Launch even when the quick local checks of `pipeline doctor` (/dev/shm, the master port, disk, data) fail.",
)
@_user_errors
def pretrain(
    config_path: str,
    hostfile: str | None,
    num_gpus: int | None,
    master_port: int | None,
    sets: tuple[str, ...],
    dry_run: bool,
    max_restarts: int,
    skip_doctor: bool,
) -> None:
    """Check the config, data and DeepSpeed JSON here (a bad one fails in a second, with only our message), run
    the quick local checks of `pipeline doctor`, then build the `deepspeed ... pipeline/pretrain.py` command line,
    print it, and run it (again, with --max-restarts). Before a multi-node run: `pipeline doctor --hostfile H`.

    \b
    Speed on a GPU, by default (the run's log says what each resolved to, and why):
      train.compile    null: compiled decoder layers with ZeRO 0-2 (1.32x on an H200), eager with ZeRO-3
      train.attention  auto: the fastest SDPA backend timed at the model's shape at start (flash, cudnn, ...)
      train.kernels    auto: Liger Kernel's fused kernels where layers are not compiled (pip install -e '.[gpu]')
    e.g. --set train.compile=false --set train.attention=flash --set train.kernels=torch"""
    from pipeline import launch

    where = launch.Where(hostfile=hostfile, num_gpus=num_gpus, master_port=master_port)
    sys.exit(
        launch.pretrain(
            config_path, list(sets), where, dry_run=dry_run, max_restarts=max_restarts, skip_doctor=skip_doctor
        )
    )


@main.command()
@click.option("--checkpoint", required=True, help="RUN_DIR (its latest complete checkpoint) or RUN_DIR/TAG.")
@click.option("--data", default=None, help="Shard folder (default: the run's own data.path).")
@click.option("--split", type=click.Choice(["val", "test", "train"]), default="val", show_default=True)
@click.option(
    "--max-batches", type=click.IntRange(min=1), default=None, help="Evaluate at most this many batches (default: all)."
)
@click.option("--batch-size", type=click.IntRange(min=1), default=8, show_default=True)
@click.option("--prompts", default=None, help="Text file, one prompt per line (\\n for a newline).")
@click.option("--output", default=None, help="JSON results (default RUN_DIR/eval/TAG-SPLIT.json).")
@click.option("--max-new-tokens", type=click.IntRange(0, 100_000), default=48, show_default=True)
@click.option("--seed", type=int, default=1234, show_default=True, help="Seed of the sampled continuations.")
@click.option("--device", default="auto", show_default=True, help="cpu, cuda, cuda:1, or auto (one process).")
@click.option(
    "--num-gpus",
    type=click.IntRange(min=1),
    default=None,
    help="Evaluate across N ranks of this machine with ZeRO-3 (a checkpoint larger than one GPU).",
)
@click.option("--hostfile", default=None, help="Evaluate across the hosts of a DeepSpeed hostfile with ZeRO-3.")
@click.option(
    "--master-port",
    type=click.IntRange(1, 65535),
    default=None,
    help="Rendezvous port (with --num-gpus or --hostfile).",
)
@click.option("--launched", is_flag=True, hidden=True, help="Set by the launcher: this process is one rank.")
@_user_errors
def evaluate(
    checkpoint: str,
    data: str | None,
    split: str,
    max_batches: int | None,
    batch_size: int,
    prompts: str | None,
    output: str | None,
    max_new_tokens: int,
    seed: int,
    device: str,
    num_gpus: int | None,
    hostfile: str | None,
    master_port: int | None,
    launched: bool,
) -> None:
    """Held-out loss, perplexity and bits per byte of a checkpoint, sample continuations, and RUN_DIR/loss.png.

    One process by default (bf16 on a GPU). With --num-gpus or --hostfile, the `deepspeed` launcher starts one
    rank per GPU and the model is split across them with ZeRO-3 (70B on the training cluster); the results file
    is the same."""
    from pipeline.evaluate import run as stage
    from pipeline.evaluate.run import EvalConfig

    cfg = EvalConfig(
        checkpoint=checkpoint,
        data=data,
        split=split,
        max_batches=max_batches,
        batch_size=batch_size,
        prompts=prompts,
        output=output,
        max_new_tokens=max_new_tokens,
        seed=seed,
        device=device,
    )
    if launched:  # this process is one rank of the launch below
        from pipeline.evaluate.distributed import evaluate_on_rank
        from pipeline.train.dist import exit_now

        evaluate_on_rank(cfg)  # rank 0 writes the results file; the command that launched the ranks prints it
        exit_now(0)
    if not (num_gpus or hostfile):
        click.echo(stage.table(stage.run(cfg)))
        return
    from pipeline import launch

    where = launch.Where(hostfile=hostfile, num_gpus=num_gpus, master_port=master_port)
    click.echo(stage.table(launch.evaluate(cfg, where)))


@main.command()
@click.option("--checkpoint", required=True, help="RUN_DIR (its latest complete checkpoint) or RUN_DIR/TAG.")
@click.option("--output", required=True, help="Folder to write the Hugging Face model into.")
@click.option("--dtype", type=click.Choice(["bf16", "fp16", "fp32"]), default="bf16", show_default=True)
@click.option("--max-shard-size", default="2GB", show_default=True, help="Largest safetensors file.")
@_user_errors
def export(checkpoint: str, output: str, dtype: str, max_shard_size: str) -> None:
    """Export a checkpoint to a Hugging Face model folder (safetensors, config, tokenizer)."""
    from pipeline.evaluate import run as stage
    from pipeline.units import parse_size

    try:
        size = parse_size(max_shard_size)
    except ValueError as e:
        raise PipelineError(f"--max-shard-size: {e}") from None
    if size < 1:
        raise PipelineError(f"--max-shard-size {max_shard_size}: expected a positive size such as 2GB")
    out = stage.export(checkpoint, output, dtype=dtype, max_shard_bytes=size)
    click.echo(
        f"exported {checkpoint} to {out} ({dtype}); load it with "
        f"AutoModelForCausalLM.from_pretrained('{out}') and AutoTokenizer.from_pretrained('{out}')"
    )


@main.command()
@click.option("--checkpoint", required=True, help="RUN_DIR (its latest complete checkpoint) or RUN_DIR/TAG.")
@click.option(
    "--tasks",
    required=True,
    help="lm-evaluation-harness tasks, comma-separated: the bundled offline "
    "pipeline_demo_ppl (configs/lm_eval/), or the harness's own such as hellaswag,arc_easy (downloaded).",
)
@click.option(
    "--lm-eval",
    "lm_eval",
    default=".venv-lm-eval/bin/lm_eval",
    show_default=True,
    help="The harness's lm_eval in its own environment (`make eval TASKS=...` installs it there).",
)
@click.option(
    "--device", default="auto", show_default=True, help="auto (cuda when torch sees a GPU), cpu, cuda, cuda:1."
)
@click.option("--batch-size", default="8", show_default=True, help="The harness's --batch_size (a number or auto).")
@click.option("--limit", type=float, default=None, help="Documents per task (a fraction below 1); for smoke runs.")
@_user_errors
def harness(checkpoint: str, tasks: str, lm_eval: str, device: str, batch_size: str, limit: float | None) -> None:
    """Run EleutherAI's lm-evaluation-harness on a checkpoint: exported to RUN_DIR/export/TAG when that export is
    missing or stale, results in RUN_DIR/eval/TAG-lm-eval."""
    from pipeline.evaluate.harness import run_harness

    code, output = run_harness(checkpoint, tasks, lm_eval, device=device, batch_size=batch_size, limit=limit)
    if code != 0:
        raise PipelineError(f"lm_eval failed (exit code {code}); see its output above")
    click.echo(f"harness results: {output}")


@main.command()
@click.option(
    "--hostfile",
    default=None,
    help="Check every host of this DeepSpeed hostfile (reached by ssh, as the "
    "launcher reaches them); default: this machine only.",
)
@click.option(
    "--config",
    "config_path",
    default=None,
    help="The pretrain config about to run: its data, run folder, "
    "NVMe path and the plan's host RAM and checkpoint size are checked on each host.",
)
@click.option("--set", "sets", multiple=True, help="With --config: override a field, section.key=value.")
@click.option(
    "--master-port",
    type=click.IntRange(1, 65535),
    default=29500,
    show_default=True,
    help="The rendezvous port the launch will use (checked free on the first host).",
)
@click.option(
    "--timeout",
    type=click.FloatRange(1, 3600),
    default=60.0,
    show_default=True,
    help="Seconds each host gets for each step (ssh, checks, the all-reduce).",
)
@click.option("--json", "as_json", is_flag=True, help="Print the reports as JSON.")
@click.option(
    "--write-env",
    is_flag=True,
    help="Add what the checks found (NCCL_SOCKET_IFNAME, GLOO_SOCKET_IFNAME, "
    "NCCL_P2P_DISABLE, NCCL_IB_DISABLE) to .deepspeed_env here; lines already there are kept.",
)
@_user_errors
def doctor(
    hostfile: str | None,
    config_path: str | None,
    sets: tuple[str, ...],
    master_port: int,
    timeout: float,
    as_json: bool,
    write_env: bool,
) -> None:
    """Check a cluster before a long run: per host PASS / WARN / FAIL with the reason and the fix (ssh, same venv
    and versions, DeepSpeed ops, GPUs and P2P, the network interface and a measured all-reduce, ulimit -l,
    /dev/shm, RAM, disk, data, master port). Exit code 1 when a check fails."""
    from pathlib import Path

    from pipeline.doctor import cluster as doc
    from pipeline.plan.hostfile import hostfile_hosts
    from pipeline.train.env import env_file_paths

    hosts = [h for h, _ in hostfile_hosts(hostfile)] if hostfile else None
    needs, note = doc.needs_for(config_path, list(sets), hostfile, master_port)
    if note:
        click.echo(f"note: {note}", err=True)
    slots = dict(hostfile_hosts(hostfile)) if hostfile else None
    reports = doc.doctor(
        hosts, needs, timeout=timeout, expected_bus_bytes=doc.expected_bus_bytes(hostfile), slots=slots
    )
    if as_json:
        click.echo(json.dumps([r.to_dict() for r in reports], indent=2))
    else:
        click.echo(doc.table(reports))
    if write_env:
        target = env_file_paths()[-1]
        for note in doc.write_env(Path(target), doc.env_findings(reports)) or ["nothing to add"]:
            click.echo(f"{target}: {note}", err=True)
    sys.exit(1 if doc.failed(reports) else 0)


@main.command()
@click.option(
    "--model",
    "preset",
    default="7b",
    show_default=True,
    help="Preset (tiny, 125m, 350m, 1b, 7b, 13b, 70b), "
    "or a Hugging Face model folder or its config.json (Llama, Mistral, Qwen2, Qwen3).",
)
@click.option(
    "--config",
    "config_path",
    default=None,
    help="Plan exactly this pretrain config (its model, batch, "
    "DeepSpeed JSON and checkpointing) instead of searching; says whether it fits and what the search "
    "would choose.",
)
@click.option("--set", "sets", multiple=True, help="With --config: override a field, section.key=value.")
@click.option(
    "--from-run",
    "from_run",
    default=None,
    help="A run folder: the plan for exactly that run beside what it measured (peak memory, step time, tokens/s), "
    "with the ratios and the rates it measured (compute efficiency, parameter fetch, CPU Adam). With --model or "
    "--config: plan that on the run's cluster at the run's measured rates.",
)
@click.option(
    "--layers",
    type=click.IntRange(min=1),
    default=None,
    help="Override the preset's layer count (e.g. for test slices).",
)
@click.option("--vocab-size", type=click.IntRange(min=1), default=32000, show_default=True)
@click.option(
    "--seq-len",
    type=click.IntRange(min=1),
    default=None,
    help="Tokens per sample [default: 4096; with --config, the shards' seq_len].",
)
@click.option("--hostfile", default=None, help="DeepSpeed hostfile: nodes and GPUs per node from its slots.")
@click.option("--nodes", type=click.IntRange(min=1), default=1, show_default=True)
@click.option("--gpus-per-node", type=click.IntRange(min=1), default=1, show_default=True)
@click.option(
    "--gpu",
    default=None,
    show_default=CLUSTER_DEFAULTS["gpu"],
    help="3090, 4090, 4090d, l40s, v100, a100-40gb, a100-80gb, a100-40gb-pcie, a100-80gb-pcie, h100, "
    "h100-pcie, h100-nvl, h200, h200-nvl, or a name as nvidia-smi prints it.",
)
@click.option("--gpu-mem", default=None, help="Cap the card's memory, e.g. 24GiB (emulating a smaller card).")
@click.option("--cpu-mem", default=None, show_default=CLUSTER_DEFAULTS["cpu_mem"], help="Host RAM per node.")
@click.option(
    "--cpu-cores",
    type=click.IntRange(min=1),
    default=None,
    show_default=CLUSTER_DEFAULTS["cpu_cores"],
    help="CPU cores per node (DeepSpeed's CPU Adam under offload).",
)
@click.option(
    "--cpu-mem-bw",
    default=None,
    show_default=CLUSTER_DEFAULTS["cpu_mem_bw"],
    help="Host memory bandwidth per node (CPU Adam and the cards' copies share it).",
)
@click.option(
    "--disk",
    default=None,
    help="Free disk per node at the run folder, for checkpoints (e.g. 40GB, or the folder itself).",
)
@click.option("--nvme", default=None, help="NVMe capacity per node for ZeRO-Infinity, e.g. 4TB (or a mounted path).")
@click.option(
    "--network", default=None, show_default=CLUSTER_DEFAULTS["network"], help="Inter-node bandwidth per node."
)
@click.option("--global-batch-tokens", default="4M", show_default=True, help="Tokens per optimizer step.")
@click.option(
    "--micro-batch-size", type=click.IntRange(min=1), default=None, help="Fix the micro-batch instead of searching it."
)
@click.option(
    "--mfu",
    type=click.FloatRange(0.0, 1.0, min_open=True),
    default=None,
    help="Fix the compute efficiency (0 < mfu <= 1, of peak, PaLM count plus recompute) instead of the curve "
    "fitted to published runs (which depends on the card and the micro-step); e.g. what your own run measured.",
)
@click.option("--tokens", default="1B", show_default=True, help="Token budget for the time estimate.")
@click.option("--write-ds-config", default=None, help="Write the chosen DeepSpeed JSON here.")
@click.option(
    "--opt-in",
    "opt_in",
    multiple=True,
    type=click.Choice(["bf16-master", "bf16-states", "zenflow"]),
    help="Let the choice use a DeepSpeed 0.19 offload feature that changes the numerics (repeatable); without it "
    "each is priced and shown beside the choice. Activation offload, which does not, is always considered.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the plan as JSON.")
@click.option("--fits-table", is_flag=True, help="Print the README's table: presets 1b-70b on each reference hostfile.")
@_user_errors
def plan(
    preset: str,
    config_path: str | None,
    sets: tuple[str, ...],
    from_run: str | None,
    layers: int | None,
    vocab_size: int,
    seq_len: int | None,
    hostfile: str | None,
    nodes: int,
    gpus_per_node: int,
    gpu: str | None,
    gpu_mem: str | None,
    cpu_mem: str | None,
    cpu_cores: int | None,
    cpu_mem_bw: str | None,
    disk: str | None,
    nvme: str | None,
    network: str | None,
    global_batch_tokens: str,
    micro_batch_size: int | None,
    mfu: float | None,
    tokens: str,
    write_ds_config: str | None,
    opt_in: tuple[str, ...],
    as_json: bool,
    fits_table: bool,
) -> None:
    """Will MODEL fit the cluster, how fast will it train, and which DeepSpeed config gets there. Memory is given as
    peak allocated (what torch.cuda.max_memory_allocated reports) and reserved (what the card must hold), with a
    margin; time as a point and a low-high range beside the physical ceiling. A hostfile's `# cluster:` line
    (see hostfiles/) gives the nodes' GPU, RAM, cores, memory bandwidth, disk and network; flags override it."""
    from pipeline.plan import command

    ctx = click.get_current_context()
    given = {k for k in ctx.params if ctx.get_parameter_source(k) != click.core.ParameterSource.DEFAULT}
    cores = None if cpu_cores is None else str(cpu_cores)
    facts = {"gpu": gpu, "gpu_mem": gpu_mem, "cpu_mem": cpu_mem, "cpu_cores": cores, "cpu_mem_bw": cpu_mem_bw}
    req = command.PlanRequest(
        model=preset,
        config=config_path,
        sets=sets,
        from_run=from_run,
        layers=layers,
        vocab_size=vocab_size,
        seq_len=seq_len,
        hostfile=hostfile,
        nodes=nodes,
        gpus_per_node=gpus_per_node,
        flags=facts | {"disk": disk, "nvme": nvme, "network": network},
        global_batch_tokens=global_batch_tokens,
        micro_batch_size=micro_batch_size,
        mfu=mfu,
        tokens=tokens,
        write_ds_config=write_ds_config,
        opt_in=frozenset(opt_in),
        as_json=as_json,
        fits_table=fits_table,
        model_given="preset" in given,
        cluster_given=bool(given & {"hostfile", "nodes", "gpus_per_node", "gpu", "gpu_mem", "cpu_mem"}),
    )
    if (config_path or from_run) and not fits_table:
        from pipeline.train import forecast

        code = forecast.plan(req, click.echo)
    else:
        code = command.plan(req, click.echo)
    if code:
        sys.exit(code)


if __name__ == "__main__":
    main()
