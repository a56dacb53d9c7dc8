"""The `deepspeed` command line: where the ranks run (`Where`: a hostfile, or N ranks on this machine), the
CPU-core binding of offloaded runs, and DeepSpeed's one-node launcher that the tests and the bench start directly."""

from __future__ import annotations

import json
import os
import shutil
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from pipeline.errors import PipelineError

if TYPE_CHECKING:
    from pipeline.train.setup.prepare import Prepared

PACKAGE = Path(__file__).resolve().parents[1]
"""The `pipeline` package folder, where pretrain.py (the file the launcher starts on every rank) lives."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Where:
    """Where the ranks run: the hosts of a hostfile, or N ranks on this machine (None: what the launcher sees)."""

    hostfile: str | None = None
    num_gpus: int | None = None
    master_port: int | None = None

    def __post_init__(self) -> None:
        if self.hostfile and not Path(self.hostfile).is_file():
            raise PipelineError(f"--hostfile {self.hostfile}: no such file (see hostfiles/)")

    def world_size(self) -> tuple[int, int]:
        """(ranks, ranks per node) the launcher will start: from the hostfile's slots, or --num-gpus (after
        `resolved`, always given for one machine)."""
        if self.hostfile:
            from pipeline.plan.hostfile import hostfile_slots

            slots = hostfile_slots(self.hostfile)
            return sum(slots), max(slots)
        n = self.num_gpus or 1
        return n, n

    def resolved(self) -> Where:
        """With --num-gpus made explicit on one machine: every GPU this process sees, or one CPU rank. DeepSpeed's
        own default (all GPUs; on a CPU, one rank per NUMA node) would be decided after the checks ran."""
        if self.hostfile or self.num_gpus:
            return self
        from pipeline.train.runtime.dist import accelerator_name, visible_gpus

        n = visible_gpus() if accelerator_name() == "cuda" else 1
        if accelerator_name() != "cuda":
            click.echo("no --num-gpus: 1 CPU rank (give --num-gpus N for more)", err=True)
        return replace(self, num_gpus=max(1, n))

    def check_local_gpus(self) -> None:
        """Refuse more local ranks than GPUs (on a GPU machine; CPU ranks are processes, any number)."""
        from pipeline.train.runtime.dist import accelerator_name, local_ranks_problem, visible_gpus

        if not self.hostfile and (problem := local_ranks_problem(self.num_gpus, accelerator_name(), visible_gpus())):
            raise PipelineError(problem)

    def launcher(self, bind_args: list[str] | None = None) -> list[str]:
        """`deepspeed [--hostfile H | --num_gpus N] [--master_port P] [--bind_cores_to_rank ...]`, the launcher of
        this environment."""
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
        return cmd + list(bind_args or [])


def core_binding_args(ds: dict[str, Any], local_ranks: int) -> list[str]:
    """The launcher's arguments that bind each rank to its share of the node's CPUs (DeepSpeed's
    --bind_cores_to_rank, which also sets OMP_NUM_THREADS): with the optimizer offloaded to the CPU (CPU Adam runs
    on those cores, 1.3x faster bound, DeepSpeed PR #7474), when numactl is installed (DeepSpeed needs it to bind;
    without it each rank sets its thread count itself), no OMP_NUM_THREADS or KMP_AFFINITY says otherwise, and the
    binding leaves no CPU idle (pipeline.train.runtime.dist.core_binding; this node's counts stand for every node's)."""
    from pipeline.plan.cluster import offload_devices
    from pipeline.train.runtime.dist import core_binding, cpu_counts

    if offload_devices(ds).optimizer == "none" or shutil.which("numactl") is None:
        return []
    if any(k in os.environ for k in ("OMP_NUM_THREADS", "KMP_AFFINITY")):
        return []
    args, _, why = core_binding(*cpu_counts(), local_ranks)
    click.echo(f"CPU Adam's cores: {why}", err=True)
    return args


def node_launcher_command(script: Path, *args: str, num_gpus: int, port: int) -> list[str]:
    """DeepSpeed's launcher for this one node (`python -m deepspeed.launcher.launch`), which starts the ranks,
    watches them and stops them all when one fails: exactly what `deepspeed --num_gpus N` builds and runs for a
    single node, without the front end's own Python start (3 s). The tests and the GPU bench launch through it."""
    import base64

    world = base64.urlsafe_b64encode(json.dumps({"localhost": list(range(num_gpus))}).encode()).decode()
    launcher = [sys.executable, "-u", "-m", "deepspeed.launcher.launch", f"--world_info={world}"]
    return [*launcher, "--master_addr=127.0.0.1", f"--master_port={port}", str(script), *args]


def planned_args(prepared: Prepared, hostfile: str | None) -> list[str]:
    """Under `deepspeed_config: auto`, the layout chosen before the launch handed to every rank on its command line
    (pipeline.train.setup.prepare.Planned): the ranks train what was priced, searched once. Not from a machine
    without a GPU that launches onto hosts (a login node): it planned for its own CPU, not for their cards, so each
    rank plans for its own."""
    from pipeline.train.runtime.dist import accelerator_name

    if prepared.planned is None or (hostfile and accelerator_name() != "cuda"):
        return []
    return ["--planned", prepared.planned.encode()]
