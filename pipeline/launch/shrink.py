"""Continuing on the hosts that answer (`pipeline pretrain --hostfile H --min-nodes N`): before each launch every
host of the hostfile is reached over ssh; when some do not answer and at least N do, the run launches on those, if
the planner says the run fits them as it fits the whole hostfile. The global batch stays exact (more gradient
accumulation; a smaller micro-batch where the ranks no longer divide it; where no micro-batch does, the nearest
global batch that splits, said), the token order is the same at any world
size, and the ranks resume through DeepSpeed's universal checkpoint. A host that answers again is taken back at the
next launch, by the same rules. Each change of hosts is said on the terminal and kept in RUN_DIR/logs/launch.log and
as an `"event": "hosts"` record of RUN_DIR/metrics.jsonl."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import click

from pipeline.atomic import write_text
from pipeline.errors import PipelineError
from pipeline.launch.command import planned_args
from pipeline.plan.cluster import sequence_parallel_divides

if TYPE_CHECKING:
    from pipeline.train.setup.prepare import Prepared
from pipeline.plan.hostfile import hostfile_hosts

SURVIVORS = "hostfile.answering"
"""The hostfile of a launch on fewer hosts, in RUN_DIR/logs (the hostfile's comments, its `# cluster:` line among
them, and the hosts that answer, in its order)."""


def micro_batch_for(global_batch: int, micro: int, replicas: int) -> int | None:
    """The largest micro-batch, at most `micro`, that splits `global_batch` sequences exactly over `replicas`
    data-parallel ranks (the rest is gradient accumulation); None when none does."""
    return next((m for m in range(micro, 0, -1) if global_batch % (m * replicas) == 0), None)


@dataclass(frozen=True, kw_only=True, slots=True)
class KeptBatch:
    """The run's batch carried to another world size (a lost host, a requeued job on fewer nodes): the global batch
    kept, with the largest micro-batch up to the run's own that splits it exactly; where none does, the global
    batch nearest the run's that the run's micro-batch splits (said: the steps then hold slightly more or fewer
    sequences)."""

    global_batch: int
    micro_batch: int
    sequence_parallel: int
    seq_len: int
    in_tokens: bool
    """The config gives batch.global_batch_tokens (a changed global batch is given the same way)."""

    def on(self, world: int, who: str = "the ranks", fix: str = "") -> tuple[int, int]:
        """(micro-batch, global batch) on `world` ranks; PipelineError where sequence parallelism cannot split
        them (`who` and `fix` word it)."""
        sp = self.sequence_parallel
        if found := sequence_parallel_divides(sp, world):
            raise PipelineError(f"{who}: {found[0]}; not continuing on them. {fix}".rstrip())
        replicas = world // sp
        micro = micro_batch_for(self.global_batch, self.micro_batch, replicas)
        if micro is not None:
            return micro, self.global_batch
        per_step = self.micro_batch * replicas
        return self.micro_batch, max(per_step, round(self.global_batch / per_step) * per_step)

    def sets(self, world: int, who: str = "the ranks", fix: str = "") -> list[str]:
        """The config `--set`s that give this batch on `world` ranks (none when the run's own does)."""
        micro, global_batch = self.on(world, who, fix)
        sets = [f"batch.micro_batch_size={micro}"] if micro != self.micro_batch else []
        if global_batch != self.global_batch:
            sets.append(
                f"batch.global_batch_tokens={global_batch * self.seq_len}"
                if self.in_tokens
                else f"batch.global_batch_size={global_batch}"
            )
        return sets

    def said(self, world: int) -> str:
        micro, global_batch = self.on(world)
        if global_batch != self.global_batch:
            return (
                f", {global_batch} sequences per step instead of {self.global_batch}: the nearest that "
                f"{world // self.sequence_parallel} data-parallel ranks split"
            )
        if micro != self.micro_batch:
            return f", micro-batch {micro} instead of {self.micro_batch}, the same {global_batch} sequences per step"
        return f", the same {global_batch} sequences per step"


@dataclass(kw_only=True)
class Survivors:
    """The launch command for the hosts of `hostfile` that answer (`command`), or why the run must stop."""

    cmd: list[str]
    """The launch on the whole hostfile, as built (its `--hostfile` and the config's `--set`s are replaced)."""
    config: str
    sets: list[str]
    hostfile: str
    min_nodes: int
    run_dir: Path
    global_batch: int
    micro_batch: int
    sequence_parallel: int
    seq_len: int
    batch_in_tokens: bool
    """The config gives batch.global_batch_tokens (a changed global batch is given the same way)."""
    hosts: list[tuple[str, int]] = field(init=False)
    current: list[str] = field(init=False)
    _whole_fits: tuple[bool, str] | None = field(default=None, init=False)
    _say: Callable[[str], None] = field(default=print, init=False)

    def __post_init__(self) -> None:
        self.hosts = hostfile_hosts(self.hostfile)
        self.current = [h for h, _ in self.hosts]

    @property
    def batch(self) -> KeptBatch:
        return KeptBatch(
            global_batch=self.global_batch,
            micro_batch=self.micro_batch,
            sequence_parallel=self.sequence_parallel,
            seq_len=self.seq_len,
            in_tokens=self.batch_in_tokens,
        )

    def command(self, lost: list[tuple[str, str]], say: Callable[[str], None] | None = None) -> list[str]:
        """The launch on every host that answers (`lost`: (host, why) of those that do not); raises PipelineError
        with the reason when the run must stop instead. What changed is said through `say` (default: stderr)."""
        self._say = say or (lambda line: click.echo(line, err=True))
        gone = dict(lost)
        answering = [(h, n) for h, n in self.hosts if h not in gone]
        names = [h for h, _ in answering]
        if names == self.current:
            return self._cmd_for(answering)
        said = "; ".join(f"{h} ({why})" for h, why in lost)
        if len(answering) < self.min_nodes:
            raise PipelineError(
                f"{len(answering)} of {len(self.hosts)} hosts answer ssh (not {said}), fewer than --min-nodes "
                f"{self.min_nodes}: not launching. Bring them back and run the same command"
            )
        cmd = self._cmd_for(answering)
        world = sum(n for _, n in answering)
        if lost:
            self._say(
                f"{len(lost)} host(s) of {self.hostfile} do not answer ssh: {said}. Continuing on the "
                f"{len(answering)} that do ({', '.join(names)}; {world} ranks{self._said_batch(world)}), from the "
                "latest complete checkpoint"
            )
        else:
            self._say(f"every host of {self.hostfile} answers again: launching on all {len(names)}")
        self._record(names, lost, world)
        self.current = names
        return cmd

    def _batch_sets(self, world: int) -> list[str]:
        return self.batch.sets(world, "the hosts that answer", "Bring the lost hosts back and run the same command")

    def _said_batch(self, world: int) -> str:
        return self.batch.said(world)

    def _cmd_for(self, answering: list[tuple[str, int]]) -> list[str]:
        if len(answering) == len(self.hosts):
            return list(self.cmd)
        world = sum(n for _, n in answering)
        sets = [*self.sets, *self._batch_sets(world)]
        path = self._write_hostfile([h for h, _ in answering])
        prepared = self._check_fits(str(path), sets, world, max(n for _, n in answering))
        cmd = list(self.cmd)
        cmd[cmd.index("--hostfile") + 1] = str(path)
        config_at = cmd.index("--config")
        return cmd[: config_at + 2] + [a for s in sets for a in ("--set", s)] + planned_args(prepared, str(path))

    def _write_hostfile(self, names: list[str]) -> Path:
        keep, lines = set(names), []
        for line in Path(self.hostfile).read_text().splitlines():
            words = line.split()
            if not words or line.lstrip().startswith("#") or words[0] in keep:
                lines.append(line)
        path = self.run_dir / "logs" / SURVIVORS
        path.parent.mkdir(parents=True, exist_ok=True)
        write_text(path, "\n".join(lines) + "\n")
        return path

    def _check_fits(self, hostfile: str, sets: list[str], world: int, per_node: int) -> Prepared:
        """The trainer's own checks for the smaller world, and the planner's word: refused when the whole hostfile
        fits and the hosts that answer do not (a quarter less host RAM for offload, a larger ZeRO shard per card).
        The run as prepared for that world (under `deepspeed_config: auto`, its layout planned for it)."""
        from pipeline.train.checkpoint.resume import continue_from, resumable
        from pipeline.train.setup.config import load
        from pipeline.train.setup.prepare import prepare

        try:
            prepared = prepare(cfg := load(self.config, sets), world, per_node)
            c = cfg.checkpoint
            if found := resumable(self.run_dir, c.resume, c.verify, c.branch_from):
                if note := continue_from(prepared, world, found.tag, found.marker, folder=found.folder):
                    self._say(note)
        except PipelineError as e:
            raise PipelineError(f"not continuing on the hosts that answer: {e}") from None
        fits, why = _plan_fits(self.config, sets, hostfile)
        if fits:
            return prepared
        if self._whole_fits is None:
            self._whole_fits = _plan_fits(self.config, self.sets, self.hostfile)
        if self._whole_fits[0]:
            raise PipelineError(
                f"the plan for the {world} ranks of the hosts that answer does not fit ({why}), where the whole "
                f"hostfile's does: not continuing on them. Bring the lost hosts back and run the same command "
                f"(`pipeline plan --config {self.config} --hostfile {hostfile}` shows the plan)"
            )
        self._say(
            f"note: the planner does not fit this run on the whole hostfile either ({self._whole_fits[1]}), so it "
            "cannot judge the hosts that answer; launching on them as the whole run was launched"
        )
        return prepared

    def _record(self, names: list[str], lost: list[tuple[str, str]], world: int) -> None:
        record_hosts(self.run_dir, names, {h: why for h, why in lost}, world)


def record_hosts(run_dir: Path, names: list[str], lost: dict[str, str], world: int) -> None:
    """A change of hosts in the run's launch log and metrics.jsonl (a record with no step: a resume keeps it)."""
    from pipeline.train.checkpoint.files import latest_complete, read_marker

    tag = latest_complete(run_dir)
    record = {
        "event": "hosts",
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "hosts": names,
        "lost": lost,
        "world_size": world,
        "from_step": int(read_marker(run_dir, tag)["step"]) if tag else 0,
    }
    line = json.dumps(record) + "\n"
    for path in (run_dir / "metrics.jsonl", run_dir / "logs" / "launch.log"):
        if path.parent.is_dir():
            with open(path, "a") as f:
                f.write(line)


def _plan_fits(config: str, sets: list[str], hostfile: str) -> tuple[bool, str]:
    """Whether the planner fits the config on the hosts of `hostfile` (their `# cluster:` facts, else the
    defaults), and why not."""
    from pipeline.plan.facts import CLUSTER_DEFAULTS, cluster_from_flags
    from pipeline.train.forecast import forecast_config

    cluster, _ = cluster_from_flags(hostfile, 1, 1, dict.fromkeys(CLUSTER_DEFAULTS))
    try:
        f = forecast_config(config, sets, cluster, seq_len=None, layers=None, vocab_size=32000, mfu=None)
    except PipelineError as e:
        return False, str(e)
    return f.yours.fits, "; ".join(f.yours.why_not)
