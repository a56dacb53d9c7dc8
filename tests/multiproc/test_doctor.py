"""`pipeline doctor --hostfile` across hosts that are network namespaces on this machine (the multi-node test's
setup): the link between them limited with `tc` to a known rate, one host with another deepspeed version on its
Python path, and one host that never answers ssh."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.multiproc import netns

pytestmark = pytest.mark.slow
RATE_MBIT = 200


@pytest.fixture(scope="module")
def hosts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    work = tmp_path_factory.mktemp("doctor")
    fake = work / "other-venv"  # a second deepspeed install that shadows the venv's on node1 only
    (fake / "deepspeed-0.14.0.dist-info").mkdir(parents=True)
    (fake / "deepspeed-0.14.0.dist-info" / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: deepspeed\nVersion: 0.14.0\n"
    )
    with netns.hosts(work, {"node1": "", "node2": "hang"}) as h:
        ns = h["ns"]
        (h["work"] / "bin" / "hosts").write_text(f"node0 {ns[0]}\nnode1 {ns[1]} PYTHONPATH={fake}\nnode2 hang\n")
        # the doctor exports PYTHON* variables to every host as DeepSpeed does: a PYTHONPATH here would replace
        # node1's own (the launches' HIDDEN folder, tests/multiproc/launch.py)
        h["env"].pop("PYTHONPATH", None)
        for n in ns:
            try:
                subprocess.run(
                    [
                        "ip",
                        "netns",
                        "exec",
                        n,
                        "tc",
                        "qdisc",
                        "add",
                        "dev",
                        h["iface"],
                        "root",
                        "tbf",
                        "rate",
                        f"{RATE_MBIT}mbit",
                        "burst",
                        "64kb",
                        "latency",
                        "400ms",
                    ],
                    check=True,
                    capture_output=True,
                )
            except (subprocess.CalledProcessError, FileNotFoundError) as e:
                pytest.skip(f"cannot limit the link with tc here: {e}")
        yield h


def doctor(h: dict, hostfile: Path, *args: str) -> tuple[subprocess.CompletedProcess, float]:
    cmd = [
        "ip",
        "netns",
        "exec",
        h["ns"][0],
        str(Path(sys.executable).parent / "pipeline"),
        "doctor",
        "--hostfile",
        str(hostfile),
        *args,
    ]
    t0 = time.monotonic()
    out = subprocess.run(cmd, env=h["env"], capture_output=True, text=True, timeout=300, cwd=h["work"])
    return out, time.monotonic() - t0


def test_two_hosts_bandwidth_interface_and_version_mismatch(hosts: dict) -> None:
    hostfile = hosts["work"] / "two"
    hostfile.write_text(f"# cluster: network={RATE_MBIT / 1000}Gbps\nnode0 slots=2\nnode1 slots=2\n")
    out, _ = doctor(hosts, hostfile, "--json", "--timeout", "60", "--write-env")
    assert out.returncode == 1, out.stdout[-3000:] + out.stderr[-3000:]  # the version mismatch fails
    reports = {r["host"]: r for r in json.loads(out.stdout)}
    node0, node1 = reports["node0"], reports["node1"]
    assert node0["facts"]["interface"] == hosts["iface"] and node1["facts"]["interface"] == hosts["iface"]
    bus = node0["facts"]["allreduce_bus_bytes_per_s"]
    assert abs(bus * 8 / 1e6 / RATE_MBIT - 1) < 0.3, f"{bus * 8 / 1e6:.0f} Mbit/s measured on a {RATE_MBIT} Mbit link"
    allreduce = next(c["detail"] for c in node0["checks"] if c["name"] == "all-reduce")
    assert "over 2 hosts, 4 ranks" in allreduce  # one process per slot: the path inside a node is exercised too
    mismatch = [c for c in node1["checks"] if c["name"] == "same as first host"]
    assert mismatch and mismatch[0]["status"] == "FAIL"
    assert "deepspeed 0.14.0 here" in mismatch[0]["detail"] and "0.19" in mismatch[0]["detail"]
    assert all(c["status"] == "PASS" for c in node0["checks"] if c["name"] in ("ssh", "network", "all-reduce"))
    written = hosts["env_file"].read_text().splitlines()
    assert written[:3] == ["DS_ACCELERATOR=cpu", f"GLOO_SOCKET_IFNAME={hosts['iface']}", "OMP_NUM_THREADS=1"]
    assert f"NCCL_SOCKET_IFNAME={hosts['iface']}" in written and all("=" in line for line in written)


def test_an_unreachable_host_fails_within_the_timeout_and_the_others_report(hosts: dict) -> None:
    hostfile = hosts["work"] / "three"
    hostfile.write_text("node0 slots=1\nnode1 slots=1\nnode2 slots=1\nnode3 slots=1\n")
    # 30 s a step: the hosts that answer import torch and DeepSpeed for their checks, which on a machine busy
    # with a second job takes well over the 10 s it takes here idle; the host that hangs costs one timeout
    out, took = doctor(hosts, hostfile, "--timeout", "30")
    assert out.returncode == 1, out.stdout[-3000:] + out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert any(line.startswith("node2") and "FAIL" in line and "not reachable" in line for line in lines), out.stdout
    assert any(line.startswith("node3") and "FAIL" in line and "Could not resolve" in line for line in lines)
    assert any(line.startswith("node0") and "/dev/shm" in line for line in lines), out.stdout
    assert any(line.startswith("node1") and "versions" in line for line in lines), out.stdout
    assert took < 30 * 3 + 60, f"took {took:.0f} s"
