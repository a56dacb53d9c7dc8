"""Building and supervising the `deepspeed` command lines that `pipeline pretrain` and `pipeline evaluate --num-gpus
| --hostfile` start: every check that can run before a process starts has run first (pipeline.train.preflight: a
bad input fails in a second, with one message listing every problem), then the launcher runs in a process tree
that pipeline.launch.supervise supervises (signals forwarded to the ranks, the log kept), again after a failure a
relaunch can fix (`--max-restarts`). The command line itself is pipeline.launch.command's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from pipeline.errors import PipelineError
from pipeline.launch.command import PACKAGE, Where, core_binding_args, planned_args
from pipeline.launch.scheduler import Scheduled
from pipeline.launch.shrink import Survivors
from pipeline.launch.supervise import run_with_restarts
from pipeline.plan.hostfile import hostfile_hosts
from pipeline.train.runtime.ops import use_project_cache

if TYPE_CHECKING:  # the heavy modules are imported where they are used: `pipeline --help` stays fast
    from pipeline.evaluate.inputs import EvalConfig
    from pipeline.launch.scheduler import NodeWorld
    from pipeline.plan.cluster import Layout
    from pipeline.train.setup.config import PretrainConfig


def pretrain(
    config_path: str,
    sets: list[str],
    where: Where,
    *,
    dry_run: bool,
    max_restarts: int,
    skip_doctor: bool,
    min_nodes: int | None = None,
    scheduled: Scheduled | None = None,
) -> int:
    """`pipeline pretrain`: the checks every rank will make, made here first; the quick local checks of `pipeline
    doctor`; then `deepspeed ... pipeline/pretrain.py`, printed and run (again, with `max_restarts`; with
    `min_nodes`, on the hosts of the hostfile that answer). Returns its exit code."""
    from pipeline.train.main import describe
    from pipeline.train.preflight import before_launch
    from pipeline.train.setup.config import load
    from pipeline.train.setup.prepare import prepare

    scheduled = scheduled or Scheduled()
    if problem := scheduled.problem(where.hostfile, max_restarts, min_nodes):
        raise PipelineError(problem)
    if scheduled.from_env:
        return pretrain_from_env(
            config_path,
            sets,
            where.num_gpus,
            nodes=scheduled.nodes,
            min_nodes=min_nodes,
            dry_run=dry_run,
            skip_doctor=skip_doctor,
        )
    if scheduled.sbatch:
        return write_job_script(config_path, sets, where.num_gpus, scheduled, min_nodes)
    cfg = load(config_path, sets)
    if min_nodes is not None and not where.hostfile:
        raise PipelineError("--min-nodes N needs --hostfile: it says on how few of its hosts a run may go on")
    hosts = [h for h, _ in hostfile_hosts(where.hostfile)] if where.hostfile else None
    if min_nodes is not None and hosts and not 1 <= min_nodes <= len(hosts):
        raise PipelineError(f"--min-nodes {min_nodes}: {where.hostfile} has {len(hosts)} host(s); give 1 to that many")
    if min_nodes is not None and max_restarts == 0:
        raise PipelineError(
            f"--min-nodes {min_nodes} acts when a failed launch is relaunched, and --max-restarts is 0: the first lost "
            "host would end the run. Add --max-restarts N (e.g. --max-restarts 3)"
        )
    where.check_local_gpus()
    where = where.resolved()
    world, per_node = where.world_size()
    prepared = prepare(cfg, world, per_node)  # the same checks every rank makes, before any process starts
    # The rendezvous port matters to a launch, not to a dry run (which starts nothing and may run beside a live one).
    failed = _quick_doctor(cfg, None if where.hostfile or dry_run else where.master_port or 29500)
    # One error for every problem: the run folder free, shards whole, the checkpoint it continues, disk, the doctor.
    for note in before_launch(prepared, world, per_node, more=[] if skip_doctor else failed):
        click.echo(note, err=True)
    if min_nodes is not None and hosts and (sp := prepared.layout.sequence_parallel) > 1:
        kept = [n for n in range(min_nodes, len(hosts) + 1) if not (n * per_node) % sp]
        if len(kept) < len(hosts) - min_nodes + 1:
            click.echo(
                f"note: with train.sequence_parallel {sp} a relaunch goes on with "
                f"{', '.join(map(str, kept)) or 'no number'} of the {len(hosts)} hosts (a group of {sp} ranks shares "
                "each sample); with another number of hosts answering it stops, naming them",
                err=True,
            )
    if dry_run:
        click.echo(describe(prepared))
        return 0
    build_ops_ahead(prepared.layout, world, per_node)
    cmd = [*where.launcher(core_binding_args(prepared.ds, per_node)), str(PACKAGE / "pretrain.py")]
    cmd += ["--config", config_path]
    for s in sets:
        cmd += ["--set", s]
    cmd += planned_args(prepared, where.hostfile)
    use_project_cache()  # the ranks of this machine inherit it
    shown = [
        ("<the layout planned here>" if prev == "--planned" else a) for prev, a in zip(["", *cmd], cmd, strict=False)
    ]
    click.echo("+ " + " ".join(shown), err=True)
    survivors = None
    if min_nodes is not None and where.hostfile:
        survivors = Survivors(
            cmd=cmd,
            config=config_path,
            sets=list(sets),
            hostfile=where.hostfile,
            min_nodes=min_nodes,
            run_dir=Path(cfg.run_dir),
            global_batch=prepared.plan.global_batch_size,
            micro_batch=prepared.plan.micro_batch_size,
            sequence_parallel=prepared.plan.sequence_parallel,
            seq_len=prepared.plan.seq_len,
            batch_in_tokens=cfg.batch.global_batch_tokens is not None,
        )
    return run_with_restarts(cmd, max_restarts, Path(cfg.run_dir), hosts, survivors)


def pretrain_from_env(
    config_path: str,
    sets: list[str],
    num_gpus: int | None,
    *,
    nodes: int | None,
    min_nodes: int | None,
    dry_run: bool,
    skip_doctor: bool,
) -> int:
    """`pipeline pretrain --from-env`, run by a scheduler on every node alike (pipeline.launch.scheduler): the world
    from the environment; the first node makes the launch's checks and says in the run folder that they passed,
    the others wait for that word (which proves the folder is shared); then each node starts DeepSpeed's launcher
    for its own ranks. A relaunch is the scheduler's (`sbatch --requeue`): the run resumes from its latest complete
    checkpoint, on whatever nodes the job was given. `nodes`: the nodes the run was planned for; with `min_nodes`
    it goes on with as few, with the same global batch (pipeline.launch.shrink.KeptBatch), else refuses fewer."""
    from pipeline.launch.scheduler import Handshake, from_environment, node_command
    from pipeline.launch.shrink import record_hosts
    from pipeline.train.main import describe
    from pipeline.train.preflight import before_launch
    from pipeline.train.runtime.dist import accelerator_name, visible_gpus
    from pipeline.train.setup.config import load
    from pipeline.train.setup.prepare import prepare

    cfg = load(config_path, sets)
    world = from_environment(os.environ, num_gpus, visible_gpus() if accelerator_name() == "cuda" else 0)
    click.echo(f"launched by a scheduler: {world.describe()}", err=True)
    planned, fewest = nodes or world.nnodes, min_nodes or nodes or world.nnodes
    if not fewest <= world.nnodes <= planned:
        asked = f"--min-nodes {fewest}" if world.nnodes < fewest and min_nodes else f"--nodes {planned}"
        raise PipelineError(
            f"{world.source} has {world.nnodes} node(s) ({', '.join(world.hosts)}), and the run asks {asked}: "
            f"ask the scheduler for {planned} (`#SBATCH --nodes`), or give --nodes {world.nnodes} to run on these "
            "(a resume converts the checkpoint to the new world size)"
        )
    Where(num_gpus=world.per_node).check_local_gpus()
    sets = list(sets)
    if world.nnodes < planned:  # a job started or requeued on fewer nodes: the run's batch kept
        sets += _kept_batch_sets(cfg, world, planned, fewest)
        cfg = load(config_path, sets)
    prepared = prepare(cfg, world.world_size, world.per_node)
    handshake = Handshake(Path(cfg.run_dir), world)
    if world.node_rank == 0:
        try:
            failed = _quick_doctor(cfg, None if dry_run else world.master_port)
            notes = before_launch(prepared, world.world_size, world.per_node, more=[] if skip_doctor else failed)
        except PipelineError as e:
            if not dry_run:
                handshake.say(False, str(e))
            raise
        for note in notes:
            click.echo(note, err=True)
    if dry_run:
        click.echo(describe(prepared))
        return 0
    if world.node_rank == 0:
        if world.nnodes < planned:
            record_hosts(Path(cfg.run_dir), list(world.hosts), {}, world.world_size)
        handshake.say(True)
    else:
        handshake.wait(lambda line: click.echo(line, err=True))
    build_ops_ahead(prepared.layout, world.world_size, world.per_node)
    args = ["--config", config_path, *[a for s in sets for a in ("--set", s)], *planned_args(prepared, None)]
    bind = core_binding_args(prepared.ds, world.per_node)
    cmd = node_command(world, PACKAGE / "pretrain.py", args, sys.executable, bind)
    use_project_cache()
    click.echo("+ " + " ".join(a if not a.startswith("--world_info=") else "--world_info=..." for a in cmd), err=True)
    log = "launch.log" if world.node_rank == 0 else f"launch-node{world.node_rank}.log"
    return run_with_restarts(cmd, 0, Path(cfg.run_dir), log_name=log)


def _kept_batch_sets(cfg: PretrainConfig, world: NodeWorld, planned: int, fewest: int) -> list[str]:
    """The `--set`s that keep the run's global batch (planned for `planned` nodes) on the fewer nodes of `world`
    (pipeline.launch.shrink.KeptBatch), said on the terminal."""
    from pipeline.launch.shrink import KeptBatch
    from pipeline.train.setup.prepare import prepare

    whole = prepare(cfg, planned * world.per_node, world.per_node).plan
    kept = KeptBatch(
        global_batch=whole.global_batch_size,
        micro_batch=whole.micro_batch_size,
        sequence_parallel=whole.sequence_parallel,
        seq_len=whole.seq_len,
        in_tokens=cfg.batch.global_batch_tokens is not None,
    )
    fix = f"Ask the scheduler for {planned} nodes"
    sets = kept.sets(world.world_size, f"the {world.nnodes} node(s) of {world.source}", fix)
    click.echo(
        f"{world.source} has {world.nnodes} of the {planned} nodes the run was planned for (--min-nodes "
        f"{fewest}): going on with {world.world_size} ranks{kept.said(world.world_size)}, from the latest "
        "complete checkpoint",
        err=True,
    )
    return sets


def write_job_script(
    config_path: str, sets: list[str], gpus: int | None, scheduled: Scheduled, min_nodes: int | None
) -> int:
    """`pipeline pretrain --sbatch FILE --nodes N`: the config checked for N nodes (and for --min-nodes, the fewest
    a requeued job may get) as every rank will check it, then the Slurm batch script written."""
    from pipeline.atomic import write_text
    from pipeline.launch.scheduler import job_script
    from pipeline.train.setup.config import load
    from pipeline.train.setup.prepare import prepare

    assert scheduled.sbatch is not None and scheduled.nodes is not None
    cfg = load(config_path, sets)
    per_node = gpus or 1
    for n in sorted({scheduled.nodes, min_nodes or scheduled.nodes}):
        try:
            prepare(cfg, n * per_node, per_node)
        except PipelineError as e:
            raise PipelineError(f"on {n} node(s) x {per_node} rank(s): {e}") from None
    script = Path(scheduled.sbatch)
    text = job_script(
        config=config_path,
        sets=sets,
        nodes=scheduled.nodes,
        min_nodes=min_nodes,
        gpus_per_node=gpus or 0,
        time_limit=scheduled.time_limit,
        partition=scheduled.partition,
        requeue=scheduled.requeue,
        grace_s=GRACE_S,
        workdir=Path.cwd(),
        python_bin=Path(sys.executable).parent,
        output=script.resolve().with_name(script.stem + "-%j.out"),
    )
    write_text(script, text)
    script.chmod(0o755)
    if not gpus:
        click.echo("no --num-gpus: the job asks for no GPUs (one CPU rank per node)", err=True)
    click.echo(f"wrote {script}; submit it with: sbatch {script}")
    return 0


GRACE_S = 300
"""How long before the time limit a --sbatch job is told to stop: a step's end and a checkpoint's save."""


def _quick_doctor(cfg: PretrainConfig, master_port: int | None) -> list[str]:
    """`pipeline doctor`'s checks that need no import of torch or deepspeed, on this machine (its WARN and FAIL
    lines shown); the FAILs, which stop the launch unless --skip-doctor."""
    from pipeline.doctor.checks import Needs, quick_checks
    from pipeline.train.runtime.dist import accelerator_name

    cuda = accelerator_name() == "cuda"
    shown, failed = quick_checks(
        Needs(run_dir=cfg.run_dir, data_path=cfg.data.path, master_port=master_port, pins_memory=cuda)
    )
    for line in shown:
        click.echo(line, err=True)
    return failed


def build_ops_ahead(layout: Layout, world: int, per_node: int) -> None:
    """The DeepSpeed ops this run loads and this environment has not built yet, built here before the launch
    (in parallel, with their times), instead of silently by every rank for a minute or more."""
    from pipeline.train.runtime.dist import accelerator_name
    from pipeline.train.runtime.ops import build, clear_stale_locks, is_built, needed

    ops = needed(layout, accelerator_name(), per_node if world > 1 else 1)
    clear_stale_locks(ops, lambda line: click.echo(line, err=True))  # built or not: the ranks load through the lock
    todo = [n for n in ops if not is_built(n)]
    if not todo:
        return
    click.echo(
        f"building DeepSpeed's {', '.join(todo)} op(s) for this environment (once; about a minute each, in "
        f"parallel; kept in {use_project_cache()})",
        err=True,
    )
    for name, seconds, error in build(todo, jobs=len(todo), say=lambda line: click.echo(line, err=True)):
        if error is None:
            click.echo(f"  built {name} in {seconds:.0f} s", err=True)
        else:
            click.echo(f"  {name} not built here ({error}); the ranks will try, and say why if it fails", err=True)


def evaluate(cfg: EvalConfig, where: Where) -> dict[str, Any]:
    """`pipeline evaluate --num-gpus N | --hostfile H`: the inputs checked here, then one rank per GPU under the
    launcher (ZeRO-3, pipeline.evaluate.distributed); rank 0 writes the results file, read back here."""
    from pipeline.evaluate import run as stage
    from pipeline.evaluate.inputs import open_inputs

    where.check_local_gpus()
    inputs = open_inputs(cfg)  # bad input fails here, in a second, before any rank starts
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
