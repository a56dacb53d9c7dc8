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

from pipeline.train.checkpoint import files as ckpt
from tests.multiproc import launch, netns

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def two_hosts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    if shutil.which("pdsh") is None:
        pytest.skip("pdsh is not installed (apt-get install pdsh; .ci/run does this)")
    with netns.hosts(tmp_path_factory.mktemp("multinode")) as h:
        yield h


def _command(hosts: dict, config: Path, port: int, *sets: str) -> list[str]:
    cmd = [
        "ip",
        "netns",
        "exec",
        hosts["ns"][0],
        "timeout",
        "600",
        str(Path(sys.executable).parent / "deepspeed"),
        "--hostfile",
        str(hosts["hostfile"]),
        "--master_port",
        str(port),
        str(ROOT / "pipeline/pretrain.py"),
        "--config",
        str(config),
    ]
    for s in sets:
        cmd += ["--set", s]
    return cmd


def test_two_hosts_train_checkpoint_and_resume(two_hosts: dict, shards: Path) -> None:
    run_dir = two_hosts["work"] / "run"
    cfg = launch.write_config(
        two_hosts["work"] / "c.yaml", run_dir=run_dir, shards=shards, ds_config="zero3.json", steps=4, ckpt_interval=2
    )
    first = subprocess.run(
        _command(two_hosts, cfg, launch.free_port()),
        env=two_hosts["env"],
        capture_output=True,
        text=True,
        timeout=700,
        cwd=ROOT,
    )
    out = first.stdout + first.stderr
    assert first.returncode == 0, out[-5000:]
    assert "Running on the following workers: node0,node1" in out
    assert ckpt.complete_tags(run_dir) == ["step00000002", "step00000004"]
    assert ckpt.read_marker(run_dir, "step00000004")["world_size"] == 2
    second = subprocess.run(
        _command(two_hosts, cfg, launch.free_port(), "train.max_steps=6"),
        env=two_hosts["env"],
        capture_output=True,
        text=True,
        timeout=700,
        cwd=ROOT,
    )
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
    cfg = launch.write_config(
        two_hosts["work"] / "f.yaml",
        run_dir=run_dir,
        shards=shards,
        ds_config="zero2.json",
        steps=100000,
        ckpt_interval=100000,
    )
    proc = subprocess.Popen(
        _command(two_hosts, cfg, launch.free_port(), "train.comm_timeout_minutes=1"),
        env=two_hosts["env"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    launch.wait_for_step(run_dir, 2, proc)
    # kill the training process on the second host, as an OOM killer would
    victims = []
    for pid in subprocess.run(
        ["ip", "netns", "pids", two_hosts["ns"][1]], capture_output=True, text=True
    ).stdout.split():
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
