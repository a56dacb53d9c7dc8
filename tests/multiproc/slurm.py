"""A real Slurm cluster on this machine for the scheduler tests: munged, slurmctld and one slurmd per node (Slurm's
own `slurmd -N NAME` for several nodes on one host), every file and port in the test's folder, torn down after.
Needs root and Debian's slurm-wlm and munge (.ci/run installs them); `cluster()` skips the test with the reason
where they are missing or will not start."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.multiproc import launch

DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "scancel", "srun", "sinfo")


def _sbin(name: str) -> str | None:
    return shutil.which(name) or shutil.which(name, path="/usr/sbin:/sbin")


@contextlib.contextmanager
def cluster(work: Path, nodes: int = 2, cpus: int = 2) -> Iterator[dict]:
    """`nodes` Slurm nodes (node1, node2, ...) on this host, each with `cpus` CPUs, in one partition. Yields the
    environment the Slurm commands need (SLURM_CONF) and helpers' inputs."""
    missing = [d for d in DAEMONS if _sbin(d) is None]
    if missing:
        pytest.skip(
            f"Slurm is not installed ({', '.join(missing)} missing: apt-get install slurm-wlm munge; .ci/run does this)"
        )
    if os.geteuid() != 0:
        pytest.skip("the test's Slurm daemons run as root")
    for sub in ("state", "spool", "log", "munge"):
        (work / sub).mkdir(parents=True, exist_ok=True)
    key = work / "munge" / "munge.key"
    key.write_bytes(os.urandom(128))
    key.chmod(0o600)
    sock = work / "munge" / "munge.sock"
    host = socket.gethostname().split(".")[0]
    ctld_port = launch.free_port()
    node_ports = [launch.free_port() for _ in range(nodes)]
    names = [f"node{i + 1}" for i in range(nodes)]
    conf = work / "slurm.conf"
    node_lines = "".join(
        f"NodeName={n} NodeHostname={host} NodeAddr=127.0.0.1 Port={p} CPUs={cpus} RealMemory=2000 State=UNKNOWN\n"
        for n, p in zip(names, node_ports, strict=True)
    )
    conf.write_text(
        f"""ClusterName=pipetest
SlurmctldHost={host}
SlurmUser=root
SlurmctldPort={ctld_port}
AuthType=auth/munge
AuthInfo=socket={sock},cred_expire=10
StateSaveLocation={work}/state
SlurmdSpoolDir={work}/spool/%n
SlurmctldPidFile={work}/slurmctld.pid
SlurmdPidFile={work}/slurmd-%n.pid
SlurmctldLogFile={work}/log/slurmctld.log
SlurmdLogFile={work}/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
SlurmdTimeout=10
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
KillWait=10
{node_lines}PartitionName=debug Nodes={",".join(names)} Default=YES MaxTime=INFINITE State=UP
"""
    )
    env = {**launch.env(), "SLURM_CONF": str(conf)}
    procs: list[subprocess.Popen] = []
    try:
        munged = [_sbin("munged"), "--force", "--foreground", f"--socket={sock}", f"--key-file={key}"]
        munged += [f"--pid-file={work}/munge/munged.pid", f"--log-file={work}/munge/munged.log"]
        munged += [f"--seed-file={work}/munge/seed"]
        procs.append(subprocess.Popen(munged, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT))
        _wait(lambda: sock.exists(), 20, "munged did not make its socket", work)
        procs.append(_daemon([_sbin("slurmctld"), "-D", "-f", str(conf)], env))
        _wait(lambda: _ok(["scontrol", "ping"], env), 30, "slurmctld did not answer", work)
        slurmds = {n: _daemon([_sbin("slurmd"), "-D", "-f", str(conf), "-N", n], env) for n in names}
        procs += slurmds.values()
        _wait(lambda: _idle(env) >= nodes, 60, f"the {nodes} slurmd did not come up idle", work)
    except BaseException:
        _stop(procs, env)
        raise
    try:
        yield {"env": env, "conf": conf, "work": work, "nodes": names, "slurmd": slurmds, "procs": procs}
    finally:
        _stop(procs, env)


