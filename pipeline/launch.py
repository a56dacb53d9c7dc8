"""Building and supervising the `deepspeed` command lines that `pipeline pretrain` and `pipeline evaluate --num-gpus
| --hostfile` start: every check that can run before a process starts has run first (pipeline.train.preflight: a
bad input fails in a second, with one message listing every problem), then the launcher runs in a process tree
this module supervises (signals forwarded to the ranks, the log kept), again after a failure a relaunch can fix
(`--max-restarts`)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click
import psutil

from pipeline.errors import EXIT_STOPPED, PipelineError
from pipeline.plan.hostfile import hostfile_hosts
from pipeline.train.ops import use_project_cache

if TYPE_CHECKING:  # the heavy modules are imported where they are used: `pipeline --help` stays fast
    from pipeline.evaluate.run import EvalConfig
    from pipeline.train.config import PretrainConfig

PACKAGE = Path(__file__).resolve().parent


@dataclass(frozen=True, kw_only=True, slots=True)
class Where:
    """Where the ranks run: the hosts of a hostfile, or N ranks on this machine (None: what the launcher sees)."""

    hostfile: str | None = None
    num_gpus: int | None = None
    master_port: int | None = None

    def __post_init__(self) -> None:
        if self.hostfile and not Path(self.hostfile).is_file():
            raise PipelineError(f"--hostfile {self.hostfile}: no such file (see hostfiles/)")

    def world_size(self) -> tuple[int, int]:
        """(ranks, ranks per node) the launcher will start: from the hostfile's slots, or --num-gpus (after
        `resolved`, always given for one machine)."""
        if self.hostfile:
            from pipeline.plan.hostfile import hostfile_slots

            slots = hostfile_slots(self.hostfile)
            return sum(slots), max(slots)
        n = self.num_gpus or 1
        return n, n

    def resolved(self) -> Where:
        """With --num-gpus made explicit on one machine: every GPU this process sees, or one CPU rank. DeepSpeed's
        own default (all GPUs; on a CPU, one rank per NUMA node) would be decided after the checks ran."""
        if self.hostfile or self.num_gpus:
            return self
        from pipeline.train.dist import accelerator_name, visible_gpus

        n = visible_gpus() if accelerator_name() == "cuda" else 1
        if accelerator_name() != "cuda":
            click.echo("no --num-gpus: 1 CPU rank (give --num-gpus N for more)", err=True)
        return replace(self, num_gpus=max(1, n))

    def check_local_gpus(self) -> None:
        """Refuse more local ranks than GPUs (on a GPU machine; CPU ranks are processes, any number)."""
        from pipeline.train.dist import accelerator_name, local_ranks_problem, visible_gpus

        if not self.hostfile and (problem := local_ranks_problem(self.num_gpus, accelerator_name(), visible_gpus())):
            raise PipelineError(problem)

    def launcher(self, bind_args: list[str] | None = None) -> list[str]:
        """`deepspeed [--hostfile H | --num_gpus N] [--master_port P] [--bind_cores_to_rank ...]`, the launcher of
        this environment."""
        found = shutil.which("deepspeed", path=str(Path(sys.executable).parent)) or shutil.which("deepspeed")
        if found is None:
            raise PipelineError("the `deepspeed` launcher is not installed in this environment (pip install deepspeed)")
        cmd = [found]
        if self.hostfile:
            cmd += ["--hostfile", self.hostfile]
        elif self.num_gpus:
            cmd += ["--num_gpus", str(self.num_gpus)]
        if self.master_port:
            cmd += ["--master_port", str(self.master_port)]
        return cmd + list(bind_args or [])


def core_binding_args(ds: dict[str, Any], local_ranks: int) -> list[str]:
    """The launcher's arguments that bind each rank to its share of the node's CPUs (DeepSpeed's
    --bind_cores_to_rank, which also sets OMP_NUM_THREADS): with the optimizer offloaded to the CPU (CPU Adam runs
    on those cores, 1.3x faster bound, DeepSpeed PR #7474), when numactl is installed (DeepSpeed needs it to bind;
    without it each rank sets its thread count itself), no OMP_NUM_THREADS or KMP_AFFINITY says otherwise, and the
    binding leaves no CPU idle (pipeline.train.dist.core_binding; this node's counts stand for every node's)."""
    from pipeline.plan.cluster import offload_devices
    from pipeline.train.dist import core_binding, cpu_counts

    if offload_devices(ds).optimizer == "none" or shutil.which("numactl") is None:
        return []
    if any(k in os.environ for k in ("OMP_NUM_THREADS", "KMP_AFFINITY")):
        return []
    args, _, why = core_binding(*cpu_counts(), local_ranks)
    click.echo(f"CPU Adam's cores: {why}", err=True)
    return args


def pretrain(
    config_path: str, sets: list[str], where: Where, *, dry_run: bool, max_restarts: int, skip_doctor: bool
) -> int:
    """`pipeline pretrain`: the checks every rank will make, made here first; the quick local checks of `pipeline
    doctor`; then `deepspeed ... pipeline/pretrain.py`, printed and run (again, with `max_restarts`). Returns its
    exit code."""
    from pipeline.train.config import load
    from pipeline.train.main import describe
    from pipeline.train.preflight import before_launch
    from pipeline.train.prepare import prepare

    cfg = load(config_path, sets)
    where.check_local_gpus()
    where = where.resolved()
    world, per_node = where.world_size()
    prepared = prepare(cfg, world, per_node)  # the same checks every rank makes, before any process starts
    # The rendezvous port matters to a launch, not to a dry run (which starts nothing and may run beside a live one).
    failed = quick_doctor(cfg, None if where.hostfile or dry_run else where.master_port or 29500)
    # One error for every problem: the run folder free, shards whole, the checkpoint it continues, disk, the doctor.
    for note in before_launch(prepared, world, per_node, more=[] if skip_doctor else failed):
        click.echo(note, err=True)
    if dry_run:
        click.echo(describe(prepared))
        return 0
    build_ops_ahead(prepared.ds, world, per_node)
    cmd = [*where.launcher(core_binding_args(prepared.ds, per_node)), str(PACKAGE / "pretrain.py")]
    cmd += ["--config", config_path]
    for s in sets:
        cmd += ["--set", s]
    use_project_cache()  # the ranks of this machine inherit it
    click.echo("+ " + " ".join(cmd), err=True)
    hosts = [h for h, _ in hostfile_hosts(where.hostfile)] if where.hostfile else None
    return run_with_restarts(cmd, max_restarts, Path(cfg.run_dir), hosts)


def build_ops_ahead(ds: dict[str, Any], world: int, per_node: int) -> None:
    """The DeepSpeed ops this run loads and this environment has not built yet, built here before the launch
    (in parallel, with their times), instead of silently by every rank for a minute or more."""
    from pipeline.train.dist import accelerator_name
    from pipeline.train.ops import build, is_built, needed

    todo = [n for n in needed(ds, accelerator_name(), per_node if world > 1 else 1) if not is_built(n)]
    if not todo:
        return
    click.echo(
        f"building DeepSpeed's {', '.join(todo)} op(s) for this environment (once; about a minute each, in "
        f"parallel; kept in {use_project_cache()})",
        err=True,
    )
    for name, seconds, error in build(todo, jobs=len(todo)):
        if error is None:
            click.echo(f"  built {name} in {seconds:.0f} s", err=True)
        else:
            click.echo(f"  {name} not built here ({error}); the ranks will try, and say why if it fails", err=True)


def quick_doctor(cfg: PretrainConfig, master_port: int | None) -> list[str]:
    """`pipeline doctor`'s checks that need no import of torch or deepspeed, on this machine: WARN and FAIL lines
    printed, each FAIL returned as a problem that stops the launch unless --skip-doctor."""
    from pipeline.doctor.checks import FAIL, WARN, Needs, run_checks
    from pipeline.train.dist import accelerator_name

    needs = Needs(
        run_dir=cfg.run_dir, data_path=cfg.data.path, master_port=master_port, pins_memory=accelerator_name() == "cuda"
    )
    failed = []
    for c in run_checks(needs, quick=True).checks:
        if c.status in (WARN, FAIL):
            click.echo(f"doctor: {c.status} {c.name}: {c.detail}" + (f" ({c.fix})" if c.fix else ""), err=True)
        if c.status == FAIL:
            failed.append(
                f"the local check '{c.name}' failed ({c.detail}); fix it, or launch anyway with --skip-doctor"
            )
    return failed


NOT_RELAUNCHED = (0, 2, 130, EXIT_STOPPED)
"""0 done; 2 a mistake in the input or a run stopped on purpose (non-finite loss, full disk): a relaunch would fail
the same way; 130 and 143 stopped by a signal."""


def unreachable_hosts(hosts: list[str], timeout: float = 15.0) -> list[tuple[str, str]]:
    """(host, why) for each host that does not answer ssh as DeepSpeed's launcher reaches it, asked in parallel."""
    from pipeline.doctor.cluster import ask_every, last_line

    return [(h, last_line(a)) for h, a in ask_every(hosts, "true", timeout).items() if a.returncode != 0]


