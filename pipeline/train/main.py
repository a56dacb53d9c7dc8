"""Stage 3's entry under the launcher: arguments -> config -> checks -> the training loop. `pipeline/pretrain.py`
is the file users launch; it only calls `main()` here."""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import traceback

from pipeline.errors import PipelineError, SaidOnRankZero
from pipeline.train.setup.config import dump, load
from pipeline.train.setup.prepare import Planned, Prepared, prepare

DESCRIPTION = """Stage 3: pretraining through DeepSpeed. Launch as `deepspeed [--hostfile H | --num_gpus N]
pipeline/pretrain.py --config CONFIG.yaml [--set key=value ...] [--dry-run]`; `pipeline pretrain` builds that
command for you."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="pipeline/pretrain.py", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--config", required=True, help="YAML config (see configs/).")
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="Override a config field, e.g. --set optim.lr=1e-3 (repeatable).",
    )
    ap.add_argument(
        "--dry-run",
        action="store_true",
        help="Print the resolved config, batch plan and DeepSpeed config, then exit without starting training.",
    )
    ap.add_argument("--local_rank", type=int, default=int(os.environ.get("LOCAL_RANK", "0")), help=argparse.SUPPRESS)
    # Under deepspeed_config auto, the layout `pipeline pretrain` chose before the launch (no rank searches again).
    ap.add_argument("--planned", default=None, help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    from pipeline.train.runtime.env import allocator_default

    args = parse_args(argv)
    allocator_default()  # before anything touches CUDA; environment.json records it
    try:
        planned = Planned.decode(args.planned) if args.planned else None
        prepared = prepare(load(args.config, args.set), int(os.environ.get("WORLD_SIZE", "1")), planned=planned)
    except PipelineError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.dry_run:
        if int(os.environ.get("RANK", "0")) == 0:
            print(describe(prepared))
        return 0
    from pipeline.train.loop import train

    try:
        return train(prepared)
    except SaidOnRankZero:
        return 2  # rank 0 printed it
    except PipelineError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def describe(prepared: Prepared) -> str:
    """What `--dry-run` prints: the resolved config, the batch arithmetic, the model and the DeepSpeed JSON."""
    cfg, ds, plan, shape = prepared.cfg, prepared.ds, prepared.plan, prepared.shape
    return "\n".join(
        [
            dump(cfg),
            f"# batch: micro {plan.micro_batch_size} x data-parallel {plan.data_parallel_size} x grad-accum "
            f"{plan.grad_accum} = {plan.global_batch_size} sequences of {plan.seq_len} tokens"
            + (f"; {plan.sequence_note}" if plan.sequence_parallel > 1 else ""),
            f"# model: {shape.describe()}"
            if shape.hf_config
            else f"# model: {shape.num_params() / 1e6:.1f}M parameters {shape.as_dict()}",
            *([f"# {prepared.documents.note}"] if prepared.documents.kind != "sdpa" else []),
            "# deepspeed config:",
            json.dumps(ds, indent=2),
        ]
    )


def run_as_script() -> None:
    """Exit codes as a launcher expects them, and no interpreter teardown (`exit_now` says why)."""
    from pipeline.train.runtime.dist import exit_now

    try:
        code = main()
    except SystemExit as exit_request:  # --help, argparse errors
        code = exit_request.code if isinstance(exit_request.code, int) else 2
    except BaseException as e:  # noqa: B036 - report, then leave without interpreter teardown (below)
        if (line := peer_lost(e)) is not None:
            print(line, file=sys.stderr, flush=True)
        else:
            traceback.print_exc()
        code = 1
    exit_now(code)


PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "NCCL communicator was aborted")
"""What gloo and NCCL say in the ranks whose peer died mid-collective (gloo raises a plain RuntimeError)."""


def peer_lost(e: BaseException) -> str | None:
    """One line, without the traceback, for a rank whose collective failed because another rank stopped: the
    cause is that rank's own error (or a lost node), which the user should read instead of a page of gloo's frames
    from every survivor. None for any other exception."""
    import torch.distributed as dist

    text = str(e)
    if not (isinstance(e, dist.DistError) or (isinstance(e, RuntimeError) and any(m in text for m in PEER_LOST))):
        return None
    first = text.strip().splitlines()[0] if text.strip() else type(e).__name__
    first = re.sub(r"^\[[^\]]*\] ", "", first).split(". ")[0]  # gloo's source location and advice
    return (
        f"error: a collective failed on this rank because another rank stopped or the network between them "
        f"failed ({first[:200]}); the first error above, from the rank that stopped, says why"
    )
