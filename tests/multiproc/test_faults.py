"""Surviving faults through the real launcher (2 CPU ranks): a rank killed in the middle of a save, with
`pipeline pretrain --max-restarts`; damaged checkpoints; a full disk; a non-finite loss; a hung rank. Faults are
injected with the test-only switches of pipeline.train.faults."""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipeline.train.checkpoint import files as ckpt
from tests.conftest import Mount, remount
from tests.multiproc import launch
from tests.multiproc.conftest import STEPS

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


def pipeline_pretrain(
    cfg: Path, *args: str, extra_env: dict[str, str] | None = None, timeout: int = 900
) -> subprocess.CompletedProcess:
    cmd = [
        str(Path(sys.executable).parent / "pipeline"),
        "pretrain",
        "--config",
        str(cfg),
        "--num-gpus",
        "2",
        "--master-port",
        str(launch.free_port()),
        *args,
    ]
    return subprocess.run(
        cmd, env={**launch.env(), **(extra_env or {})}, capture_output=True, text=True, timeout=timeout, cwd=ROOT
    )


def test_a_rank_killed_mid_save_restarts_by_itself_with_identical_losses(
    zero_runs: dict[int, Path], shards: Path, tmp_path: Path
) -> None:
    """The last rank dies after writing part of checkpoint 10: 10 is left incomplete, 5 stays the latest, and
    `--max-restarts 1` relaunches, resumes from 5 and finishes with the uninterrupted run's loss at every step."""
    run_dir = tmp_path / "run"
    cfg = launch.write_config(tmp_path / "c.yaml", run_dir=run_dir, shards=shards, ds_config="zero2.json", steps=STEPS)
    once = tmp_path / "fired"
    out = pipeline_pretrain(
        cfg, "--max-restarts", "1", extra_env={"PIPELINE_FAULT_KILL_IN_SAVE": "10", "PIPELINE_FAULT_ONCE": str(once)}
    )
    log = out.stdout + out.stderr
    assert out.returncode == 0, log[-4000:]
    assert once.exists() and "restart 1 of 1, from the latest complete checkpoint" in log
    assert f"resumed from {run_dir}/step00000005" in log  # not from the half-written step00000010
    uninterrupted, resumed = launch.losses(zero_runs[2]), launch.losses(run_dir)
    assert sorted(resumed) == list(range(1, STEPS + 1))
    assert all(resumed[s] == uninterrupted[s] for s in resumed), [
        (s, resumed[s], uninterrupted[s]) for s in resumed if resumed[s] != uninterrupted[s]
    ]
    marker = ckpt.read_marker(run_dir, "step00000020")
    assert marker["files"] and all(v["size"] > 0 for v in marker["files"].values())


