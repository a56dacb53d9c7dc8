"""Supervising a launch: the launcher in a process tree of its own with signals forwarded to the training ranks
(`Supervised`), its output kept in the run's log and shown without DeepSpeed's bookkeeping (`Console`), and
relaunches after a failure a relaunch can fix (`run_with_restarts`), refused when a host of the hostfile is gone
unless --min-nodes lets the run go on without it (pipeline.launch.shrink)."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click
import psutil

from pipeline.errors import EXIT_STOPPED, PipelineError
from pipeline.launch.command import PACKAGE

if TYPE_CHECKING:
    from pipeline.launch.shrink import Survivors

NOT_RELAUNCHED = (0, 2, 130, EXIT_STOPPED)
"""0 done; 2 a mistake in the input or a run stopped on purpose (non-finite loss, full disk): a relaunch would fail
the same way; 130 and 143 stopped by a signal."""


def unreachable_hosts(hosts: list[str], timeout: float = 15.0) -> list[tuple[str, str]]:
    """(host, why) for each host that does not answer ssh as DeepSpeed's launcher reaches it, asked in parallel."""
    from pipeline.doctor.remote import ask_every, last_line

    return [(h, last_line(a)) for h, a in ask_every(hosts, "true", timeout).items() if a.returncode != 0]


def run_with_restarts(
    cmd: list[str],
    max_restarts: int,
    run_dir: Path | None = None,
    hosts: list[str] | None = None,
    survivors: Survivors | None = None,
    log_name: str = "launch.log",
) -> int:
    """Run the launcher; after a failure that a relaunch can fix, run it again (the run resumes from its latest
    complete checkpoint), up to `max_restarts` times. Before a relaunch every host of `hosts` (the hostfile's) is
    reached: DeepSpeed probes only the first, and a relaunch with a lost node waits in its first collective for
    the whole timeout, every try; with one gone the run stops, naming it, unless `survivors` (--min-nodes) says
    how to go on without it: then the hosts are reached before every launch, and each runs on those that answer.
    A SIGTERM or SIGINT to this process stops the run as one: every rank saves at the end of its step and exits
    (`Supervised`); the exit code is then 143 or 130."""
    restarts, code, started = 0, None, time.monotonic()
    while True:
        lost = unreachable_hosts(hosts) if hosts and (code is not None or survivors is not None) else []
        if code is not None and lost and survivors is None:
            click.echo(
                f"launch failed with exit code {code}, and {len(lost)} host(s) of the hostfile do not answer ssh: "
                + "; ".join(f"{h} ({why})" for h, why in lost)
                + ". Not relaunching: each try would wait its first collective's whole timeout for them. Bring "
                "them back and run the same command, or give --min-nodes N to go on with the hosts that answer "
                "(the run resumes on the smaller world through DeepSpeed's universal checkpoint)",
                err=True,
            )
            return code
        said: list[str] = []  # what the hosts that answer change, said after the restart's own line
        if survivors is not None:
            try:
                cmd = survivors.command(lost, said.append)
            except PipelineError as e:
                if code is None:
                    raise
                click.echo(f"launch failed with exit code {code}; not relaunching: {e}", err=True)
                return code
        if code is not None:
            restarts += 1
            click.echo(
                f"launch failed with exit code {code} after {time.monotonic() - started:.0f} s; restart "
                f"{restarts} of {max_restarts}, from the latest complete checkpoint",
                err=True,
            )
        for line in said:
            click.echo(line, err=True)
        started = time.monotonic()
        launch = Supervised(cmd, run_dir, log_name)
        code = launch.wait()
        if launch.stopped_by is not None:  # done (0), a mistake (2), or stopped by this signal
            return code if code in (0, 2) else 128 + launch.stopped_by
        if code in NOT_RELAUNCHED or restarts >= max_restarts:
            if code not in NOT_RELAUNCHED and max_restarts:
                click.echo(f"launch failed with exit code {code}; no restarts left ({max_restarts} used)", err=True)
            return code


