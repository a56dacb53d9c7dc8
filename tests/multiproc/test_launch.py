"""What every launch carries to its ranks, through the real launcher: `.deepspeed_env` on a one-node launch
(DeepSpeed reads it only over pdsh), how a CPU-Adam run's ranks share the node's cores, and how `pipeline
pretrain` supervises its process tree: signals stop the run as one, a live run folder is not shared."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from pipeline.train.checkpoint import files as ckpt
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


def pipeline_pretrain(cfg: Path, log: Path, *extra: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    """`pipeline pretrain` as a user's shell starts it (its own process group, like a terminal's job)."""
    cmd = [str(Path(sys.executable).parent / "pipeline"), "pretrain", "--config", str(cfg), "--num-gpus", "2"]
    cmd += ["--master-port", str(launch.free_port()), *extra]
    f = open(log, "w")  # noqa: SIM115 - the child holds it
    return subprocess.Popen(
        cmd, env=launch.env() | (env or {}), stdout=f, stderr=subprocess.STDOUT, cwd=launch.ROOT, start_new_session=True
    )


def processes_of(cfg: Path) -> list[psutil.Process]:
    """Every process on this host whose command line names the config: the launcher, the ranks, their workers."""
    out = []
    for p in psutil.process_iter():
        with contextlib.suppress(psutil.Error):
            if str(cfg) in p.cmdline():
                out.append(p)
    return out


@contextlib.contextmanager
def reaped(cfg: Path) -> Iterator[None]:
    """Whatever the test's outcome, no process of this config outlives it (a failed assertion would leave a
    training running, and `--max-restarts` relaunching it)."""
    try:
        yield
    finally:
        for p in sorted(processes_of(cfg), key=lambda p: "pipeline" not in " ".join(p.cmdline()[:2])):
            with contextlib.suppress(psutil.Error):
                p.kill()


STALL_S = 120.0
"""How long a run may show no sign of work (no CPU time spent by its processes, no file of its run folder or log
changed) before a wait calls it stuck. A wait ends on what it waits for, however slow a busy machine makes it; only
a run that stopped working fails it, so a CPU-bound neighbour slows these tests without failing them."""


def activity(cfg: Path, *paths: Path) -> tuple[Any, ...]:
    """What changes while the processes of `cfg` work: their CPU time and count, and the files under `paths`."""
    cpu = 0.0
    procs = processes_of(cfg)
    for p in procs:
        with contextlib.suppress(psutil.Error):
            times = p.cpu_times()
            cpu += times.user + times.system
    files = []
    for path in paths:
        for f in [path, *(path.rglob("*") if path.is_dir() else [])]:
            with contextlib.suppress(OSError):
                st = f.stat()
                files.append((str(f), st.st_size, st.st_mtime_ns))
    return len(procs), round(cpu, 2), tuple(sorted(files))


def wait_working(done: Callable[[], bool], cfg: Path, *paths: Path, stall_s: float = STALL_S) -> bool:
    """Wait until done(), for as long as the run keeps working (`activity` changes within stall_s); False when it
    stopped working first."""
    last, since = activity(cfg, *paths), time.monotonic()
    while not done():
        time.sleep(0.5)
        now = activity(cfg, *paths)
        if now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since > stall_s:
            return done()
    return True


def exit_code(proc: subprocess.Popen, cfg: Path, *paths: Path) -> int | None:
    """The exit code of `pipeline pretrain` once it exits, waiting as long as its run works; None when it stopped
    working without exiting."""
    return proc.returncode if wait_working(lambda: proc.poll() is not None, cfg, *paths) else None


def no_process_left(cfg: Path, *paths: Path) -> bool:
    """Every process of `cfg` gone, waiting as long as they still work (saving, exiting) on a busy machine."""
    return wait_working(lambda: not processes_of(cfg), cfg, *paths)


@pytest.mark.parametrize(
    "sig, code",
    [(signal.SIGTERM, 143), (signal.SIGINT, 130), (signal.SIGHUP, 129)],
    ids=["SIGTERM", "SIGINT", "SIGHUP"],
)
def test_a_signal_to_pipeline_pretrain_stops_the_whole_run_saved_and_never_exits_0(
    shards: Path, tmp_path: Path, sig: int, code: int
) -> None:
    """What `kill`, `docker stop`, Slurm, a terminal's Ctrl-C and a closed terminal or lost ssh session (SIGHUP) do
    to the command we tell users to run: every rank saves at the end of its step and stops, no process is left
    training, and the exit code says it stopped early (so `pipeline pretrain ... && pipeline export ...` exports
    nothing). While it trains, a second launch into its run folder is refused before its launcher starts, whatever
    master port it picks."""
    run_dir = tmp_path / "run"
    cfg = launch.write_config(
        tmp_path / "c.yaml", run_dir=run_dir, shards=shards, ds_config="zero2.json", steps=100000, ckpt_interval=100000
    )
    with reaped(cfg):
        signalled_pipeline_pretrain(cfg, run_dir, tmp_path, sig, code)


def signalled_pipeline_pretrain(cfg: Path, run_dir: Path, tmp_path: Path, sig: int, code: int) -> None:
    proc = pipeline_pretrain(cfg, tmp_path / "a.log")
    launch.wait_for_step(run_dir, 3, proc)
    second = subprocess.run(
        [str(Path(sys.executable).parent / "pipeline"), "pretrain", "--config", str(cfg), "--num-gpus", "2"]
        + ["--master-port", str(launch.free_port())],
        env=launch.env(),
        capture_output=True,
        text=True,
        timeout=120,
        cwd=launch.ROOT,
    )
    assert second.returncode == 2 and "is in use by another training (pid" in second.stderr, second.stderr
    assert "+ " not in second.stderr  # no launcher was started
    os.kill(proc.pid, sig)
    assert exit_code(proc, cfg, run_dir, tmp_path / "a.log") == code
    log = (tmp_path / "a.log").read_text()
    assert "stopping the run; every rank saves a checkpoint" in log and "stopped by signal at step" in log, log[-3000:]
    assert "Traceback" not in log, log[-3000:]
    tag = ckpt.latest_complete(run_dir)
    assert tag is not None and int(tag[4:]) >= 3 and ckpt.read_marker(run_dir, tag)["step"] == int(tag[4:])
    assert no_process_left(cfg, run_dir), [p.cmdline() for p in processes_of(cfg)]


def test_a_killed_pipeline_pretrain_stops_its_ranks_saved_and_the_same_command_resumes(
    shards: Path, tmp_path: Path
) -> None:
    """`kill -9` of the command (the OOM killer, `docker kill`) leaves nothing to forward a stop: the ranks notice
    their launching command is gone within seconds, save at the end of their step and stop, so no training goes on
    headless holding the run folder; the same command then resumes from that checkpoint and finishes."""
    run_dir = tmp_path / "run"
    cfg = launch.write_config(
        tmp_path / "c.yaml", run_dir=run_dir, shards=shards, ds_config="zero2.json", steps=60, ckpt_interval=100000
    )
    with reaped(cfg):
        slow = {"PIPELINE_FAULT_SLOW_MICRO_STEP": "0.1"}  # 0.2 s a step: the kill lands mid-run
        proc = pipeline_pretrain(cfg, tmp_path / "a.log", env=slow)
        launch.wait_for_step(run_dir, 3, proc)
        proc.kill()
        assert proc.wait(timeout=30) == -signal.SIGKILL
        assert no_process_left(cfg, run_dir), [p.cmdline() for p in processes_of(cfg)]
        tag = ckpt.latest_complete(run_dir)
        assert tag is not None and 3 <= int(tag[4:]) < 60, tag
        log = (run_dir / "logs" / "launch.log").read_text()
        assert "the `pipeline pretrain` that launched this run is gone" in log and "Traceback" not in log, log[-3000:]
        again = pipeline_pretrain(cfg, tmp_path / "b.log")
        assert exit_code(again, cfg, run_dir, tmp_path / "b.log") == 0, (tmp_path / "b.log").read_text()[-3000:]
        resumed = (tmp_path / "b.log").read_text()
        assert f"resumed from {run_dir / tag}" in resumed and "done: step 60" in resumed, resumed[-3000:]


def test_a_signal_to_one_rank_alone_stops_every_rank_and_is_not_relaunched(shards: Path, tmp_path: Path) -> None:
    """A scheduler or a user's `pkill` may reach the ranks and not `pipeline pretrain`: the ranks still agree to
    stop, save and exit with 143, and --max-restarts does not start them again."""
    run_dir = tmp_path / "run"
    cfg = launch.write_config(
        tmp_path / "c.yaml", run_dir=run_dir, shards=shards, ds_config="zero2.json", steps=100000, ckpt_interval=100000
    )
    with reaped(cfg):
        rank_signalled(cfg, run_dir, tmp_path)


def rank_signalled(cfg: Path, run_dir: Path, tmp_path: Path) -> None:
    proc = pipeline_pretrain(cfg, tmp_path / "b.log", "--max-restarts", "2")
    launch.wait_for_step(run_dir, 3, proc)
    one = [p for p in processes_of(cfg) if "--local_rank=1" in p.cmdline()]
    ranks = [p for p in one if "--local_rank=1" not in p.parent().cmdline()]  # the rank, not its data workers
    assert len(ranks) == 1
    ranks[0].send_signal(signal.SIGTERM)
    assert exit_code(proc, cfg, run_dir, tmp_path / "b.log") == 143
    log = (tmp_path / "b.log").read_text()
    assert "stopped by signal at step" in log and "restart 1 of" not in log, log[-3000:]
    assert ckpt.latest_complete(run_dir) is not None
    assert no_process_left(cfg, run_dir)


def test_a_run_sends_its_metrics_to_wandb_and_mlflow_as_to_metrics_jsonl(
    shards: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Tracking through a real 2-rank launch, offline: W&B's offline run files and an MLflow file store get the
    same loss at the same steps as metrics.jsonl, from rank 0 alone."""
    from tests.unit.train.parts.test_tracking import mlflow_history, wandb_history

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # this process reads the store back too

    run_dir, uri = tmp_path / "run", f"file:{tmp_path / 'mlruns'}"
    tracking = f"log: {{interval: 1, tensorboard: false, wandb_project: tests, mlflow_tracking_uri: '{uri}'}}"
    cfg = launch.write_config(tmp_path / "c.yaml", run_dir=run_dir, shards=shards, ds_config="zero1.json", steps=4)
    cfg.write_text(cfg.read_text().replace("log: {interval: 1, tensorboard: true}", tracking))
    env = {
        **launch.env(mlflow=True),
        "WANDB_MODE": "offline",
        "WANDB_SILENT": "true",
        "MLFLOW_ALLOW_FILE_STORE": "true",
    }
    out = launch.run(cfg, extra_env=env)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    logged = [(s, loss) for s, loss in sorted(launch.losses(run_dir).items())]
    assert len(logged) == 4
    ids = json.loads((run_dir / "tracking.json").read_text())
    assert [(h["_step"], h["loss"]) for h in wandb_history(run_dir, runs=1) if "loss" in h] == logged
    assert mlflow_history(uri, ids["mlflow"], "loss") == logged
