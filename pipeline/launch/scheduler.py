"""A launch that a scheduler started: every node runs the same `pipeline pretrain --from-env` and reads the world
from its environment (`NodeWorld`): Slurm's `SLURM_*` under `srun`, or `NNODES`/`NODE_RANK`/`MASTER_ADDR` as
torchrun, a Kubernetes JobSet or SkyPilot give them. No ssh, no pdsh: each node starts DeepSpeed's node launcher
for its own ranks. The first node makes the launch's checks and says in the run folder that they passed
(`Handshake`); the other nodes wait for that word, which also proves the run folder is one folder shared by all.
`job_script` writes the Slurm batch script that runs it."""

from __future__ import annotations

import itertools
import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from pipeline.atomic import write_json
from pipeline.errors import PipelineError
from pipeline.plan.hostfile import expand_hostlist

DEFAULT_PORT = 29500
SHARED_WAIT_S = float(os.environ.get("PIPELINE_SHARED_WAIT_S", "600"))
"""How long a node other than the first waits for the first node's word in the run folder (its checks take seconds;
a first node whose checks failed says so there at once)."""
HANDSHAKE = ".launch.json"


@dataclass(frozen=True, kw_only=True, slots=True)
class Scheduled:
    """`pipeline pretrain`'s scheduler options: --from-env (this process is one node's task) or --sbatch FILE (write
    the job script), and what goes with them."""

    from_env: bool = False
    sbatch: str | None = None
    nodes: int | None = None
    time_limit: str | None = None
    partition: str | None = None
    requeue: bool = False

    def problem(self, hostfile: str | None, max_restarts: int, min_nodes: int | None) -> str | None:
        """The first option that does not go with the others, as one line naming the fix."""
        script_only = [f for f, v in (("--time", self.time_limit), ("--partition", self.partition)) if v]
        script_only += ["--requeue"] if self.requeue else []
        if self.from_env and self.sbatch:
            return "--from-env is what the job script's nodes run; --sbatch writes that script: give one of them"
        if (self.from_env or self.sbatch) and hostfile:
            return (
                "--hostfile launches over ssh from here; a scheduler's nodes (--from-env, --sbatch) need none: drop it"
            )
        if (self.from_env or self.sbatch) and max_restarts:
            return (
                "under a scheduler the relaunch is the scheduler's: drop --max-restarts and use the job script's "
                "--requeue (`pipeline pretrain --sbatch FILE --requeue --min-nodes N`: Slurm requeues it when a "
                "node fails, and it requeues itself at the time limit)"
            )
        if self.from_env and min_nodes is not None and self.nodes is None:
            return "--min-nodes with --from-env needs --nodes N: the nodes the run was planned for"
        if self.sbatch and self.nodes is None:
            return "--sbatch needs --nodes N: how many nodes the job asks for"
        if min_nodes is not None and self.nodes is not None and min_nodes > self.nodes:
            return f"--min-nodes {min_nodes} is more than --nodes {self.nodes}"
        if not self.sbatch and script_only:
            return f"{', '.join(script_only)} only go(es) with --sbatch FILE (the job script they shape)"
        if not (self.from_env or self.sbatch) and self.nodes is not None:
            return "--nodes goes with --sbatch or --from-env; a hostfile says its nodes itself"
        return None


@dataclass(frozen=True, kw_only=True, slots=True)
class NodeWorld:
    """The nodes of a scheduler-started launch and this node's place among them."""

    hosts: tuple[str, ...]
    node_rank: int
    master_addr: str
    master_port: int
    per_node: int
    source: str
    """Which variables said it, for messages: 'Slurm job 42' or 'NNODES/NODE_RANK/MASTER_ADDR'."""
    launch_id: str
    """The same on every node of one launch and different for the next (a requeued job, a new attempt)."""

    @property
    def nnodes(self) -> int:
        return len(self.hosts)

    @property
    def world_size(self) -> int:
        return self.nnodes * self.per_node

    def describe(self) -> str:
        return (
            f"node {self.node_rank} of {self.nnodes} ({', '.join(self.hosts)}), {self.per_node} rank(s) per node, "
            f"rendezvous {self.master_addr}:{self.master_port} ({self.source})"
        )