def lose_node(cluster: dict, name: str) -> list[int]:
    """Node `name` lost as a power loss loses it: its slurmd and every process of a job on it (its tasks carry
    SLURMD_NODENAME=name; their slurmstepd is their parent) SIGKILLed. Returns the pids killed."""
    import psutil

    cluster["slurmd"][name].kill()
    victims: set[int] = {cluster["slurmd"][name].pid}
    for p in psutil.process_iter():
        with contextlib.suppress(psutil.Error, OSError):
            if f"SLURMD_NODENAME={name}".encode() in Path(f"/proc/{p.pid}/environ").read_bytes().split(b"\0"):
                victims.add(p.pid)
                if "slurmstepd" in p.parent().name():
                    victims.add(p.parent().pid)
    for pid in victims:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return sorted(victims)


def restart_node(cluster: dict, name: str) -> None:
    """Start node `name`'s slurmd again (ReturnToService=2: it comes back idle when it registers)."""
    daemon = _daemon([_sbin("slurmd"), "-D", "-f", str(cluster["conf"]), "-N", name], cluster["env"])
    cluster["slurmd"][name] = daemon
    cluster["procs"].append(daemon)
    _wait(lambda: _idle(cluster["env"]) >= len(cluster["nodes"]), 90, f"{name} did not come back idle", cluster["work"])


def _daemon(cmd: list[str | None], env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen(
        [str(c) for c in cmd], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, start_new_session=True
    )


def _ok(cmd: list[str], env: dict[str, str]) -> bool:
    return subprocess.run(cmd, env=env, capture_output=True, timeout=30).returncode == 0


def _idle(env: dict[str, str]) -> int:
    out = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %t"], env=env, capture_output=True, text=True, timeout=30)
    return sum(1 for line in out.stdout.splitlines() if line.split()[-1:] == ["idle"])


def _wait(ready: object, timeout: float, why: str, work: Path) -> None:
    t0 = time.time()
    while time.time() - t0 < timeout:
        if ready():  # type: ignore[operator]
            return
        time.sleep(0.3)
    logs = "\n".join(p.read_text()[-1500:] for p in sorted((work / "log").glob("*.log")))
    pytest.skip(f"{why} within {timeout:.0f} s here: {logs[-3000:]}")


def _stop(procs: list[subprocess.Popen], env: dict[str, str]) -> None:
    with contextlib.suppress(Exception):
        subprocess.run(["scancel", "--full", "--user=root"], env=env, capture_output=True, timeout=30)
    for p in reversed(procs):
        with contextlib.suppress(ProcessLookupError):
            p.send_signal(signal.SIGTERM)
    for p in reversed(procs):
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def submit(script: Path, env: dict[str, str]) -> str:
    """`sbatch SCRIPT` with `env` exported to the job, and a rendezvous port of this test worker's own (the job's
    default, derived from its id, could be one another worker's launch holds)."""
    env = {**env, "MASTER_PORT": str(launch.free_port())}
    out = subprocess.run(["sbatch", "--parsable", str(script)], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip().split(";")[0]


def job(job_id: str, env: dict[str, str]) -> dict[str, str]:
    """`scontrol show job` as fields (JobState, Restarts, ExitCode, ...)."""
    out = subprocess.run(["scontrol", "show", "job", job_id], env=env, capture_output=True, text=True, timeout=30)
    return dict(re.findall(r"(\w+)=(\S*)", out.stdout))


def wait_job(job_id: str, env: dict[str, str], done: tuple[str, ...], timeout: float = 600) -> dict[str, str]:
    """Wait until the job's state is one of `done` (and return its fields)."""
    t0 = time.time()
    while time.time() - t0 < timeout:
        fields = job(job_id, env)
        if fields.get("JobState") in done:
            return fields
        time.sleep(0.5)
    raise AssertionError(f"job {job_id} not in {done} after {timeout:.0f} s: {job(job_id, env)}")
