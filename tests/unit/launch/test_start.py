"""pipeline.launch.start and the checks it makes before a process starts: GPUs that torch cannot use, more local ranks
than GPUs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.train.runtime.dist import local_ranks_problem
from tests.multiproc import launch


def test_more_local_ranks_than_gpus_is_refused_in_one_line() -> None:
    problem = local_ranks_problem(2, "cuda", 1)
    assert problem and "--num-gpus 2: this machine shows 1 GPU(s)" in problem and "--num-gpus 1 or fewer" in problem
    assert local_ranks_problem(2, "cuda", 2) is None and local_ranks_problem(8, "cpu", 0) is None


@pytest.mark.slow  # two `pipeline pretrain --dry-run` processes, each importing torch and DeepSpeed
def test_a_gpu_machine_whose_torch_cannot_use_the_gpu_is_refused_unless_the_cpu_is_asked_for(
    shards: Path, tmp_path: Path
) -> None:
    """The CPU build of torch on a machine with an NVIDIA driver (nvidia-smi present): `pipeline pretrain` says so
    and stops, instead of training on the CPU; DS_ACCELERATOR=cpu says the CPU is meant."""
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "nvidia-smi").write_text(
        "#!/bin/sh\necho 'NVIDIA-SMI 570.86  Driver Version: 570.86  CUDA Version: 12.8'\n"
    )
    (fake / "nvidia-smi").chmod(0o755)
    cfg = launch.write_config(tmp_path / "c.yaml", run_dir=tmp_path / "run", shards=shards, ds_config="zero1.json")
    env = {k: v for k, v in launch.env().items() if k != "DS_ACCELERATOR"}
    env["PATH"] = f"{fake}{os.pathsep}{env['PATH']}"
    cmd = [sys.executable, "-m", "pipeline.cli", "pretrain", "--config", str(cfg), "--num-gpus", "2", "--dry-run"]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stdout + out.stderr
    assert "has an NVIDIA GPU" in out.stderr and "is a CPU build" in out.stderr and "DS_ACCELERATOR=cpu" in out.stderr
    assert "Traceback" not in out.stderr
    out = subprocess.run(cmd, env={**env, "DS_ACCELERATOR": "cpu"}, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "deepspeed config" in out.stdout, out.stderr[-2000:]


def test_the_terminal_shows_the_runs_lines_and_the_log_file_keeps_every_line(tmp_path) -> None:
    """DeepSpeed's INFO lines, a warning's repeats (whatever their timestamps) and a few known lines that say
    nothing to a user stay out of the terminal; RUN_DIR/logs/launch.log keeps everything, from before rank 0 made
    the folder too."""
    from pipeline.launch.supervise import Console

    lines = [
        b"[2026-12-02 02:33:44,014] [WARNING] [runner.py:214:fetch_hostfile] Unable to find hostfile, will proceed "
        b"with training with local resources only.\n",
        b"[2026-12-02 02:33:44,840] [INFO] [launch.py:152:main] WORLD INFO DICT: {'localhost': [0, 1]}\n",
        b"DeepSpeed deepspeed.ops.comm.deepspeed_shm_comm_op built successfully\n",
        b"/x/c10d_logger.py:83: FutureWarning: `torch.distributed.all_gather_into_tensor` is deprecated.\n",
        b"  return func(*args, **kwargs)\n",
        b"[2026-12-02 02:33:45,000] [WARNING] [engine.py:1:f] a warning that matters\n",
        b"[2026-12-02 02:33:46,000] [WARNING] [engine.py:1:f] a warning that matters\n",
        b"step 3/3 | loss 6.2992 | lr 4.50e-04\n",
    ]
    run_dir = tmp_path / "run"
    console = Console(run_dir, "deepspeed ...")
    shown = []
    for i, line in enumerate(lines):
        if i == 3:
            run_dir.mkdir()  # rank 0 made the run folder
        console.keep(line)
        if console.shown(line):
            shown.append(line)
    console.close()
    assert shown == [lines[5], lines[7]]
    kept = (run_dir / "logs" / "launch.log").read_bytes()
    assert kept.startswith(b"=== ") and kept.endswith(b"".join(lines))


def test_an_error_every_rank_says_is_shown_once_and_a_dead_terminal_or_full_disk_does_not_stop_the_console(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ranks that agree on an error (a non-finite loss, a refused resume) each print it: the terminal shows it once.
    A terminal gone (EIO after a hang-up) or a log file the disk refuses must not kill the supervisor's reader,
    which would leave the ranks blocked on a full pipe."""
    import errno
    import io

    from pipeline.launch.supervise import Console

    error = b"error: step 92: loss nan (train.on_nonfinite is stop)\n"
    console = Console(tmp_path / "run", "deepspeed ...")
    assert [console.shown(line) for line in (error, error, b"step 3/3\n")] == [True, False, True]

    class Broken(io.RawIOBase):
        def writable(self) -> bool:
            return True

        def write(self, b: object) -> int:
            raise OSError(errno.EIO, "Input/output error")

    (tmp_path / "run").mkdir()
    console = Console(tmp_path / "run", "deepspeed ...")
    monkeypatch.setattr("sys.stdout", io.TextIOWrapper(io.BufferedWriter(Broken())))
    console.follow(io.BytesIO(b"step 1/3\nstep 2/3\n"))  # the terminal is gone: no exception
    assert (tmp_path / "run" / "logs" / "launch.log").read_bytes().endswith(b"step 1/3\nstep 2/3\n")
    console.file.write = lambda b: (_ for _ in ()).throw(OSError(errno.ENOSPC, "No space left on device"))
    console.keep(b"step 3/3\n")  # the disk is full: one warning, the lines go on to the terminal only
    assert console.path is None and console.file is None


def test_the_launchers_report_of_a_rank_that_stopped_on_a_signal_stays_in_the_log_file(tmp_path) -> None:
    """A rank stopped by SIGTERM/SIGINT saves and exits 143; DeepSpeed's launcher reports that as an ERROR line,
    which on the terminal reads like a crash after the run said it saved and stopped. Other exit codes stay."""
    from pipeline.launch.supervise import Console

    stopped = (
        b"[2026-12-02 07:05:20,415] [ERROR] [launch.py:259:sigkill_handler] ['python', '-u', 'pretrain.py', "
        b"'--local_rank=1'] exits with return code = 143\n"
    )
    crashed = stopped.replace(b"= 143", b"= 1")
    console = Console(tmp_path / "run", "deepspeed ...")
    assert not console.shown(stopped) and console.shown(crashed)


def test_a_lost_host_stops_the_restarts_at_once_naming_it(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """F2 of the multi-node review: after a failed launch, --max-restarts reaches every host of the hostfile first
    (DeepSpeed's launcher probes only the first); with one lost it stops, naming it, instead of relaunching into a
    collective that waits its whole timeout for the lost node, every try."""
    import shutil
    import time

    from pipeline.launch.supervise import run_with_restarts

    if shutil.which("ssh") is None:
        pytest.skip("no ssh client (apt-get install openssh-client)")
    started = time.monotonic()
    code = run_with_restarts(["false"], max_restarts=3, run_dir=tmp_path, hosts=["lost-node.invalid"])
    said = capsys.readouterr().err
    assert code == 1 and time.monotonic() - started < 60
    assert "1 host(s) of the hostfile do not answer ssh: lost-node.invalid (" in said
    assert "Not relaunching" in said and "restart 1 of 3" not in said
