"""The user's exact multi-node command, `deepspeed --hostfile HOSTFILE pipeline/pretrain.py ...`, across two hosts
that are network namespaces on this machine, reached through real pdsh and an ssh stand-in that enters the
namespace (no sshd needed). Trains, checkpoints, resumes; a rank that dies makes the whole launch fail."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from pipeline.train import checkpoint as ckpt
from tests.multiproc import launch

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]

SSH_SHIM = """#!/usr/bin/env bash
# ssh stand-in: HOST maps to a network namespace; options (as pdsh and DeepSpeed pass them) are skipped.
while [ $# -gt 0 ]; do
  case "$1" in
    -l|-p|-o|-i|-F|-E) shift 2 ;;
    -*) shift ;;
    *) break ;;
  esac
done
host="$1"; shift
ns=$(grep "^$host " "$(dirname "$0")/hosts" | cut -d' ' -f2)
[ -n "$ns" ] || { echo "ssh: unknown host $host" >&2; exit 255; }
exec ip netns exec "$ns" bash -c "$*"
"""


def _sh(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True)


@pytest.fixture(scope="module")
def two_hosts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root")
    if shutil.which("pdsh") is None:
        pytest.skip("pdsh is not installed (apt-get install pdsh; .ci/run does this)")
    tag = os.getpid() % 10000
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
    work = tmp_path_factory.mktemp("multinode")
    bin_dir = work / "bin"
    bin_dir.mkdir()
    (bin_dir / "ssh").write_text(SSH_SHIM)
    (bin_dir / "ssh").chmod(0o755)
    (bin_dir / "hosts").write_text(f"node0 {ns[0]}\nnode1 {ns[1]}\n")
    (work / "hostfile").write_text("node0 slots=1\nnode1 slots=1\n")
    env_file = work / "deepspeed_env"
    venv_bin = str(Path(sys.executable).parent)
    e = launch.env()
    # pdsh forwards few variables: what every rank needs goes through DeepSpeed's env file.
    env_file.write_text(f"DS_ACCELERATOR=cpu\nGLOO_SOCKET_IFNAME={iface}\nOMP_NUM_THREADS=1\n"
                        f"TORCH_EXTENSIONS_DIR={e['TORCH_EXTENSIONS_DIR']}\nPATH={venv_bin}:/usr/sbin:/usr/bin:/bin\n")
    env = {**e, "PATH": f"{bin_dir}:{venv_bin}:{e['PATH']}", "DS_ENV_FILE": str(env_file)}
    yield {"ns": ns, "work": work, "env": env, "hostfile": work / "hostfile"}
    for n in ns:
        pids = subprocess.run(["ip", "netns", "pids", n], capture_output=True, text=True).stdout.split()
        for pid in pids:
            try:
                os.kill(int(pid), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass
        subprocess.run(["ip", "netns", "del", n], capture_output=True)


def _command(hosts: dict, config: Path, port: int, *sets: str) -> list[str]:
    cmd = ["ip", "netns", "exec", hosts["ns"][0], "timeout", "600", str(Path(sys.executable).parent / "deepspeed"),
           "--hostfile", str(hosts["hostfile"]), "--master_port", str(port), str(ROOT / "pipeline/pretrain.py"),
           "--config", str(config)]
    for s in sets:
        cmd += ["--set", s]
    return cmd


def test_two_hosts_train_checkpoint_and_resume(two_hosts: dict, shards: Path) -> None:
    run_dir = two_hosts["work"] / "run"
    cfg = launch.write_config(two_hosts["work"] / "c.yaml", run_dir=run_dir, shards=shards, ds_config="zero3.json",
                              steps=4, ckpt_interval=2)
    first = subprocess.run(_command(two_hosts, cfg, launch.free_port()), env=two_hosts["env"], capture_output=True,
                           text=True, timeout=700, cwd=ROOT)
    out = first.stdout + first.stderr
    assert first.returncode == 0, out[-5000:]
    assert "Running on the following workers: node0,node1" in out
    assert ckpt.complete_tags(run_dir) == ["step00000002", "step00000004"]
    assert ckpt.read_marker(run_dir, "step00000004")["world_size"] == 2
    second = subprocess.run(_command(two_hosts, cfg, launch.free_port(), "train.max_steps=6"), env=two_hosts["env"],
                            capture_output=True, text=True, timeout=700, cwd=ROOT)
    out = second.stdout + second.stderr
    assert second.returncode == 0, out[-5000:]
    assert "resumed from" in out and ckpt.latest_complete(run_dir) == "step00000006"
    losses = launch.losses(run_dir)
    assert sorted(losses) == [1, 2, 3, 4, 5, 6] and losses[6] < losses[1]
    # A node is lost: the same run continues on the first host alone (world size 2 -> 1, a universal checkpoint).
    one = two_hosts["work"] / "one_host"
    one.write_text("node0 slots=1\n")
    cmd = _command({**two_hosts, "hostfile": one}, cfg, launch.free_port(), "train.max_steps=8")
    third = subprocess.run(cmd, env=two_hosts["env"], capture_output=True, text=True, timeout=700, cwd=ROOT)
    out = third.stdout + third.stderr
    assert third.returncode == 0, out[-5000:]
    assert "saved by 2 ranks, now 1: through the universal checkpoint step00000006.universal" in out
    assert ckpt.read_marker(run_dir, "step00000008")["world_size"] == 1
    assert sorted(launch.losses(run_dir)) == list(range(1, 9))


def test_a_failing_rank_fails_the_whole_launch(two_hosts: dict, shards: Path) -> None:
    run_dir = two_hosts["work"] / "failing"
    cfg = launch.write_config(two_hosts["work"] / "f.yaml", run_dir=run_dir, shards=shards, ds_config="zero2.json",
                              steps=100000, ckpt_interval=100000)
    proc = subprocess.Popen(_command(two_hosts, cfg, launch.free_port(), "train.comm_timeout_minutes=1"),
                            env=two_hosts["env"], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    launch.wait_for_step(run_dir, 2, proc)
    # kill the training process on the second host, as an OOM killer would
    victims = []
    for pid in subprocess.run(["ip", "netns", "pids", two_hosts["ns"][1]], capture_output=True, text=True).stdout.split():
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        if "pretrain.py" in cmdline and "deepspeed.launcher" not in cmdline:
            victims.append(int(pid))
    assert victims, "no rank found on the second host"
    os.kill(min(victims), signal.SIGKILL)
    t0 = time.time()
    out, _ = proc.communicate(timeout=400)
    assert proc.returncode != 0, out[-3000:]
    assert time.time() - t0 < 300, "the survivors must give up within the collective timeout, not hang"