def _int(env: Mapping[str, str], name: str, fix: str) -> int:
    value = env.get(name, "")
    try:
        return int(value)
    except ValueError:
        raise PipelineError(f"{name}={value!r} is not a whole number: {fix}") from None


def from_environment(
    env: Mapping[str, str], per_node: int | None, gpus: int, resolve: Callable[[str], str] | None = None
) -> NodeWorld:
    """The world of this launch from the scheduler's variables (Slurm's under `srun`, else torchrun's, a JobSet's
    or SkyPilot's). `per_node`: --num-gpus when given; `gpus`: the GPUs this process sees (0 on a CPU). Every
    inconsistency is one line naming the variable and the fix."""
    if "SLURM_JOB_ID" in env and "NODE_RANK" not in env:  # NODE_RANK set by hand inside a job wins
        return _slurm(env, per_node, gpus, resolve or slurm_node_address)
    if "SKYPILOT_NODE_RANK" in env:
        ips = env.get("SKYPILOT_NODE_IPS", "").split()
        if not ips:
            raise PipelineError("SKYPILOT_NODE_RANK is set without SKYPILOT_NODE_IPS: start it from a SkyPilot task")
        rank = _int(env, "SKYPILOT_NODE_RANK", "SkyPilot sets it")
        hosts = tuple(ips)
        addr = ips[0]
        port = _int(env, "MASTER_PORT", "give the rendezvous port") if "MASTER_PORT" in env else DEFAULT_PORT
        source = "SKYPILOT_NODE_RANK/SKYPILOT_NODE_IPS"
        per = per_node or (_int(env, "SKYPILOT_NUM_GPUS_PER_NODE", "") if "SKYPILOT_NUM_GPUS_PER_NODE" in env else 0)
    else:
        missing = [v for v in ("MASTER_ADDR", "NNODES") if v not in env]
        if "NODE_RANK" not in env and "JOB_COMPLETION_INDEX" not in env:
            missing.append("NODE_RANK")
        if missing:
            raise PipelineError(
                f"--from-env: {', '.join(missing)} not set. Under Slurm run `srun --ntasks-per-node=1 pipeline "
                "pretrain --from-env ...` (see `pipeline pretrain --sbatch`); elsewhere set NNODES, NODE_RANK (or a "
                "Job's JOB_COMPLETION_INDEX), MASTER_ADDR and MASTER_PORT on every node, as torchrun's multi-node "
                "launch does"
            )
        fix = "set it to the number of nodes"
        nnodes = _int(env, "NNODES", fix)
        rank_var = "NODE_RANK" if "NODE_RANK" in env else "JOB_COMPLETION_INDEX"
        rank = _int(env, rank_var, "each node's index, 0 on the first")
        if nnodes < 1:
            raise PipelineError(f"NNODES={nnodes}: {fix}")
        hosts = tuple(f"node{i}" for i in range(nnodes))
        addr = env["MASTER_ADDR"]
        port = _int(env, "MASTER_PORT", "give the rendezvous port") if "MASTER_PORT" in env else DEFAULT_PORT
        source = f"NNODES/{rank_var}/MASTER_ADDR"
        per = per_node or (_int(env, "NPROC_PER_NODE", "ranks per node") if "NPROC_PER_NODE" in env else 0)
    if not 0 <= rank < len(hosts):
        raise PipelineError(f"node rank {rank} is not one of the {len(hosts)} nodes ({source}): count from 0")
    ident = env.get("PIPELINE_LAUNCH_ID") or f"{addr}:{port}/{len(hosts)}"
    return NodeWorld(
        hosts=hosts,
        node_rank=rank,
        master_addr=addr,
        master_port=port,
        per_node=per or gpus or 1,
        source=source,
        launch_id=ident,
    )


