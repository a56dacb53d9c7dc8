#!/usr/bin/env python
"""Stage 3: pretraining through DeepSpeed. Launch as `deepspeed [--hostfile H | --num_gpus N] pipeline/pretrain.py
--config CONFIG.yaml [--set key=value ...] [--dry-run]`; `pipeline pretrain` builds that command for you.

The only module that imports deepspeed or touches torch.distributed. Data comes only from `pipeline.data`.
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__":
    # Run as a script, this file's folder would come first on sys.path and every sibling module would shadow a
    # top-level name (STYLE.md's script-path trap). Drop it; import the package from the install (or checkout).
    _here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.getcwd()) != _here]
    if os.path.dirname(_here) not in sys.path:
        sys.path.append(os.path.dirname(_here))

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
from dataclasses import replace  # noqa: E402
from typing import Any  # noqa: E402

from pipeline.data.shard import read_manifest  # noqa: E402
from pipeline.errors import PipelineError  # noqa: E402
from pipeline.model import ModelShape, resolve_shape  # noqa: E402
from pipeline.train.config import PretrainConfig, dump, load  # noqa: E402
from pipeline.train.ds_config import BatchPlan, batch_plan, load_ds_config, resolve  # noqa: E402


def lr_at(step: int, cfg: PretrainConfig, max_steps: int) -> float:
    """Pure: linear warmup over `warmup_steps`, then cosine decay to `min_lr` over `decay_steps` (default: the
    rest of the run), then `min_lr`. `step` is the 0-based index of the update being applied."""
    o = cfg.optim
    if step < o.warmup_steps:
        return o.lr * (step + 1) / o.warmup_steps
    decay = o.decay_steps if o.decay_steps is not None else max(1, max_steps - o.warmup_steps)
    progress = min(1.0, (step - o.warmup_steps) / max(1, decay))
    return o.min_lr + 0.5 * (o.lr - o.min_lr) * (1 + math.cos(math.pi * progress))


def accelerator_name() -> str:
    name = os.environ.get("DS_ACCELERATOR")
    if name:
        return name
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def max_steps_for(cfg: PretrainConfig, plan: BatchPlan) -> int:
    if cfg.train.max_steps is not None:
        return cfg.train.max_steps
    assert cfg.train.max_tokens is not None
    return math.ceil(cfg.train.max_tokens / plan.tokens_per_step)


def prepare(cfg: PretrainConfig, world_size: int) -> tuple[PretrainConfig, dict[str, Any], BatchPlan, ModelShape,
                                                         dict[str, Any]]:
    """Everything checked before a process group starts: data manifest, batch arithmetic, DeepSpeed JSON, model.
    With `train.deepspeed_config: auto` the planner picks the DeepSpeed config (and activation checkpointing)."""
    manifest = read_manifest(cfg.data.path)
    seq_len = int(manifest["seq_len"])
    plan = batch_plan(cfg, world_size, seq_len)
    shape = resolve_shape(cfg.model.preset, dict(cfg.model.shape), manifest["tokenizer"]["vocab_size"])
    if seq_len > shape.max_seq_len:
        shape = replace(shape, max_seq_len=seq_len)
    if cfg.train.deepspeed_config == "auto":
        raw, checkpointing = auto_ds_config(shape, plan, world_size)
        cfg = replace(cfg, train=replace(cfg.train, activation_checkpointing=checkpointing))
        source = "deepspeed config chosen by the planner"
    else:
        raw, source = load_ds_config(cfg.train.deepspeed_config), cfg.train.deepspeed_config
    ds = resolve(cfg, raw, plan, accelerator=accelerator_name(), source=source)
    return cfg, ds, plan, shape, manifest


def auto_ds_config(shape: ModelShape, plan: BatchPlan, world_size: int) -> tuple[dict[str, Any], bool]:
    """Plan for this machine and world: nodes from the launcher's LOCAL_SIZE, the card from torch (a CPU run
    counts host RAM shared by its ranks), host RAM from the OS; the config's micro-batch is kept."""
    from pipeline.plan import search as planner
    from pipeline.plan.gpus import GPU, lookup

    local = int(os.environ.get("LOCAL_SIZE", os.environ.get("LOCAL_WORLD_SIZE", str(world_size))))
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    card: GPU
    if accelerator_name() == "cuda":
        import torch

        name = torch.cuda.get_device_name(0)
        try:
            card = replace(lookup(name), memory_gib=torch.cuda.get_device_properties(0).total_memory / 2**30)
        except KeyError:
            raise PipelineError(f"train.deepspeed_config auto: no planner data for GPU '{name}'; run "
                                "`pipeline plan` with a known --gpu and --write-ds-config") from None
    else:
        card = GPU("CPU rank", ram / max(1, local) / 2**30 * 0.8, 0.5, 20.0, 0, 10.0, True)
    cluster = planner.Cluster(max(1, world_size // local), local, card, ram)
    result = planner.search(shape, plan.seq_len, cluster, plan.tokens_per_step, fixed_micro=plan.micro_batch_size)
    if result.best is None:
        raise PipelineError("train.deepspeed_config auto: nothing fits this machine; see `pipeline plan` for "
                            "what would: " + "; ".join(result.advice))
    return planner.ds_config(result.best), result.best.candidate.activation_checkpointing


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="pipeline/pretrain.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True, help="YAML config (see configs/).")
    ap.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                    help="Override a config field, e.g. --set optim.lr=1e-3 (repeatable).")
    ap.add_argument("--dry-run", action="store_true", help="Print the resolved config, batch plan and DeepSpeed "
                    "config, then exit without starting training.")
    ap.add_argument("--local_rank", type=int, default=int(os.environ.get("LOCAL_RANK", "0")),
                    help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        cfg = load(args.config, args.set)
        world = int(os.environ.get("WORLD_SIZE", "1"))
        cfg, ds, plan, shape, manifest = prepare(cfg, world)
    except PipelineError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.dry_run:
        if int(os.environ.get("RANK", "0")) != 0:
            return 0
        print(dump(cfg))
        print(f"# batch: micro {plan.micro_batch_size} x data-parallel {plan.data_parallel_size} x grad-accum "
              f"{plan.grad_accum} = {plan.global_batch_size} sequences of {plan.seq_len} tokens")
        print(f"# model: {shape.num_params() / 1e6:.1f}M parameters {shape.as_dict()}")
        print("# deepspeed config:")
        print(json.dumps(ds, indent=2))
        return 0
    from pipeline.train.loop import train

    try:
        return train(cfg, ds, plan, shape, manifest)
    except PipelineError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    try:
        code = main()
    except SystemExit as exit_request:  # --help, argparse errors
        code = exit_request.code if isinstance(exit_request.code, int) else 2
    except BaseException:  # noqa: B036 - report, then leave without interpreter teardown (below)
        import traceback

        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter teardown: it would join DataLoader workers (which outlive SIGTERM so a preempted rank can
    # save) and can hit an upstream gloo shutdown race that aborts ~1 in 10 clean runs at exit.
    os._exit(code)