def run_with_restarts(
    cmd: list[str], max_restarts: int, run_dir: Path | None = None, hosts: list[str] | None = None
) -> int:
    """Run the launcher; after a failure that a relaunch can fix, run it again (the run resumes from its latest
    complete checkpoint), up to `max_restarts` times. Before a relaunch every host of `hosts` (the hostfile's) is
    reached: DeepSpeed probes only the first, and a relaunch with a lost node waits in its first collective for
    the whole timeout, every try; with one gone the run stops, naming it. A SIGTERM or SIGINT to this process stops
    the run as one: every rank saves at the end of its step and exits (`Supervised`); the exit code is then 143 or
    130."""
    restarts = 0
    while True:
        started = time.monotonic()
        launch = Supervised(cmd, run_dir)
        code = launch.wait()
        if launch.stopped_by is not None:  # done (0), a mistake (2), or stopped by this signal
            return code if code in (0, 2) else 128 + launch.stopped_by
        if code in NOT_RELAUNCHED or restarts >= max_restarts:
            if code not in NOT_RELAUNCHED and max_restarts:
                click.echo(f"launch failed with exit code {code}; no restarts left ({max_restarts} used)", err=True)
            return code
        if hosts and (lost := unreachable_hosts(hosts)):
            click.echo(
                f"launch failed with exit code {code}, and {len(lost)} host(s) of the hostfile do not answer ssh: "
                + "; ".join(f"{h} ({why})" for h, why in lost)
                + ". Not relaunching: each try would wait its first collective's whole timeout for them. Bring "
                "them back and run the same command, or remove them from the hostfile (the run resumes on the "
                "smaller world through DeepSpeed's universal checkpoint)",
                err=True,
            )
            return code
        restarts += 1
        click.echo(
            f"launch failed with exit code {code} after {time.monotonic() - started:.0f} s; restart "
            f"{restarts} of {max_restarts}, from the latest complete checkpoint",
            err=True,
        )


