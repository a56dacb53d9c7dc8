"""`pipeline` command line: each command parses its options, builds a config and calls one stage's run().

Each option is declared once: options shared by several commands are groups in pipeline/options.py (`HOSTFILE`,
`WHERE`, `CHECKPOINT`, ...), and an option's name is its config field's, so a command passes what it parsed on
whole (`TokenizeConfig(**options)`)."""

from __future__ import annotations

import functools
import json
import logging
import sys
from typing import Any

import click

from pipeline.errors import PipelineError
from pipeline.options import (
    AS_JSON,
    AVERAGE,
    CHECKPOINT,
    DEVICE,
    HOSTFILE,
    MASTER_PORT,
    PATH,
    SEED,
    SETS,
    TEXT_KEY,
    WHERE,
    Decorator,
    SequenceLength,
    config_option,
    given_on_command_line,
    group,
    length_mix,
    opt,
    output_prefix,
    ratios,
    size,
    user_errors,
)
from pipeline.plan.cluster import OPT_IN
from pipeline.plan.facts import CLUSTER_DEFAULTS, NODE_FACTS


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
@click.option("--exact/--no-exact", default=True, show_default=True, help="Remove exact duplicates (normalised text).")
@click.option("--near/--no-near", default=True, show_default=True, help="Remove near duplicates (MinHash LSH).")
@click.option(
    "--quality/--no-quality", default=True, show_default=True, help="Gopher, C4 and FineWeb quality heuristics."
)
@opt(
    "--decontaminate",
    multiple=True,
    type=PATH,
    help="An evaluation file or folder (what tokenize reads), repeatable: a training document sharing a "
    "--decontaminate-ngrams word n-gram with it is removed.",
)
@opt(
    "--near-threshold",
    type=float,
    default=0.3,
    help="Jaccard similarity of word n-gram sets that LSH finds half the time (0-1; lower removes more).",
)
@opt("--permutations", type=int, default=120, help="MinHash hashes per document (LSH bands x rows).")
@opt("--ngrams", type=int, default=3, help="Words per shingle for near duplicates.")
@opt("--decontaminate-ngrams", type=int, default=13, help="Words per n-gram shared with evaluation text.")
@TEXT_KEY
@opt("--workers", type=click.IntRange(1, 512), default=None, help="Tasks run at once (default: this machine's cores).")
@SEED
def curate(inputs: tuple[str, ...], output: str, **options: Any) -> None:
    """Stage 0: remove duplicates, near duplicates, low-quality and contaminated documents from INPUT... (what
    tokenize reads) before tokenizing: quality filters, decontamination against
    evaluation files, exact and near-duplicate removal, on Hugging Face datatrove's steps and local executor. The
    same input and options keep the same documents; a re-run replaces OUTPUT whole."""
    from pipeline.data.config import CurateOptions
    from pipeline.data.curate import curate as curating

    options["decontaminate"] = tuple(options["decontaminate"])
    if options["workers"] is None:
        options.pop("workers")
    curating(list(inputs), output, CurateOptions(**options), echo=click.echo)


@command()
@click.argument("inputs", nargs=-1, required=True, type=PATH)
@click.option(
    "--output-prefix",
    required=True,
    type=PATH,
    callback=output_prefix,
    help="Writes PREFIX.bin, PREFIX.idx and PREFIX.manifest.json.",
)
@click.option(
    "--tokenizer", default=None, type=PATH, help="An existing sentencepiece .model file or a Hugging Face folder."
)
@click.option(
    "--train-tokenizer", is_flag=True, help="Train a sentencepiece tokenizer on the inputs (PREFIX.tokenizer.model)."
)
@click.option("--vocab-size", type=click.IntRange(300, 1_000_000), default=32000, show_default=True)
@click.option("--model-type", type=click.Choice(["bpe", "unigram"]), default="bpe", show_default=True)
@opt(
    "--sample-docs",
    default=100_000,
    help="Documents sampled (seeded) to train the tokenizer on.",
    type=click.IntRange(1),
)
@SEED
@TEXT_KEY
@opt("--workers", default=1, help="Encoding processes; output is identical for any count.", type=click.IntRange(1, 512))
@click.option("--append-eos/--no-append-eos", default=True, show_default=True, help="End each document with </s>.")
@opt(
    "--on-error",
    default="skip",
    help="skip: count bad records and go on; fail: stop at the first (exit 2).",
    type=click.Choice(["skip", "fail"]),
)
@opt(
    "--max-record-bytes",
    callback=size,
    default="256MB",
    help="A JSON line is parsed whole; a longer one is a bad record (--on-error applies). .txt files "
    "and long texts are read and encoded in pieces whatever their size.",
)
def tokenize(**options: Any) -> None:
    """Tokenize INPUT... (.jsonl, .txt, .parquet, optionally .gz/.zst; folders; globs; save_to_disk datasets)
    into a Megatron indexed dataset."""
    from pipeline.data import tokenize as tokenizing
    from pipeline.data.config import TokenizeConfig

    click.echo(tokenizing.run(TokenizeConfig(**options)).summary)