class Supervised:
    """The `deepspeed` launcher in a session of its own, so that a terminal's Ctrl-C, `kill`, `docker stop` or
    Slurm reach this process first; it forwards the stop to the training ranks only. DeepSpeed's launcher, if it
    got the signal itself, would terminate its ranks and SIGKILL them 30 s later, in the middle of saving a large
    checkpoint; the ranks instead finish their step, agree to stop, save, and exit with EXIT_STOPPED. One rank hearing
    it is enough: they agree on stopping every step. A second signal ends the whole launch now."""

    def __init__(self, cmd: list[str], run_dir: Path | None = None, log_name: str = "launch.log"):
        self.stopped_by: int | None = None
        script = str(PACKAGE / "pretrain.py")
        self.rank_args = cmd[cmd.index(script) :] if script in cmd else [script]
        from pipeline.train.parts.guards import SUPERVISOR_ENV

        self.console = Console(run_dir, " ".join(cmd), log_name)
        me = psutil.Process()
        env = os.environ | {SUPERVISOR_ENV: f"{socket.gethostname()}:{me.pid}:{me.create_time()}"}  # guards.Watchdog
        self.proc = subprocess.Popen(
            cmd, env=env, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
        )
        # A hang-up (a closed terminal, a lost ssh session) stops the run as SIGTERM does, unless it is ignored
        # (`nohup pipeline pretrain ...`: the user asked the run to outlive the terminal).
        stops = [signal.SIGTERM, signal.SIGINT]
        if signal.getsignal(signal.SIGHUP) is not signal.SIG_IGN:
            stops.append(signal.SIGHUP)
        self._previous = {s: signal.signal(s, self._on_signal) for s in stops}
        self._reader = threading.Thread(target=self.console.follow, args=(self.proc.stdout,), daemon=True)
        self._reader.start()

    def wait(self) -> int:
        try:
            while True:
                try:
                    code = self.proc.wait()
                    break
                except InterruptedError:
                    continue
            self._reader.join(timeout=10)
            self.console.close()
            return code
        finally:
            for s, handler in self._previous.items():
                signal.signal(s, handler)

    def _on_signal(self, signum: int, frame: Any) -> None:
        name = signal.Signals(signum).name
        if self.stopped_by is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            _say(f"{name} again: ending the launch now (a checkpoint being written stays incomplete)")
            return
        self.stopped_by = signum
        ranks = training_ranks(self.proc.pid, self.rank_args)
        if not ranks:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            _say(
                f"{name}: no training rank runs on this host; asked DeepSpeed's launcher to stop them (it gives "
                "them 30 s to save)"
            )
            return
        for p in ranks:
            with contextlib.suppress(psutil.Error):
                p.send_signal(signal.SIGTERM)
        _say(
            f"{name}: stopping the run; every rank saves a checkpoint at the end of its step (send it again to end "
            "it now)"
        )


def _say(line: str) -> None:
    """A line on stderr that cannot fail the supervisor: after a hang-up the terminal is gone (EIO)."""
    with contextlib.suppress(OSError):
        click.echo(line, err=True)