class Supervised:
    """The `deepspeed` launcher in a session of its own, so that a terminal's Ctrl-C, `kill`, `docker stop` or
    Slurm reach this process first; it forwards the stop to the training ranks only. DeepSpeed's launcher, if it
    got the signal itself, would terminate its ranks and SIGKILL them 30 s later, in the middle of saving a large
    checkpoint; the ranks instead finish their step, agree to stop, save, and exit with EXIT_STOPPED. One rank hearing
    it is enough: they agree on stopping every step. A second signal ends the whole launch now."""

    def __init__(self, cmd: list[str], run_dir: Path | None = None):
        self.stopped_by: int | None = None
        script = str(PACKAGE / "pretrain.py")
        self.rank_args = cmd[cmd.index(script) :] if script in cmd else [script]
        from pipeline.train.guards import SUPERVISOR_ENV

        self.console = Console(run_dir, " ".join(cmd))
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


def node_launcher_command(script: Path, *args: str, num_gpus: int, port: int) -> list[str]:
    """DeepSpeed's launcher for this one node (`python -m deepspeed.launcher.launch`), which starts the ranks,
    watches them and stops them all when one fails: exactly what `deepspeed --num_gpus N` builds and runs for a
    single node, without the front end's own Python start (3 s). The tests and the GPU bench launch through it."""
    import base64

    world = base64.urlsafe_b64encode(json.dumps({"localhost": list(range(num_gpus))}).encode()).decode()
    launcher = [sys.executable, "-u", "-m", "deepspeed.launcher.launch", f"--world_info={world}"]
    return [*launcher, "--master_addr=127.0.0.1", f"--master_port={port}", str(script), *args]


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

    def __init__(self, run_dir: Path | None, header: str):
        self.path = run_dir / "logs" / "launch.log" if run_dir is not None else None
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


def evaluate(cfg: EvalConfig, where: Where) -> dict[str, Any]:
    """`pipeline evaluate --num-gpus N | --hostfile H`: the inputs checked here, then one rank per GPU under the
    launcher (ZeRO-3, pipeline.evaluate.distributed); rank 0 writes the results file, read back here."""
    from pipeline.evaluate import run as stage

    where.check_local_gpus()
    inputs = stage.open_inputs(cfg)  # bad input fails here, in a second, before any rank starts
    target = stage.result_path(cfg, inputs.run)
    before = target.stat().st_mtime_ns if target.exists() else None
    args = ["--checkpoint", cfg.checkpoint, "--split", cfg.split, "--batch-size", str(cfg.batch_size)]
    args += ["--max-new-tokens", str(cfg.max_new_tokens), "--seed", str(cfg.seed), "--output", str(target)]
    for flag, value in (("--data", cfg.data), ("--max-batches", cfg.max_batches), ("--prompts", cfg.prompts)):
        if value is not None:
            args += [flag, str(value)]
    cmd = [*where.launcher(), "--no_local_rank", "--module", "pipeline.cli", "evaluate", *args, "--launched"]
    use_project_cache()
    click.echo("+ " + " ".join(cmd), err=True)
    code = subprocess.call(cmd, env=os.environ.copy())
    if code != 0 or not target.exists() or target.stat().st_mtime_ns == before:
        raise PipelineError(f"the distributed evaluation failed (exit code {code}); see the ranks' output above")
    return {**json.loads(target.read_text()), "output": str(target)}