def test_damaged_checkpoints_are_skipped_with_a_warning(shards: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    cfg = launch.write_config(
        tmp_path / "c.yaml", run_dir=run_dir, shards=shards, ds_config="zero1.json", steps=12, extra=""
    )
    sets = ("checkpoint.keep_last=3", "checkpoint.verify=true")
    out = launch.run(cfg, sets=sets)
    assert out.returncode == 0, out.stderr[-3000:]
    assert ckpt.complete_tags(run_dir) == ["step00000005", "step00000010", "step00000012"]
    files = ckpt.read_marker(run_dir, "step00000012")["files"]
    assert all(len(v["sha256"]) == 64 for v in files.values())
    victim = run_dir / "step00000012" / sorted(f for f in files if "optim_states" in f)[0]
    with open(victim, "r+b") as f:  # truncated, as a crash of the disk or a copy would leave it
        f.truncate(victim.stat().st_size // 2)
    out = launch.run(cfg, sets=sets)
    log = out.stdout + out.stderr
    assert out.returncode == 0, log[-3000:]
    assert f"checkpoint step00000012 skipped: {victim}" in log and "truncated or damaged" in log
    assert f"resumed from {run_dir}/step00000010" in log
    assert ckpt.damage(run_dir, "step00000012", verify=True) is None  # saved again, whole
    data = bytearray(victim.read_bytes())  # one flipped byte: the size is right, only the hash tells
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    out = launch.run(cfg, sets=sets)
    log = out.stdout + out.stderr
    assert out.returncode == 0, log[-3000:]
    assert "sha256 differs" in log and f"resumed from {run_dir}/step00000010" in log


def test_a_full_disk_stops_every_rank_with_one_message(shards: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    cfg = launch.write_config(tmp_path / "c.yaml", run_dir=run_dir, shards=shards, ds_config="zero2.json", steps=12)
    t0 = time.monotonic()
    out = launch.run(cfg, timeout=600, extra_env={"PIPELINE_FAULT_ENOSPC_IN_SAVE": "10"})
    log = out.stdout + out.stderr
    assert out.returncode == 2, log[-3000:]
    assert time.monotonic() - t0 < 300  # no rank hung in a barrier
    assert "checkpoint step00000010 could not be saved (rank 1:" in log and "No space left on device" in log
    assert "step00000005 stays the latest complete checkpoint" in log and "GB free at" in log
    assert ckpt.latest_complete(run_dir) == "step00000005" and (run_dir / "latest").read_text() == "step00000005"


def test_a_disk_that_fills_during_a_save_is_one_line_and_the_run_continues_once_space_is_freed(
    shards: Path, tmp_path: Path, mount: Mount
) -> None:
    """A real full disk, not an injected error: run_dir on a 4 MB tmpfs holds checkpoint 5 (2.6 MB) and fills
    while checkpoint 10 is written (torch.save then fails with a RuntimeError of its zip writer, not an OSError).
    The launch says it once, in one line naming the disk and what to do, without a traceback; the half-written
    step00000010 has no marker, so it is never resumed; with the disk grown (space freed) the same command
    resumes from step 5 and trains steps 6-10 to the losses the first launch logged."""
    disk = mount("4m")
    run_dir = disk / "run"
    cfg = launch.write_config(tmp_path / "c.yaml", run_dir=run_dir, shards=shards, ds_config="zero2.json", steps=12)
    out = launch.run(cfg, timeout=600)
    log = out.stdout + out.stderr
    assert out.returncode == 2, log[-3000:]
    said = [line for line in log.splitlines() if line.startswith("error: ")]
    assert len(said) == 1 and "Traceback" not in log, log[-4000:]
    assert "checkpoint step00000010 could not be saved" in said[0] and "No space left on device" in said[0]
    assert f"free at {run_dir}" in said[0] and "the incomplete step00000010/ is never resumed" in said[0]
    assert ckpt.complete_tags(run_dir) == ["step00000005"] and (run_dir / "step00000010").is_dir()
    first = launch.losses(run_dir)
    remount(disk, "32m")
    out = launch.run(cfg, timeout=600)
    log = out.stdout + out.stderr
    assert out.returncode == 0, log[-3000:]
    assert f"resumed from {run_dir}/step00000005" in log
    again = launch.losses(run_dir)
    assert [again[s] for s in range(6, 11)] == [first[s] for s in range(6, 11)]
    assert ckpt.latest_complete(run_dir) == "step00000012"


def test_a_nonfinite_loss_stops_without_saving_or_is_skipped(shards: Path, tmp_path: Path) -> None:
    stop_dir = tmp_path / "stop"
    cfg = launch.write_config(tmp_path / "s.yaml", run_dir=stop_dir, shards=shards, ds_config="zero2.json", steps=10)
    out = launch.run(cfg, extra_env={"PIPELINE_FAULT_NONFINITE_AT_STEP": "7"})
    log = out.stdout + out.stderr
    assert out.returncode == 2, log[-3000:]
    assert "step 7: loss nan (train.on_nonfinite is stop); DeepSpeed did not apply that update" in log
    assert "step00000005 stays the latest" in log and "The step's samples (train split ids): " in log
    assert ckpt.complete_tags(stop_dir) == ["step00000005"]

    skip_dir = tmp_path / "skip"
    cfg = launch.write_config(
        tmp_path / "k.yaml", run_dir=skip_dir, shards=shards, ds_config="zero2.json", steps=10, extra=""
    )
    out = launch.run(cfg, sets=("train.on_nonfinite=skip",), extra_env={"PIPELINE_FAULT_NONFINITE_AT_STEP": "7"})
    log = out.stdout + out.stderr
    assert out.returncode == 0, log[-3000:]
    assert "step 7: loss nan; DeepSpeed did not apply that update (skipped 1 in a row, 1 in this launch)" in log
    losses = launch.losses(skip_dir)
    assert math.isnan(losses[7]) and all(math.isfinite(losses[s]) for s in range(1, 11) if s != 7)
    assert losses[10] < losses[1]


def test_a_hung_rank_fails_the_launch_instead_of_hanging(shards: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    cfg = launch.write_config(
        tmp_path / "c.yaml", run_dir=run_dir, shards=shards, ds_config="zero2.json", steps=400, ckpt_interval=1000
    )
    proc = launch.start(cfg, tmp_path / "log", sets=("train.comm_timeout_minutes=0.25",))
    try:
        launch.wait_for_step(run_dir, 3, proc)
        ranks = subprocess.run(
            ["pgrep", "-f", f"pretrain.py --local_rank=1 --config {cfg}"], capture_output=True, text=True
        ).stdout.split()
        assert ranks, "rank 1 not found"
        os.kill(int(ranks[0]), signal.SIGSTOP)
        t0 = time.monotonic()
        proc.wait(timeout=180)
        assert proc.returncode != 0 and time.monotonic() - t0 < 120
        log = (tmp_path / "log").read_text()
        assert "no training step finished for" in log and "another rank has hung or died" in log
    finally:
        try:
            launch.kill_group(proc)
        except ProcessLookupError:
            pass


def test_optimizer_steps_longer_than_the_timeout_finish(shards: Path, tmp_path: Path) -> None:
    """A step of many micro-steps (70B on 8 x 4090D: 61 of them, 1.5-2 hours) is progress, not a hang: here each
    micro-step sleeps 2 s, GA 4 makes a step of 8 s, and train.comm_timeout_minutes is 0.1 (6 s)."""
    run_dir = tmp_path / "run"
    cfg = launch.write_config(
        tmp_path / "c.yaml",
        run_dir=run_dir,
        shards=shards,
        ds_config="zero2.json",
        steps=2,
        micro=1,
        global_batch=8,
        ckpt_interval=2,
    )
    out = launch.run(cfg, sets=("train.comm_timeout_minutes=0.1",), extra_env={"PIPELINE_FAULT_SLOW_MICRO_STEP": "2"})
    log = out.stdout + out.stderr
    assert out.returncode == 0, log[-3000:]
    assert sorted(launch.losses(run_dir)) == [1, 2] and "no training step finished" not in log


def test_a_conversion_longer_than_the_timeout_resumes(shards: Path, tmp_path: Path) -> None:
    """Resuming 70B on another world size converts about 3 TB to the universal form while the other ranks wait:
    that wait is not a hang. Here the conversion takes 25 s more and train.comm_timeout_minutes is 0.25 (15 s)."""
    run_dir = tmp_path / "run"
    cfg = launch.write_config(
        tmp_path / "c.yaml", run_dir=run_dir, shards=shards, ds_config="zero1.json", steps=6, ckpt_interval=3
    )
    sets = ("train.comm_timeout_minutes=0.25",)
    first = launch.run(cfg, num_gpus=1, sets=sets, extra_env={"PIPELINE_FAULT_KILL_AT_STEP": "4"})
    assert first.returncode != 0 and ckpt.latest_complete(run_dir) == "step00000003"
    out = launch.run(cfg, num_gpus=2, sets=sets, extra_env={"PIPELINE_FAULT_SLOW_CONVERSION": "25"})
    log = out.stdout + out.stderr
    assert out.returncode == 0, log[-3000:]
    assert "through the universal checkpoint step00000003.universal" in log
    assert sorted(launch.losses(run_dir)) == list(range(1, 7))