@command(name="extend-vocab")
@click.argument("model_dir", type=PATH)
@click.argument("inputs", nargs=-1, required=True, type=PATH)
@click.option(
    "--output", required=True, type=PATH, help="Folder for the model with the extended tokenizer (a new folder)."
)
@opt("--new-tokens", default=8000, help="Pieces to add at most.", type=click.IntRange(1, 1_000_000))
@opt("--sample-docs", default=100_000, help="Documents sampled (seeded) to find the pieces.", type=click.IntRange(1))
@opt("--held-out-docs", default=200, help="Documents kept aside to measure bytes per token.", type=click.IntRange(1))
@SEED
@TEXT_KEY
def extend_vocab(**options: Any) -> None:
    """Extend MODEL_DIR's tokenizer with pieces of a new corpus (INPUT...) and its embeddings to match: a
    Hugging Face model folder to continue on a language its tokenizer splits into many tokens."""
    from pipeline.data.vocab import VocabConfig, extend_vocabulary

    click.echo(extend_vocabulary(VocabConfig(**options)).summary)


@command()
@click.argument("sources", nargs=-1, type=PATH)
@click.option("--output", type=PATH, help="Folder for the shards and manifest.json.")
@opt(
    "--seq-len",
    help="Tokens per sample, e.g. 4096 or 32k (each stores seq_len + 1 for the labels).",
    type=SequenceLength(8, 2**20),
)
@opt("--split", default="98,1,1", help="train,val,test ratios, by document.", callback=ratios)
@SEED
@opt("--num-shards", help="Shards per split (default: by --shard-size).", type=click.IntRange(1))
@opt("--shard-size", "shard_size_bytes", default="512MB", help="Target bytes per shard.", callback=size)
@opt(
    "--cross-document/--no-cross-document",
    default=True,
    help="--no-cross-document: never let a sample cross a document boundary (pad, and mask the padding out).",
)
@opt(
    "--whole-documents",
    is_flag=True,
    help="Keep each document of up to seq_len tokens whole, several to a sample, padded; training masks attention "
    "and the loss at their boundaries (for long-context runs). Implies --no-cross-document.",
)
@opt(
    "--length-mix",
    help="LENGTH:WEIGHT,...: draw the train split's documents at least LENGTH tokens long WEIGHT times as often for "
    "their share (e.g. 8k:2,32k:4 upsamples long documents for a context extension).",
    callback=length_mix,
)
@click.option("--overwrite", is_flag=True, help="Replace shards made with other arguments.")
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
    from pipeline.data.config import ShardConfig, parse_sources
    from pipeline.data.tokenizer import check_model_tokenizer

    if inspect_dir:
        click.echo(shard_stage.describe(inspect_dir))
        return
    if not sources or not options["output"] or not options["seq_len"]:
        raise PipelineError("give PREFIX[:WEIGHT]..., --output DIR and --seq-len N (or --inspect DIR)")
    parsed, given = parse_sources(sources)
    if model_dir:
        check_model_tokenizer(model_dir, [prefix for prefix, _ in parsed])
    if options["whole_documents"]:
        if options["cross_document"] and given_on_command_line("cross_document"):
            raise PipelineError(
                "--whole-documents and --cross-document: whole documents never cross a sample's end, which "
                "--cross-document asks for; drop one of them"
            )
        options["cross_document"] = False
    result = shard_stage.run(ShardConfig(sources=parsed, weights_given=given, **options))
    if result.skipped:
        click.echo(f"{options['output']}: shards are up to date (fingerprint {result.manifest['fingerprint']}); done")
    else:
        click.echo(shard_stage.describe(options["output"]))


@command()
@config_option(required=True, help="Pretrain YAML config (see configs/).")
@WHERE
@SETS
@click.option(
    "--dry-run", is_flag=True, help="Resolve and print the config, batch plan and DeepSpeed JSON; no training."
)
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
    help="With --hostfile: when hosts stop answering ssh, go on with the hosts that do if there are at least this "
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

    where = _where(options)
    sys.exit(launch.pretrain(config, list(sets), where, **options))