class Console:
    """The launch's output, every line in RUN_DIR/logs/launch.log (kept in memory until rank 0 makes the folder),
    and on the terminal without DeepSpeed's INFO lines, each warning and each error line once (every rank says an
    error they agree on), and a few known lines that say nothing to
    a user (NOISE): they read their run's lines, not the launcher's bookkeeping (29 of 48 lines of a short run).
    The first line the terminal leaves out says where the rest is."""

    STAMP = re.compile(rb"^\[\d{4}-\d\d-\d\d [\d:,]+\] ")
    INFO = re.compile(rb"^\[\d{4}-\d\d-\d\d [\d:,]+\] \[INFO\] ")
    WARNING = re.compile(rb"Warning: |\[WARNING\]")
    NOISE = re.compile(
        rb"Unable to find hostfile, will proceed with training with local resources only"  # a --num-gpus launch
        rb"|Setting accelerator to CPU"  # DS_ACCELERATOR=cpu, or no GPU: refused before launch when one is unusable
        rb"|^DeepSpeed deepspeed\.ops\.\S+ built successfully"  # printed at every load of a cached op
        rb"|FutureWarning: `torch\.distributed\.\w+` is deprecated"  # DeepSpeed's calls, not the user's
        rb"|sigkill_handler\] .* exits with return code = 143$"  # a rank that saved and stopped on a signal
    )

    def __init__(self, run_dir: Path | None, header: str, name: str = "launch.log"):
        self.path = run_dir / "logs" / name if run_dir is not None else None
        self.pending: list[bytes] = [f"=== {time.strftime('%Y-%m-%d %H:%M:%S')} {header}\n".encode()]
        self.file: Any = None
        self.seen: set[bytes] = set()
        self.told = False
        self.continuation = False

    def follow(self, stream: Any) -> None:
        terminal = True
        for line in iter(stream.readline, b""):
            self.keep(line)
            if terminal and self.shown(line):
                try:
                    sys.stdout.buffer.write(line)
                    sys.stdout.flush()
                except OSError:  # the terminal went away (a hang-up, a closed pipe): launch.log still has it all
                    terminal = False

    def shown(self, line: bytes) -> bool:
        if self.continuation and line.startswith(b"  "):  # the source line a Python warning prints under it
            return False
        self.continuation = False
        bare = self.STAMP.sub(b"", line)
        noise = bool(self.NOISE.search(line))
        once = bool(self.WARNING.search(line)) or line.startswith(b"error: ")  # each rank says the same error
        repeated = once and bare in self.seen
        if once:
            self.seen.add(bare)
            self.continuation = repeated or noise
        if not (self.INFO.match(line) or repeated or noise):
            return True
        if not self.told and self.path is not None:
            self.told = True
            sys.stdout.buffer.write(f"(DeepSpeed's INFO lines and repeated warnings: {self.path})\n".encode())
        return False

    def keep(self, line: bytes) -> None:
        if self.path is None:
            return
        try:
            if self.file is None and self.path.parent.parent.is_dir():
                self.path.parent.mkdir(exist_ok=True)
                self.file = open(self.path, "ab")  # noqa: SIM115 - closed in close()
                self.file.writelines(self.pending)
                self.pending = []
            if self.file is None:
                self.pending.append(line)
            else:
                self.file.write(line)
                self.file.flush()
        except OSError as e:  # a full or read-only disk: the run's own checks say so; the log is not worth a crash
            _say(f"cannot write {self.path} ({e.strerror or e}): its lines from here on are only on the terminal")
            self.path, self.pending = None, []
            self.close()

    def close(self) -> None:
        if self.file is not None:
            with contextlib.suppress(OSError):
                self.file.close()
            self.file = None


def training_ranks(root: int, rank_args: list[str]) -> list[psutil.Process]:
    """This launch's training ranks on this host: the launcher's descendants whose command line holds
    `rank_args` (pipeline/pretrain.py and its arguments) and a --local_rank (which the launcher adds); over pdsh, a
    hostfile launch's ranks on this host are the ssh daemon's children instead, found the same way."""

    def is_rank(p: psutil.Process) -> bool:
        with contextlib.suppress(psutil.Error):
            cmd = p.cmdline()
            return all(a in cmd for a in rank_args) and any(a.startswith("--local_rank=") for a in cmd)
        return False

    def rank_not_worker(p: psutil.Process) -> bool:  # a rank's data-loader workers carry its command line
        with contextlib.suppress(psutil.Error):
            return is_rank(p) and not is_rank(p.parent())
        return False

    try:
        found = [p for p in psutil.Process(root).children(recursive=True) if rank_not_worker(p)]
    except psutil.Error:
        found = []
    if found:
        return found
    me = psutil.Process().username()
    return [p for p in psutil.process_iter() if rank_not_worker(p) and _same_user(p, me)]


def _same_user(p: psutil.Process, user: str) -> bool:
    with contextlib.suppress(psutil.Error):
        return bool(p.username() == user)
    return False
