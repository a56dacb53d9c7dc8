"""Helpers to run pipeline/pretrain.py through DeepSpeed's real launcher with CPU ranks (gloo)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "pipeline" / "pretrain.py"


def free_port() -> int:
    """A rendezvous port below the ephemeral range (pipeline.doctor.cluster.rendezvous_port says why), in this
    pytest-xdist worker's own slice of it: the other worker's launches never pick the same one."""
    from pipeline.doctor.cluster import rendezvous_port

    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    span = 12000 // max(1, count)
    lo = 20000 + (int(worker) % max(1, count) if worker.isdigit() else 0) * span
    return rendezvous_port(lo, lo + span)


HIDDEN = Path(__file__).resolve().parent / "hidden"
"""First on the launches' PYTHONPATH: an `mlflow` that fails to import. DeepSpeed imports mlflow at its own import
whenever it is installed (deepspeed.autotuning), 1.4 of the 3 s that `import deepspeed` takes here, in the node
launcher and every rank of every launch. The test extra installs mlflow for the one test that tracks a run to it,
which launches with env(mlflow=True)."""


def env(mlflow: bool = False, compile: bool = False) -> dict[str, str]:
    """The environment of a launch. Without `compile`, TORCHDYNAMO_DISABLE=1: every ZeRO and bf16 engine imports
    DeepSpeed's Muon, whose torch.compile decorators load Inductor (0.8 s of a rank's start here, 1.2 of a 2-rank
    launch's 13 s of CPU), and a Muon run compiles its Newton-Schulz steps for the CPU (6.5 s more). The pipeline
    says compile is off under it (pipeline.model.kernels.choose_compile), so a test of train.compile that forgets
    compile=True fails on its "compile: on" line instead of comparing eager with eager."""
    e = os.environ.copy()
    # always set, so that env(mlflow=True) passed as launcher_env's extra replaces the hiding one
    e["PYTHONPATH"] = os.pathsep.join(p for p in ([] if mlflow else [str(HIDDEN)]) + [e.get("PYTHONPATH", "")] if p)
    e["TORCHDYNAMO_DISABLE"] = "0" if compile else "1"
    e["DS_ACCELERATOR"] = "cpu"
    # The venv's ninja first: two ninja versions rebuild each other's JIT ops otherwise.
    e["PATH"] = str(Path(sys.executable).parent) + os.pathsep + e.get("PATH", "")
    e.setdefault("TORCH_EXTENSIONS_DIR", str(Path(sys.prefix) / "torch_extensions"))  # the project's op cache
    e["PYTHONUNBUFFERED"] = "1"
    e.setdefault("OMP_NUM_THREADS", "1")
    return e


def write_config(
    path: Path,
    *,
    run_dir: Path,
    shards: Path,
    ds_config: str,
    steps: int = 20,
    micro: int = 2,
    global_batch: int = 8,
    ckpt_interval: int = 5,
    extra: str = "",
    model: str = "{preset: tiny}",
    lr: float = 3e-3,
    min_lr: float = 3e-4,
) -> Path:
    path.write_text(f"""run_dir: {run_dir}
model: {model}
data: {{path: {shards}, num_workers: 1, verify: true}}
batch: {{micro_batch_size: {micro}, global_batch_size: {global_batch}}}
optim: {{lr: {lr}, min_lr: {min_lr}, warmup_steps: 3, weight_decay: 0.1, grad_clip: 1.0}}
train: {{max_steps: {steps}, seed: 1234, precision: fp32, deepspeed_config: {ROOT / "ds_configs" / ds_config},
        loss_chunk_tokens: 48}}
eval: {{interval: 10, batches: 2}}
checkpoint: {{interval: {ckpt_interval}, keep_last: 2}}
log: {{interval: 1, tensorboard: true}}
{extra}""")
    return path


def command(config: Path, *, num_gpus: int = 2, port: int | None = None, sets: tuple[str, ...] = ()) -> list[str]:
    """DeepSpeed's node launcher (pipeline.launch.command.node_launcher_command). The tests about the `deepspeed`
    front end itself (hostfiles, .deepspeed_env, ssh) call it in tests/unit/launch/test_launch.py and
    test_multinode.py; here it would
    only add a Python start of 3 s to every launch."""
    from pipeline.launch.command import node_launcher_command

    args = ["--config", str(config), *(a for s in sets for a in ("--set", s))]
    return node_launcher_command(SCRIPT, *args, num_gpus=num_gpus, port=port or free_port())


def launcher_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """env() as `deepspeed` passes it to its node launcher: the working directory (ROOT) first on PYTHONPATH."""
    e = {**env(), **(extra or {})}
    e["PYTHONPATH"] = str(ROOT) + (os.pathsep + e["PYTHONPATH"] if e.get("PYTHONPATH") else "")
    return e


def run(config: Path, timeout: int = 900, extra_env: dict[str, str] | None = None, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(
        command(config, **kw),
        env=launcher_env(extra_env),
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
    )


def run_script(script: Path, *args: str | Path, num_gpus: int = 2, timeout: int = 900) -> subprocess.CompletedProcess:
    """A test's own rank script (engine_memory.py, engine_logits.py) under DeepSpeed's launcher, with its args."""
    from pipeline.launch.command import node_launcher_command

    cmd = node_launcher_command(script, *map(str, args), num_gpus=num_gpus, port=free_port())
    return subprocess.run(cmd, env=launcher_env(), capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def start(config: Path, log: Path, extra_env: dict[str, str] | None = None, **kw) -> subprocess.Popen:
    f = open(log, "w")
    return subprocess.Popen(
        command(config, **kw),
        env=launcher_env(extra_env),
        stdout=f,
        stderr=subprocess.STDOUT,
        cwd=ROOT,
        start_new_session=True,
    )


def wait_for_step(run_dir: Path, step: int, proc: subprocess.Popen, timeout: float = 600) -> None:
    t0 = time.time()
    while time.time() - t0 < timeout:
        if proc.poll() is not None:
            raise AssertionError(f"run ended early with {proc.returncode}")
        if max(losses(run_dir), default=0) >= step:
            return
        time.sleep(0.2)
    raise AssertionError(f"step {step} not reached in {timeout}s")


def kill_group(proc: subprocess.Popen, sig: int = signal.SIGKILL) -> None:
    os.killpg(proc.pid, sig)


def wait_group(proc: subprocess.Popen, timeout: float = 180) -> None:
    """Wait until every process of the launch (ranks, workers) is gone, not just the launcher."""
    proc.wait(timeout=timeout)
    t0 = time.time()
    while time.time() - t0 < timeout:
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.2)
    raise AssertionError(f"processes of the launch still alive after {timeout}s")


def losses(run_dir: Path) -> dict[int, float]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return {}
    out = {}
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line being written
        if "loss" in rec:
            out[rec["step"]] = rec["loss"]
    return out