@command()
@CHECKPOINT
@click.option("--data", default=None, type=PATH, help="Shard folder (default: the run's own data.path).")
@click.option("--split", type=click.Choice(["val", "test", "train"]), default="val", show_default=True)
@opt("--max-batches", help="Evaluate at most this many batches (default: all).", type=click.IntRange(1))
@click.option("--batch-size", type=click.IntRange(min=1), default=8, show_default=True)
@click.option("--prompts", default=None, type=PATH, help="Text file, one prompt per line (\\n for a newline).")
@click.option("--output", default=None, type=PATH, help="JSON results (default RUN_DIR/eval/TAG-SPLIT.json).")
@opt(
    "--max-new-tokens",
    type=click.IntRange(0, 100_000),
    default=48,
    help="Tokens per sample continuation (0: none, the metrics only).",
)
@AVERAGE
@SEED
@DEVICE
@WHERE
@click.option("--launched", is_flag=True, hidden=True, help="Set by the launcher: this process is one rank.")
def evaluate(launched: bool, **options: Any) -> None:
    """Held-out loss, perplexity and bits per byte of a checkpoint, sample continuations, and RUN_DIR/loss.png.

    One process by default (bf16 on a GPU). With --num-gpus or --hostfile, the `deepspeed` launcher starts one
    rank per GPU and the model is split across them with ZeRO-3 (70B on the training cluster); the results file
    is the same."""
    from pipeline.evaluate import run as stage
    from pipeline.evaluate.inputs import EvalConfig

    where = _where(options)
    cfg = EvalConfig(**options)
    if launched:  # this process is one rank of the launch below
        from pipeline.evaluate.distributed import evaluate_on_rank
        from pipeline.train.runtime.dist import exit_now

        evaluate_on_rank(cfg)  # rank 0 writes the results file; the command that launched the ranks prints it
        exit_now(0)
    if not (where.num_gpus or where.hostfile):
        click.echo(stage.table(stage.run(cfg)))
        return
    from pipeline import launch

    click.echo(stage.table(launch.evaluate(cfg, where)))


@command()
@CHECKPOINT
@click.option("--output", required=True, type=PATH, help="Folder to write the Hugging Face model into.")
@click.option("--dtype", type=click.Choice(["bf16", "fp16", "fp32"]), default="bf16", show_default=True)
@opt("--max-shard-size", default="2GB", help="Largest safetensors file.", callback=size)
@AVERAGE
@click.option(
    "--data",
    default=None,
    type=PATH,
    help="The run's shard folder, where its tokenizer is read from (default: the run's own data.path).",
)
@opt(
    "--gguf",
    multiple=True,
    type=click.Choice(["f16", "q8_0"]),
    help="Also write OUTPUT/NAME-TYPE.gguf for llama.cpp and Ollama (repeatable; a sentencepiece tokenizer.model, or "
    "a byte-level BPE tokenizer.json as Llama 3's and Qwen2's; checked before the export starts).",
)
def export(
    checkpoint: str,
    output: str,
    dtype: str,
    max_shard_size: int,
    average: str | None,
    data: str | None,
    gguf: tuple[str, ...],
) -> None:
    """Export a checkpoint (or the mean of several, --average) to a Hugging Face model folder (safetensors,
    config, tokenizer), and with --gguf to GGUF files llama.cpp runs."""
    from pipeline.evaluate.export import export as export_checkpoint
    from pipeline.evaluate.export import gguf_name

    out = export_checkpoint(
        checkpoint, output, dtype=dtype, max_shard_bytes=max_shard_size, average=average, data=data, gguf=gguf
    )
    if average:
        checkpoint = f"the mean of {average} of {checkpoint}"
    click.echo(
        f"exported {checkpoint} to {out} ({dtype}); load it with "
        f"AutoModelForCausalLM.from_pretrained('{out}') and AutoTokenizer.from_pretrained('{out}')"
    )
    for path in (out / gguf_name(out, kind) for kind in gguf):
        click.echo(f"wrote {path} ({path.stat().st_size / 1e6:,.1f} MB): llama-cli -m {path}")


