"""What every launch carries to its ranks, through the real launcher: `.deepspeed_env` on a one-node launch
(DeepSpeed reads it only over pdsh), and how a CPU-Adam run's ranks share the node's cores."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.multiproc import launch

pytestmark = pytest.mark.slow


def test_deepspeed_env_reaches_every_rank_of_a_one_node_launch(shards: Path, tmp_path: Path) -> None:
    (tmp_path / ".deepspeed_env").write_text("NCCL_SOCKET_NTHREADS=4\nNCCL_NSOCKS_PERTHREAD=2\n")
    run_dir = tmp_path / "run"
    cfg = launch.write_config(
        tmp_path / "c.yaml", run_dir=run_dir, shards=shards, ds_config="zero1.json", steps=2, ckpt_interval=2
    )
    cmd = [
        str(Path(sys.executable).parent / "pipeline"),
        "pretrain",
        "--config",
        str(cfg),
        "--num-gpus",
        "2",
        "--master-port",
        str(launch.free_port()),
    ]
    out = subprocess.run(cmd, env=launch.env(), capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    ranks = json.loads((run_dir / "environment.json").read_text())["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1]
    for r in ranks:
        assert r["env"]["NCCL_SOCKET_NTHREADS"] == "4" and r["env"]["NCCL_NSOCKS_PERTHREAD"] == "2", r


def test_cpu_adam_ranks_are_bound_to_their_share_of_the_cores(shards: Path, tmp_path: Path) -> None:
    """Optimizer offload: `pipeline pretrain` adds DeepSpeed's --bind_cores_to_rank when numactl is there, and
    each of the node's 2 ranks then runs CPU Adam on 1 of its 2 cores (not 2 threads each on both)."""
    import shutil

    if shutil.which("numactl") is None:
        pytest.skip("numactl is not installed (apt-get install numactl; .ci/run does this)")
    run_dir = tmp_path / "run"
    cfg = launch.write_config(
        tmp_path / "c.yaml", run_dir=run_dir, shards=shards, ds_config="zero3_offload.json", steps=2, ckpt_interval=2
    )
    env = {k: v for k, v in launch.env().items() if k != "OMP_NUM_THREADS"}
    cmd = [
        str(Path(sys.executable).parent / "pipeline"),
        "pretrain",
        "--config",
        str(cfg),
        "--num-gpus",
        "2",
        "--master-port",
        str(launch.free_port()),
    ]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=launch.ROOT)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "--bind_cores_to_rank" in out.stderr.split("+ ", 1)[1].splitlines()[0]
    import psutil

    share = max(1, (psutil.cpu_count(logical=False) or 1) // 2)
    for r in json.loads((run_dir / "environment.json").read_text())["ranks"]:
        assert r["torch_threads"] == share and r["env"]["OMP_NUM_THREADS"] == str(share), r
