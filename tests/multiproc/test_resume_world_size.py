"""Resuming on another world size through the launcher (CPU ranks): the checkpoint is converted once to DeepSpeed's
universal form and loaded by the new ranks; the losses continue the uninterrupted run's within 1e-4 (fp32) and the
data position continues exactly (the sample order does not depend on the world size)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeline.train.checkpoint import files as ckpt
from tests.multiproc import launch
from tests.multiproc.conftest import STEPS

pytestmark = pytest.mark.slow


def cut_and_resume(cfg: Path, run_dir: Path, before: int, after: int, tmp_path: Path) -> str:
    """Train on `before` ranks until rank 0 dies after step 7 (checkpoint 5 is the latest), resume on `after`."""
    first = launch.run(cfg, num_gpus=before, extra_env={"PIPELINE_FAULT_KILL_AT_STEP": "7"})
    assert first.returncode != 0 and ckpt.latest_complete(run_dir) == "step00000005"
    out = launch.run(cfg, num_gpus=after)
    log = out.stdout + out.stderr
    assert out.returncode == 0, log[-4000:]
    assert f"saved by {before} ranks, now {after}: through the universal checkpoint step00000005.universal" in log
    return log


def assert_close(resumed: dict[int, float], reference: dict[int, float], steps: range) -> None:
    assert sorted(resumed) == list(range(1, max(steps) + 1))
    bad = [(s, resumed[s], reference[s]) for s in steps if abs(resumed[s] - reference[s]) > 1e-4 * abs(reference[s])]
    assert not bad, bad


@pytest.mark.parametrize("before, after", [(2, 1), (1, 2)])
def test_zero1_resumes_on_another_world_size(
    zero_runs: dict[int, Path], shards: Path, tmp_path: Path, before: int, after: int
) -> None:
    run_dir = tmp_path / "run"
    cfg = launch.write_config(tmp_path / "c.yaml", run_dir=run_dir, shards=shards, ds_config="zero1.json", steps=STEPS)
    cut_and_resume(cfg, run_dir, before, after, tmp_path)
    assert_close(launch.losses(run_dir), launch.losses(zero_runs[1]), range(1, STEPS + 1))
    marker = ckpt.read_marker(run_dir, f"step{STEPS:08d}")
    assert marker["world_size"] == after and marker["consumed_samples"] == STEPS * 8


def test_zero3_with_offload_resumes_from_2_ranks_on_3(shards: Path, tmp_path: Path) -> None:
    ds = json.loads((launch.ROOT / "ds_configs" / "zero3_offload.json").read_text())
    ds_file = tmp_path / "offload.json"
    ds_file.write_text(json.dumps(ds))
    kw = dict(shards=shards, ds_config=str(ds_file), steps=10, micro=1, global_batch=6)
    ref = tmp_path / "ref"
    out = launch.run(launch.write_config(tmp_path / "r.yaml", run_dir=ref, **kw))
    assert out.returncode == 0, out.stderr[-3000:]
    run_dir = tmp_path / "run"
    cfg = launch.write_config(tmp_path / "c.yaml", run_dir=run_dir, **kw)
    cut_and_resume(cfg, run_dir, 2, 3, tmp_path)
    assert_close(launch.losses(run_dir), launch.losses(ref), range(1, 11))
    assert (run_dir / "step00000005.universal" / ckpt.MARKER).exists()
    # The next launch on 3 ranks resumes from its own 3-rank checkpoints, with no conversion.
    assert ckpt.read_marker(run_dir, "step00000010")["world_size"] == 3


def test_a_config_change_deepspeed_cannot_load_is_one_line_before_launch(
    zero_runs: dict[int, Path], tmp_path: Path
) -> None:
    """Day thirty: the config changed between resumes. Another ZeRO stage (2 -> 3), precision or optimizer fails
    deep in DeepSpeed's load (measured: an AssertionError, a missing optimizer file); `pipeline pretrain` says each
    by name in one error before any rank starts. ZeRO 2 -> 1 and a new global batch resume, the batch with a note.
    (The shared ZeRO-2 run is branched from, which only reads it.)"""
    import subprocess
    import sys

    run_dir = zero_runs[2]

    def dry_run(ds: str, *sets: str) -> subprocess.CompletedProcess:
        cfg = launch.write_config(
            tmp_path / "c.yaml", run_dir=tmp_path / "run", shards=Path(_shards(run_dir)), ds_config=ds
        )
        cmd = [sys.executable, "-m", "pipeline.cli", "pretrain", "--config", str(cfg), "--num-gpus", "2"]
        cmd += ["--dry-run", "--skip-doctor", "--set", f"checkpoint.branch_from={run_dir}"]
        cmd += [a for s in sets for a in ("--set", s)]
        return subprocess.run(cmd, env=launch.env(), capture_output=True, text=True, timeout=300, cwd=launch.ROOT)

    out = dry_run("zero3.json", "train.precision=bf16", "optim.name=muon")
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-3000:]
    error = [line for line in out.stderr.splitlines() if line.startswith("error: ")]
    assert len(error) == 1 and f"cannot branch from {run_dir}/step{STEPS:08d} (checkpoint.branch_from)" in error[0]
    for said in (
        "ZeRO stage 3 (train.deepspeed_config) vs the checkpoint's 1/2",
        "train.precision bf16 vs the checkpoint's fp32",
        "optim.name muon vs the checkpoint's adamw",
    ):
        assert said in error[0], error[0]
    ok = dry_run("zero1.json", "batch.global_batch_size=16", f"train.max_steps={STEPS + 5}")
    assert ok.returncode == 0, ok.stderr[-3000:]
    assert f"note: the global batch changed from 8 to 16 sequences since step {STEPS}" in ok.stderr


def _shards(run_dir: Path) -> str:
    import yaml

    return str(yaml.safe_load((run_dir / "config.yaml").read_text())["data"]["path"])