@command()
@CHECKPOINT
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
@DEVICE
@click.option("--batch-size", default="8", show_default=True, help="The harness's --batch_size (a number or auto).")
@click.option("--limit", type=float, default=None, help="Documents per task (a fraction below 1); for smoke runs.")
def harness(checkpoint: str, tasks: str, lm_eval: str, **options: Any) -> None:
    """Run EleutherAI's lm-evaluation-harness on a checkpoint: exported to RUN_DIR/export/TAG when that export is
    missing or stale, results in RUN_DIR/eval/TAG-lm-eval."""
    from pipeline.evaluate.harness import run_harness

    code, output = run_harness(checkpoint, tasks, lm_eval, **options)
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
def doctor(config: str | None, sets: tuple[str, ...], master_port: int | None, **o: Any) -> None:
    """Check a cluster before a long run: per host (every host of --hostfile; default this machine) PASS / WARN /
    FAIL with the reason and the fix (ssh, same venv and versions, DeepSpeed ops, GPUs and P2P, the network
    interface and a measured all-reduce, ulimit -l, /dev/shm, RAM, disk, data, master port). Exit code 1 when a
    check fails."""
    from pipeline.doctor import cluster as doc

    say = functools.partial(click.echo, err=True)
    reports = doc.run(o["hostfile"], config, list(sets), master_port or 29500, o["timeout"], say)
    click.echo(json.dumps([r.to_dict() for r in reports], indent=2) if o["as_json"] else doc.table(reports))
    if o["write_env"]:
        for line in doc.write_found_env(reports):
            click.echo(line, err=True)
    sys.exit(1 if doc.failed(reports) else 0)


@command()
@opt(
    "--model",
    default="7b",
    help="Preset (tiny, 125m, 350m, 1b, 7b, 13b, 70b), "
    "or a Hugging Face model folder or its config.json (Llama, Mistral, Qwen2, Qwen3).",
)
@config_option(
    required=False,
    help="Plan exactly this pretrain config (its model, batch, DeepSpeed JSON and checkpointing) instead of "
    "searching; says whether it fits and what the search would choose.",
)
@SETS
@click.option(
    "--from-run",
    default=None,
    help="A run folder: the plan for exactly that run beside what it measured (peak memory, step time, tokens/s), "
    "with the ratios and the rates it measured (compute efficiency, parameter fetch, CPU Adam). With --model or "
    "--config: plan that on the run's cluster at the run's measured rates.",
)
@click.option("--layers", type=click.IntRange(min=1), default=None, help="Override the preset's layer count.")
@opt("--vocab-size", default=32000, type=click.IntRange(1))
@opt(
    "--seq-len",
    help="Tokens per sample, e.g. 4096 or 32k [default: 4096; with --config, the shards' seq_len].",
    type=SequenceLength(),
)
@HOSTFILE
@opt("--nodes", default=1, type=click.IntRange(1))
@opt("--gpus-per-node", default=1, type=click.IntRange(1))
@group(
    *(
        click.option(f"--{k.replace('_', '-')}", default=None, show_default=CLUSTER_DEFAULTS[k], help=v)
        for k, v in NODE_FACTS.items()
    )
)
@opt("--global-batch-tokens", default="4M", help="Tokens per optimizer step.")
@opt("--micro-batch-size", help="Fix the micro-batch instead of searching it.", type=click.IntRange(1))
@click.option(
    "--mfu",
    type=click.FloatRange(0.0, 1.0, min_open=True),
    default=None,
    help="Fix the compute efficiency (0 < mfu <= 1, of peak, PaLM count plus recompute) instead of the curve "
    "fitted to published runs (which depends on the card and the micro-step); e.g. what your own run measured.",
)
@opt("--tokens", default="1B", help="Token budget for the time estimate.")
@click.option(
    "--whole-documents",
    is_flag=True,
    help="Shards of whole documents (`pipeline shard --whole-documents`; with --config, read from the shards).",
)
@click.option(
    "--document-attention",
    type=click.Choice(["auto", "varlen", "dense"]),
    default="auto",
    show_default=True,
    help="How the cluster keeps documents apart (train.document_attention): varlen (flash_attn installed there, no "
    "mask), dense (SDPA's (seq x seq) mask, priced; no sequence parallelism); auto: varlen where flash_attn is "
    "installed on this machine.",
)
@click.option("--write-ds-config", default=None, type=PATH, help="Write the chosen DeepSpeed JSON here.")
@click.option(
    "--opt-in",
    multiple=True,
    type=click.Choice(sorted(OPT_IN)),
    help="Let the choice use a DeepSpeed 0.19 offload feature that changes the numerics (repeatable); without it "
    "each is priced and shown beside the choice. Activation offload, which does not, is always considered.",
)
@AS_JSON
@click.option(
    "--fits-table", is_flag=True, help="Print the table of docs/planning.md: presets 1b-70b on each reference hostfile."
)
@click.option("--long-context-table", is_flag=True, help="Print the table of docs/long-context.md: the headline plans.")
def plan(**options: Any) -> None:
    """Will MODEL fit the cluster, how fast will it train, and which DeepSpeed config gets there. Memory is given as
    peak allocated (what torch.cuda.max_memory_allocated reports) and reserved (what the card must hold), with a
    margin; time as a point and a low-high range beside the physical ceiling. A hostfile's `# cluster:` line
    (see hostfiles/) gives the nodes' GPU, RAM, cores, memory bandwidth, disk and network; flags override it."""
    from pipeline.plan.command import PlanRequest
    from pipeline.train.forecast_report import plan as plan_command

    ctx = click.get_current_context()
    given = {k for k in ctx.params if ctx.get_parameter_source(k) != click.core.ParameterSource.DEFAULT}
    if code := plan_command(PlanRequest.from_options(options, given), click.echo):
        sys.exit(code)