def _slurm(env: Mapping[str, str], per_node: int | None, gpus: int, resolve: Callable[[str], str]) -> NodeWorld:
    job = env.get("SLURM_JOB_ID", "?")
    if "SLURM_STEP_ID" not in env:
        raise PipelineError(
            f"--from-env in Slurm job {job} outside `srun`: only this node would start. Run it as a job step, one "
            "task per node: `srun --ntasks-per-node=1 pipeline pretrain --from-env ...` (`pipeline pretrain "
            "--sbatch FILE` writes the script)"
        )
    nodes = expand_hostlist(env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST", ""))
    tasks = env.get("SLURM_STEP_NUM_TASKS") or env.get("SLURM_NTASKS") or str(len(nodes))
    if tasks != str(len(nodes)):
        raise PipelineError(
            f"Slurm job {job}'s step has {tasks} tasks on {len(nodes)} node(s): run one task per node "
            "(`srun --ntasks-per-node=1`); each node's launcher starts the ranks of its GPUs"
        )
    rank = _int(env, "SLURM_NODEID", "Slurm sets it under srun")
    on_node = env.get("SLURM_GPUS_ON_NODE")
    slurm_gpus = int(on_node) if on_node and on_node.isdigit() else None
    if per_node and slurm_gpus and per_node != slurm_gpus:
        raise PipelineError(
            f"--num-gpus {per_node}, but Slurm gave node {nodes[rank]} {slurm_gpus} GPU(s) (SLURM_GPUS_ON_NODE): "
            f"ask for --gpus-per-node={per_node} in the job, or give --num-gpus {slurm_gpus}"
        )
    port = _int(env, "MASTER_PORT", "give the rendezvous port") if "MASTER_PORT" in env else None
    if port is None:  # jobs sharing a node do not collide on one port
        port = 20000 + int(job) % 20000 if job.isdigit() else DEFAULT_PORT
    addr = env.get("MASTER_ADDR") or resolve(nodes[0])
    restarts = env.get("SLURM_RESTART_COUNT", "0")
    return NodeWorld(
        hosts=tuple(nodes),
        node_rank=rank,
        master_addr=addr,
        master_port=port,
        per_node=per_node or slurm_gpus or gpus or 1,
        source=f"Slurm job {job}" + (f", requeued {restarts}x" if restarts != "0" else ""),
        launch_id=f"slurm-{job}-{restarts}-{env.get('SLURM_STEP_ID', '')}",
    )


def slurm_node_address(node: str) -> str:
    """The address Slurm reaches `node` at (its NodeAddr: usually the name itself), which every node resolves
    alike; the name where scontrol cannot say."""
    if shutil.which("scontrol"):
        out = subprocess.run(["scontrol", "show", "node", node], capture_output=True, text=True, timeout=30)
        if found := re.search(r"\bNodeAddr=(\S+)", out.stdout):
            return found.group(1)
    return node


def node_command(world: NodeWorld, script: Path, args: list[str], python: str, bind: list[str]) -> list[str]:
    """DeepSpeed's launcher for this node's ranks (what `deepspeed --no_ssh --node_rank R` runs on each node):
    the global ranks follow the node order, so node R's first rank is R x per_node."""
    import base64

    if len(set(world.hosts)) < len(world.hosts):
        raise PipelineError(f"the node list {', '.join(world.hosts)} names a node twice ({world.source})")
    info = {h: list(range(world.per_node)) for h in world.hosts}
    encoded = base64.urlsafe_b64encode(json.dumps(info).encode()).decode()
    return [
        python,
        "-u",
        "-m",
        "deepspeed.launcher.launch",
        f"--world_info={encoded}",
        f"--node_rank={world.node_rank}",
        f"--master_addr={world.master_addr}",
        f"--master_port={world.master_port}",
        *bind,
        str(script),
        *args,
    ]


class Handshake:
    """The first node's word to the others, in RUN_DIR/.launch.json: its checks passed (or why not) for this
    launch. A node that never sees it within SHARED_WAIT_S is on a run folder that is not shared."""

    def __init__(self, run_dir: Path, world: NodeWorld):
        self.path, self.world = run_dir / HANDSHAKE, world

    def say(self, ready: bool, why: str = "") -> None:
        if not self.path.parent.is_dir():
            if not ready:
                return
            self.path.parent.mkdir(parents=True, exist_ok=True)
        write_json(
            self.path, {"launch": self.world.launch_id, "ready": ready, "why": why, "host": socket.gethostname()}
        )

    def wait(self, say: Callable[[str], None], timeout: float = SHARED_WAIT_S) -> None:
        start, told = time.monotonic(), False
        while True:
            record = self._read()
            if record is not None and record.get("launch") == self.world.launch_id:
                if not record.get("ready"):
                    raise PipelineError(f"node 0 ({record.get('host')}) refused the launch: {record.get('why')}")
                return
            waited = time.monotonic() - start
            if waited >= timeout:
                raise PipelineError(
                    f"no word from node 0 ({self.world.hosts[0]}) in {self.path} after {waited:.0f} s: the run folder "
                    "must be one folder shared by every node (NFS is enough; a node's own disk is not), or node 0 "
                    "did not start (see its output)"
                )
            if not told and waited > 10:
                told = True
                say(f"waiting for node 0 ({self.world.hosts[0]}) to say in {self.path} that its checks passed")
            time.sleep(0.5)

    def _read(self) -> dict | None:
        try:
            record = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return None
        return record if isinstance(record, dict) else None


def job_script(
    *,
    config: str,
    sets: list[str],
    nodes: int,
    min_nodes: int | None,
    gpus_per_node: int,
    time_limit: str | None,
    partition: str | None,
    requeue: bool,
    grace_s: int,
    workdir: Path,
    python_bin: Path,
    output: Path,
) -> str:
    """A Slurm batch script for this config: one task per node, each running `pipeline pretrain --from-env`, the
    whole node's CPUs to it (CPU Adam and the data loaders), the GPUs asked per node. `grace_s` before the time
    limit Slurm signals the batch shell, which stops the run (every rank saves at the end of its step) and, with
    `requeue`, puts the job back in the queue: it resumes from that checkpoint. With `min_nodes` the job may start
    on, or be requeued onto, fewer nodes (down to that many): the run resumes on them through the universal
    checkpoint (the same global batch)."""
    q = shlex.quote
    span = f"{min_nodes}-{nodes}" if min_nodes and min_nodes < nodes else str(nodes)
    lines = [
        "#!/bin/bash",
        f"# Written by `pipeline pretrain --sbatch` for {config}. Submit: sbatch THIS_FILE",
        "#SBATCH --job-name=pretrain",
        f"#SBATCH --nodes={span}",
        # The whole node (its CPUs for CPU Adam and the loaders). No --ntasks-per-node here: with it Slurm gives a
        # node range its smallest count; srun below starts one task per node.
        "#SBATCH --exclusive",
        f"#SBATCH --output={output}",
        "#SBATCH --open-mode=append",  # a requeued job adds to its log
        f"#SBATCH --signal=B:USR1@{grace_s}",
    ]
    if gpus_per_node:
        lines.append(f"#SBATCH --gpus-per-node={gpus_per_node}")
    if time_limit:
        lines.append(f"#SBATCH --time={time_limit}")
    if partition:
        lines.append(f"#SBATCH --partition={partition}")
    lines.append("#SBATCH --requeue" if requeue else "#SBATCH --no-requeue")
    args = ["pretrain", "--from-env", "--config", config, *itertools.chain(*(("--set", s) for s in sets))]
    args += ["--nodes", str(nodes)] + (["--min-nodes", str(min_nodes)] if min_nodes and min_nodes < nodes else [])
    if gpus_per_node:
        args += ["--num-gpus", str(gpus_per_node)]
    run = " ".join(q(a) for a in [str(python_bin / "pipeline"), *args])
    lines += [
        "set -u",
        f"cd {q(str(workdir))}",
        "stop_requested=0",
        "# Before the time limit: every rank saves at the end of its step and stops (the steps get SIGTERM).",
        "trap 'stop_requested=1; scancel --signal=TERM \"$SLURM_JOB_ID\"' USR1",
        f"srun --ntasks-per-node=1 --kill-on-bad-exit=0 {run} &",
        "step=$!",
        'wait "$step"; code=$?',
        'while kill -0 "$step" 2>/dev/null; do wait "$step"; code=$?; done',
    ]
    if requeue:
        lines += [
            'if [ "$stop_requested" = 1 ]; then',
            '  echo "time limit near: the run saved and stopped; requeueing job $SLURM_JOB_ID to continue"',
            '  scontrol requeue "$SLURM_JOB_ID"',
            "fi",
        ]
    lines.append('exit "$code"')
    return "\n".join(lines) + "\n"
