"""Building and supervising the `deepspeed` command lines that `pipeline pretrain` and `pipeline evaluate --num-gpus
| --hostfile` start: every check that can run before a process starts runs here first (a bad input fails in a
second with one message), then the launcher runs, again after a failure a relaunch can fix (`--max-restarts`)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click

from pipeline.errors import PipelineError
from pipeline.train.ops import use_project_cache

PACKAGE = Path(__file__).resolve().parent


@dataclass(frozen=True, kw_only=True, slots=True)
class Where:
    """Where the ranks run: the hosts of a hostfile, or N ranks on this machine (None: what the launcher sees)."""

    hostfile: str | None = None
    num_gpus: int | None = None
    master_port: int | None = None

    def __post_init__(self) -> None:
        if self.hostfile and not Path(self.hostfile).is_file():
            raise PipelineError(f"--hostfile {self.hostfile}: no such file (see hostfiles/)")

    def world_size(self) -> tuple[int | None, int | None]:
        """(ranks, ranks per node) the launcher will start: from the hostfile's slots, or --num-gpus; None when the
        launcher decides (all local GPUs), since only it knows what it will see."""
        if self.hostfile:
            from pipeline.plan.hostfile import hostfile_slots

            slots = hostfile_slots(self.hostfile)
            return sum(slots), max(slots)
        return self.num_gpus, self.num_gpus

    def check_local_gpus(self) -> None:
        """Refuse more local ranks than GPUs (on a GPU machine; CPU ranks are processes, any number)."""
        from pipeline.train.dist import accelerator_name, local_ranks_problem, visible_gpus

        if not self.hostfile and (problem := local_ranks_problem(self.num_gpus, accelerator_name(), visible_gpus())):
            raise PipelineError(problem)

    def launcher(self, bind_cores: bool = False) -> list[str]:
        """`deepspeed [--hostfile H | --num_gpus N] [--master_port P] [--bind_cores_to_rank]`, the launcher of this
        environment."""
        found = shutil.which("deepspeed", path=str(Path(sys.executable).parent)) or shutil.which("deepspeed")
        if found is None:
            raise PipelineError("the `deepspeed` launcher is not installed in this environment (pip install deepspeed)")
        cmd = [found]
        if self.hostfile:
            cmd += ["--hostfile", self.hostfile]
        elif self.num_gpus:
            cmd += ["--num_gpus", str(self.num_gpus)]
        if self.master_port:
            cmd += ["--master_port", str(self.master_port)]
        if bind_cores:
            cmd.append("--bind_cores_to_rank")
        return cmd


def binds_cores(ds: dict[str, Any]) -> bool:
    """Whether a launch should bind each rank to its share of the node's cores (DeepSpeed's --bind_cores_to_rank,
    which also sets OMP_NUM_THREADS): with the optimizer offloaded to the CPU (CPU Adam runs on those cores, 1.3x
    faster bound, DeepSpeed PR #7474), when numactl is installed (DeepSpeed needs it to bind; without it each rank
    sets its thread count itself) and no OMP_NUM_THREADS or KMP_AFFINITY says otherwise."""
    from pipeline.plan.cluster import offload_devices

    if offload_devices(ds).optimizer == "none" or shutil.which("numactl") is None:
        return False
    return not any(k in os.environ for k in ("OMP_NUM_THREADS", "KMP_AFFINITY"))


def pretrain(
    config_path: str, sets: list[str], where: Where, *, dry_run: bool, max_restarts: int, skip_doctor: bool
) -> int:
    """`pipeline pretrain`: the checks every rank will make, made here first; the quick local checks of `pipeline
    doctor`; then `deepspeed ... pipeline/pretrain.py`, printed and run (again, with `max_restarts`). Returns its
    exit code."""
    from pipeline.train.config import load
    from pipeline.train.main import describe
    from pipeline.train.prepare import prepare

    cfg = load(config_path, sets)
    where.check_local_gpus()
    world, per_node = where.world_size()
    prepared = None
    if world is not None:
        prepared = prepare(cfg, world, per_node)  # the same checks every rank makes, before any process starts
        check_checkpoint_space(prepared, world, per_node or world)
    quick_doctor(cfg, None if where.hostfile else where.master_port or 29500, skip_doctor)
    if dry_run and prepared is not None:
        click.echo(describe(prepared))
        return 0
    cmd = [*where.launcher(bind_cores=prepared is not None and binds_cores(prepared.ds)), str(PACKAGE / "pretrain.py")]
    cmd += ["--config", config_path]
    for s in sets:
        cmd += ["--set", s]
    if dry_run:
        cmd.append("--dry-run")
    use_project_cache()  # the ranks of this machine inherit it
    click.echo("+ " + " ".join(cmd), err=True)
    return run_with_restarts(cmd, max_restarts)


def quick_doctor(cfg: Any, master_port: int | None, skip: bool) -> None:
    """`pipeline doctor`'s checks that need no import of torch or deepspeed, on this machine; a FAIL stops the
    launch unless --skip-doctor."""
    from pipeline.doctor.checks import FAIL, WARN, Needs, run_checks

    report = run_checks(Needs(run_dir=cfg.run_dir, data_path=cfg.data.path, master_port=master_port), quick=True)
    for c in report.checks:
        if c.status in (WARN, FAIL):
            click.echo(f"doctor: {c.status} {c.name}: {c.detail}" + (f" ({c.fix})" if c.fix else ""), err=True)
    failed = [c.name for c in report.checks if c.status == FAIL]
    if failed and not skip:
        raise PipelineError(
            f"local checks failed ({', '.join(failed)}; see above); fix them, or launch anyway with --skip-doctor"
        )


def check_checkpoint_space(prepared: Any, world: int, per_node: int) -> None:
    """Refuse a run whose checkpoints cannot be saved safely on this node's disk (the first node's: the busiest)."""
    from pipeline.train import checkpoint as ckpt

    cfg = prepared.cfg
    if not cfg.checkpoint.enabled:
        return
    size = ckpt.checkpoint_size(prepared, world, per_node)
    if problem := ckpt.space_problem(cfg.run_dir, size, cfg.checkpoint.keep_last):
        raise PipelineError(problem)


def run_with_restarts(cmd: list[str], max_restarts: int) -> int:
    """Run the launcher; after a failure that a relaunch can fix, run it again (the run resumes from its latest
    complete checkpoint), up to `max_restarts` times. Exit code 2 is ours for a mistake in the input or a run
    stopped on purpose (non-finite loss, full disk): a relaunch would fail the same way."""
    restarts = 0
    while True:
        started = time.monotonic()
        code = subprocess.call(cmd, env=os.environ.copy())
        if code in (0, 2, 130) or restarts >= max_restarts:
            if code not in (0, 2, 130) and max_restarts:
                click.echo(f"launch failed with exit code {code}; no restarts left ({max_restarts} used)", err=True)
            return code
        restarts += 1
        click.echo(
            f"launch failed with exit code {code} after {time.monotonic() - started:.0f} s; restart "
            f"{restarts} of {max_restarts}, from the latest complete checkpoint",
            err=True,
        )


def evaluate(cfg: Any, where: Where) -> dict[str, Any]:
    """`pipeline evaluate --num-gpus N | --hostfile H`: the inputs checked here, then one rank per GPU under the
    launcher (ZeRO-3, pipeline.evaluate.distributed); rank 0 writes the results file, read back here."""
    from pipeline.evaluate import run as stage

    where.check_local_gpus()
    inputs = stage.open_inputs(cfg)  # bad input fails here, in a second, before any rank starts
    target = stage.result_path(cfg, inputs.run)
    before = target.stat().st_mtime_ns if target.exists() else None
    args = ["--checkpoint", cfg.checkpoint, "--split", cfg.split, "--batch-size", str(cfg.batch_size)]
    args += ["--max-new-tokens", str(cfg.max_new_tokens), "--seed", str(cfg.seed), "--output", str(target)]
    for flag, value in (("--data", cfg.data), ("--max-batches", cfg.max_batches), ("--prompts", cfg.prompts)):
        if value is not None:
            args += [flag, str(value)]
    cmd = [*where.launcher(), "--no_local_rank", "--module", "pipeline.cli", "evaluate", *args, "--launched"]
    use_project_cache()
    click.echo("+ " + " ".join(cmd), err=True)
    code = subprocess.call(cmd, env=os.environ.copy())
    if code != 0 or not target.exists() or target.stat().st_mtime_ns == before:
        raise PipelineError(f"the distributed evaluation failed (exit code {code}); see the ranks' output above")
    return {**json.loads(target.read_text()), "output": str(target)}
