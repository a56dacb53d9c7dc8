"""`pipeline` command line: each command parses its options, builds a config and calls one stage's run()."""

from __future__ import annotations

import functools
import logging
import sys
from collections.abc import Callable
from typing import Any

import click

from pipeline.errors import PipelineError


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
@click.option("--tokenizer", type=str, default=None,
              help="An existing sentencepiece .model file or a local Hugging Face tokenizer folder.")
@click.option("--train-tokenizer", is_flag=True, help="Train a sentencepiece tokenizer on the inputs "
              "(saved as PREFIX.tokenizer.model).")
@click.option("--vocab-size", type=int, default=32000, show_default=True)
@click.option("--model-type", type=click.Choice(["bpe", "unigram"]), default="bpe", show_default=True)
@click.option("--sample-docs", type=int, default=100_000, show_default=True,
              help="Documents sampled (seeded) to train the tokenizer on.")
@click.option("--seed", type=int, default=1234, show_default=True)
@click.option("--text-key", default="text", show_default=True, help="JSON field / parquet column holding the text.")
@click.option("--workers", type=int, default=1, show_default=True, help="Encoding processes; output is identical "
              "for any count.")
@click.option("--append-eos/--no-append-eos", default=True, show_default=True, help="End each document with </s>.")
@click.option("--on-error", type=click.Choice(["skip", "fail"]), default="skip", show_default=True,
              help="skip: count bad records by reason and go on; fail: stop at the first (exit 2).")
@_user_errors
def tokenize(inputs: tuple[str, ...], output_prefix: str, tokenizer: str | None, train_tokenizer: bool,
             vocab_size: int, model_type: str, sample_docs: int, seed: int, text_key: str, workers: int,
             append_eos: bool, on_error: str) -> None:
    """Tokenize INPUT... (.jsonl, .txt, .parquet, optionally .gz/.zst; folders; globs; save_to_disk datasets)
    into a Megatron indexed dataset."""
    from pipeline import tokenizing
    from pipeline.config import TokenizeConfig

    cfg = TokenizeConfig(inputs=inputs, output_prefix=output_prefix, tokenizer=tokenizer,
                         train_tokenizer=train_tokenizer, vocab_size=vocab_size, model_type=model_type,
                         sample_docs=sample_docs, seed=seed, text_key=text_key, workers=workers,
                         append_eos=append_eos, on_error=on_error)
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
@click.option("--seq-len", type=int, help="Tokens per training sample (each stores seq_len + 1 for the labels).")
@click.option("--split", default="98,1,1", show_default=True, help="train,val,test ratios, by document.")
@click.option("--seed", type=int, default=1234, show_default=True)
@click.option("--num-shards", type=int, default=None, help="Shards per split (default: by --shard-size).")
@click.option("--shard-size", default="512MB", show_default=True, help="Target bytes per shard file.")
@click.option("--no-cross-document", is_flag=True, help="Never let a sample cross a document boundary: pad and "
              "mask the padding out of the loss.")
@click.option("--overwrite", is_flag=True, help="Replace shards made with other arguments.")
@click.option("--inspect", "inspect_dir", type=str, default=None, help="Print the summary of a shard folder.")
@_user_errors
def shard(sources: tuple[str, ...], output: str | None, seq_len: int | None, split: str, seed: int,
          num_shards: int | None, shard_size: str, no_cross_document: bool, overwrite: bool,
          inspect_dir: str | None) -> None:
    """Pack, split, blend and shuffle tokenized PREFIX[:WEIGHT]... into fixed-length training shards."""
    from pipeline import shard as shard_stage
    from pipeline.config import ShardConfig, parse_size

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
    cfg = ShardConfig(sources=parsed, output=output, seq_len=seq_len, split=ratios,  # type: ignore[arg-type]
                      seed=seed, num_shards=num_shards, shard_size_bytes=size,
                      cross_document=not no_cross_document, overwrite=overwrite, weights_given=given)
    result = shard_stage.run(cfg)
    if result.skipped:
        click.echo(f"{output}: shards are up to date (fingerprint {result.manifest['fingerprint']}); nothing to do")
    else:
        click.echo(shard_stage.describe(output))


@main.command(context_settings={"ignore_unknown_options": True})
@click.option("--config", "config_path", required=True, help="Pretrain YAML config (see configs/).")
@click.option("--hostfile", default=None, help="DeepSpeed hostfile (multi-node; DeepSpeed reaches hosts by ssh).")
@click.option("--num-gpus", type=int, default=None, help="Ranks on this machine when no hostfile is given "
              "(CPU runs: processes).")
@click.option("--master-port", type=int, default=None, help="Rendezvous port (default: DeepSpeed's 29500).")
@click.option("--set", "sets", multiple=True, help="Override a config field: section.key=value (repeatable).")
@click.option("--dry-run", is_flag=True, help="Resolve and print the config, batch plan and DeepSpeed JSON; no training.")
@_user_errors
def pretrain(config_path: str, hostfile: str | None, num_gpus: int | None, master_port: int | None,
             sets: tuple[str, ...], dry_run: bool) -> None:
    """Build the `deepspeed ... pipeline/pretrain.py` command line, print it, and run it."""
    import os
    import shutil
    import subprocess
    from pathlib import Path

    import pipeline

    script = Path(pipeline.__file__).parent / "pretrain.py"
    launcher = shutil.which("deepspeed", path=str(Path(sys.executable).parent)) or shutil.which("deepspeed")
    if launcher is None:
        raise PipelineError("the `deepspeed` launcher is not installed in this environment (pip install deepspeed)")
    cmd = [launcher]
    if hostfile:
        if not Path(hostfile).exists():
            raise PipelineError(f"--hostfile {hostfile}: no such file (see hostfiles/)")
        cmd += ["--hostfile", hostfile]
    elif num_gpus:
        cmd += ["--num_gpus", str(num_gpus)]
    if master_port:
        cmd += ["--master_port", str(master_port)]
    cmd += [str(script), "--config", config_path]
    for s in sets:
        cmd += ["--set", s]
    if dry_run:
        cmd.append("--dry-run")
    click.echo("+ " + " ".join(cmd), err=True)
    sys.exit(subprocess.call(cmd, env=os.environ.copy()))


if __name__ == "__main__":
    main()