@command()
@HOSTFILE
@opt("--out", type=PATH, help="Write the rates here [default: HOSTFILE.probe.json beside --hostfile, else probe.json].")
@opt("--model", help="With a GPU, also its bf16 GEMM rate at this model's shapes (a preset or a HF folder).")
@opt("--seq-len", default=4096, type=SequenceLength(), help="Tokens per sample, e.g. 4096 or 32k.")
@opt("--micro-batch-size", default=1, type=click.IntRange(1))
@config_option(
    required=False,
    help="Also measure this pretrain config's own model at small depths on this node (--slice-layers), through "
    "the trainer with its DeepSpeed JSON, micro-batch and sequence length, extrapolated to its full depth; "
    "`pipeline plan --config` shows it beside the plan.",
)
@SETS
@opt("--num-gpus", type=click.IntRange(1), help="Ranks for the slices [default: every GPU here, else 1 CPU rank].")
@opt("--slice-layers", default="2,4", help="The depths of the slices, comma-separated (two or more).")
@opt("--slice-steps", default=8, type=click.IntRange(4, 1000), help="Steps per slice (the later half is timed).")
@opt(
    "--slice-repeats",
    default=1,
    type=click.IntRange(1, 10),
    help="Run each slice this many times, in turn, and keep its fastest (on a shared or noisy node).",
)
@click.option("--quick", is_flag=True, help="Small sizes, about a second: checks that it runs, not the node.")
@AS_JSON
def probe(
    as_json: bool,
    model: str | None,
    seq_len: int,
    micro_batch_size: int,
    config: str | None,
    sets: tuple[str, ...],
    num_gpus: int | None,
    slice_layers: str,
    slice_steps: int,
    slice_repeats: int,
    **options: Any,
) -> None:
    """Measure on this node what `pipeline plan` otherwise assumes: host memory bandwidth, DeepSpeed's CPU Adam
    rate on its cores and, with a GPU, pinned copy and bf16 GEMM rates. Run it on one node of the cluster (about a
    minute); plans with the same --hostfile then use it and say which figures were measured. With --config, also
    the run's own model on this node's card(s) at 2 and 4 layers (a minute or two more), extrapolated to its depth."""
    from pipeline.plan import probe as probing
    from pipeline.train.runtime.ops import use_project_cache

    use_project_cache()  # CPU Adam loads from the project's op cache (`make ops` builds it)
    slices = None
    if config:
        from pipeline.launch.command import Where
        from pipeline.launch.slices import measure

        try:
            depths = tuple(int(x) for x in slice_layers.split(","))
        except ValueError:
            raise PipelineError(f"--slice-layers {slice_layers}: expected depths such as 2,4") from None
        where = Where(num_gpus=num_gpus)
        where.check_local_gpus()
        ranks = where.resolved().world_size()[0]
        say = (lambda _: None) if as_json else functools.partial(click.echo, err=True)
        say(f"slices of {config} on this node ({ranks} rank(s)):")
        slices = measure(
            config, list(sets), num_gpus=ranks, layers=depths, steps=slice_steps, repeats=slice_repeats, say=say
        )
        if not model:
            model = json.dumps(slices["key"]["shape"])
            seq_len, micro_batch_size = slices["key"]["seq_len"], slices["key"]["micro_batch_size"]
    gemm_shape = None
    if model:
        if model.startswith("{"):
            shape = json.loads(model)
            gemm_shape = (shape["hidden_size"], shape["ffn_hidden_size"], seq_len * micro_batch_size)
        else:
            from pipeline.plan.search import planned_shape

            planned, _ = planned_shape(model, None, 32000, seq_len)
            gemm_shape = (planned.hidden_size, planned.ffn_hidden_size, seq_len * micro_batch_size)
    doc, path = probing.run(gemm_shape=gemm_shape, slices=slices, **options)
    click.echo(json.dumps(doc, indent=2)) if as_json else probing.report(doc, path, click.echo)


if __name__ == "__main__":
    main()
