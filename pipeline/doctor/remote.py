"""Reaching the hosts of a hostfile as DeepSpeed's launcher does: ssh without a password prompt, with the
launcher's environment exports and .deepspeed_env, in this folder, with this Python; each call with a timeout, many
hosts at once. Or, inside a Slurm allocation, the allocation's nodes through `srun` (`slurm_step`). Used by
`pipeline doctor` and by the launcher's check for lost hosts before a relaunch."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from pipeline.train.runtime.env import read_env_files

EXPORT_PREFIXES = ("PYTHON", "MV2", "UCX", "MLFLOW", "NCCL", "GLOO", "DS_ACCELERATOR", "TORCH_EXTENSIONS_DIR")
"""Variables forwarded to every host: DeepSpeed's own list (runner.EXPORT_ENVS and the accelerator's) plus those
this pipeline's runs read."""


def exports() -> str:
    found = {k: v for k, v in os.environ.items() if k.startswith(EXPORT_PREFIXES)}
    found.update(read_env_files())
    return "".join(f"export {k}={shlex.quote(v)}; " for k, v in found.items())


def ssh(host: str, command: str, timeout: float, ssh_port: int | None = None) -> subprocess.CompletedProcess:
    """`command` on `host` over ssh as DeepSpeed's launcher runs it (no password prompt), with a timeout."""
    cmd = ["ssh", "-o", "PasswordAuthentication=no", "-o", "BatchMode=yes", "-o", f"ConnectTimeout={int(timeout)}"]
    cmd += ["-p", str(ssh_port)] if ssh_port else []
    try:
        return subprocess.run([*cmd, host, command], capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return subprocess.CompletedProcess(cmd, 124, "", f"no answer within {timeout:g} s")


Reach = Callable[[str, str, float], subprocess.CompletedProcess]
"""How a command runs on a host: `ssh` or `slurm_step` (host, shell command, timeout)."""


def slurm_step(host: str, command: str, timeout: float) -> subprocess.CompletedProcess:
    """`command` on `host`, a node of this Slurm allocation, as a job step beside the others (`srun --overlap`),
    with this environment; no ssh between the nodes needed."""
    cmd = ["srun", "--nodes=1", "--ntasks=1", f"--nodelist={host}", "--overlap", "--quiet", "--export=ALL"]
    cmd += [f"--jobid={os.environ['SLURM_JOB_ID']}"] if "SLURM_JOB_ID" in os.environ else []
    try:
        return subprocess.run([*cmd, "bash", "-c", command], capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return subprocess.CompletedProcess(cmd, 124, "", f"no answer within {timeout:g} s")
    except FileNotFoundError:
        return subprocess.CompletedProcess(cmd, 127, "", "srun is not on PATH: run this inside a Slurm allocation")


def ask_every(
    hosts: list[str], command: str, timeout: float, reach: Reach = ssh
) -> dict[str, subprocess.CompletedProcess]:
    """`command` on every host at once (over ssh, or `reach`), each answer by host."""
    with ThreadPoolExecutor(min(32, len(hosts))) as pool:
        return dict(zip(hosts, pool.map(lambda h: reach(h, command, timeout), hosts), strict=True))


def last_line(res: subprocess.CompletedProcess) -> str:
    """What a failed remote command said last (its exit code when it said nothing)."""
    return (res.stderr.strip().splitlines() or [f"exit code {res.returncode}"])[-1]


def remote_python(module: str, args: list[str]) -> str:
    return f"{exports()}cd {shlex.quote(os.getcwd())}; {shlex.quote(sys.executable)} -m {module} " + " ".join(
        shlex.quote(a) for a in args
    )


def parse_tagged(tag: str, out: str) -> Any:
    for line in out.splitlines():
        if line.startswith(tag + " "):
            return json.loads(line[len(tag) + 1 :])
    return None
