"""Hosts for multi-node tests: network namespaces on this machine joined by one veth pair, reached through an ssh
stand-in that enters the namespace (no sshd needed). Needs root; `hosts()` skips the test with the reason where
namespaces cannot be made."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.multiproc import launch

SSH_SHIM = """#!/usr/bin/env bash
# ssh stand-in: HOST maps to a network namespace; options (as pdsh and DeepSpeed pass them) are skipped. A host
# line may add environment (VAR=value ...) that only that host has, or 'hang' for a host that never answers.
while [ $# -gt 0 ]; do
  case "$1" in
    -l|-p|-o|-i|-F|-E) shift 2 ;;
    -*) shift ;;
    *) break ;;
  esac
done
host="$1"; shift
line=$(grep "^$host " "$(dirname "$0")/hosts")
[ -n "$line" ] || { echo "ssh: Could not resolve hostname $host: Name or service not known" >&2; exit 255; }
set -- "$*" $line
cmd="$1"; ns="$3"; shift 3
[ "$ns" = hang ] && exec sleep 3600
exec env "$@" ip netns exec "$ns" bash -c "$cmd"
"""


def _sh(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True)


@contextmanager
def hosts(work: Path, extra: dict[str, str] | None = None) -> Iterator[dict]:
    """Two hosts, node0 and node1 (namespaces joined by a veth pair with the same name on both sides). `extra`:
    more host lines for the ssh stand-in, e.g. {"node2": "hang"}, {"node1": "... PYTHONPATH=/x"} replaces node1's."""
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root")
    tag = os.getpid() % 10000 + len(list(work.parent.iterdir()))
    ns = [f"dsn{tag}a", f"dsn{tag}b"]
    iface = f"dse{tag}"
    subnet = f"10.250.{tag % 250}"
    try:
        for n in ns:
            _sh("ip", "netns", "add", n)
        _sh("ip", "link", "add", iface, "netns", ns[0], "type", "veth", "peer", "name", iface, "netns", ns[1])
        for i, n in enumerate(ns):
            _sh("ip", "-n", n, "addr", "add", f"{subnet}.{i + 1}/24", "dev", iface)
            _sh("ip", "-n", n, "link", "set", "lo", "up")
            _sh("ip", "-n", n, "link", "set", iface, "up")
    except (subprocess.CalledProcessError, FileNotFoundError) as e:
        for n in ns:
            subprocess.run(["ip", "netns", "del", n], capture_output=True)
        pytest.skip(f"cannot create network namespaces here: {e}")
    bin_dir = work / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "ssh").write_text(SSH_SHIM)
    (bin_dir / "ssh").chmod(0o755)
    lines = {"node0": f"node0 {ns[0]}", "node1": f"node1 {ns[1]}"}
    lines.update({h: f"{h} {v}" for h, v in (extra or {}).items()})
    (bin_dir / "hosts").write_text("".join(f"{line}\n" for line in lines.values()))
    (work / "hostfile").write_text("node0 slots=1\nnode1 slots=1\n")
    env_file = work / "deepspeed_env"
    venv_bin = str(Path(sys.executable).parent)
    e = launch.env()
    # pdsh forwards few variables: what every rank needs goes through DeepSpeed's env file.
    env_file.write_text(
        f"DS_ACCELERATOR=cpu\nGLOO_SOCKET_IFNAME={iface}\nOMP_NUM_THREADS=1\n"
        f"TORCH_EXTENSIONS_DIR={e['TORCH_EXTENSIONS_DIR']}\nPATH={venv_bin}:/usr/sbin:/usr/bin:/bin\n"
    )
    env = {**e, "PATH": f"{bin_dir}:{venv_bin}:{e['PATH']}", "DS_ENV_FILE": str(env_file)}
    try:
        yield {
            "ns": ns,
            "iface": iface,
            "subnet": subnet,
            "work": work,
            "env": env,
            "hostfile": work / "hostfile",
            "env_file": env_file,
        }
    finally:
        for n in ns:
            pids = subprocess.run(["ip", "netns", "pids", n], capture_output=True, text=True).stdout.split()
            for pid in pids:
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
            subprocess.run(["ip", "netns", "del", n], capture_output=True)
