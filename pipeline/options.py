"""The commands' options: generated from a stage's config dataclass (`config_options`, from what each field says
of itself in pipeline.fields), or, for the few that are no config's field, declared once here (`HOSTFILE`,
`WHERE`, `SETS`, ...) with the helpers `opt` and `group`; their parsing callbacks; and `user_errors`, which turns a
command's user errors into one line. pipeline/cli.py declares the commands."""

from __future__ import annotations

import contextlib
import errno
import functools
import os
import signal
import sys
import threading
import typing
from collections.abc import Callable, Iterator
from typing import Any

import click

from pipeline.atomic import interrupt, received
from pipeline.errors import PipelineError, os_error_in
from pipeline.fields import Argument, Default, FieldInfo, FilePath, Hidden, Parsed, Range, Size, Tokens, fields_of

Decorator = Callable[[Callable[..., Any]], Callable[..., Any]]


class Terminated(KeyboardInterrupt):
    """SIGTERM (`kill`, `docker stop`, a scheduler's time limit) raised where Ctrl-C raises KeyboardInterrupt, so
    that every command's cleanup (temporary files removed, worker pools stopped, locks released) runs for both."""


@contextlib.contextmanager
def terminate_as_interrupt() -> Iterator[None]:
    """While a command runs, SIGTERM raises Terminated and SIGINT KeyboardInterrupt in the process that runs it,
    each held back while a few steps that must not be split run (pipeline.atomic.uninterrupted: a lock and its
    temporary folder, an output's final renames). A worker forked meanwhile (pools, executors) inherits the
    handlers: there SIGTERM kills it as it asks, without a traceback of its own, and SIGINT is Python's own."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    owner = os.getpid()
    received(reset=True)  # this command's own signals, not an earlier one's in the same process (tests)

    def on_term(signum: int, frame: Any) -> None:
        if os.getpid() != owner:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)
            return
        interrupt(Terminated())

    def on_int(signum: int, frame: Any) -> None:
        if os.getpid() != owner:
            raise KeyboardInterrupt
        interrupt(KeyboardInterrupt())

    previous = signal.signal(signal.SIGTERM, on_term)
    # a job started with SIGINT ignored (a background job of a script) keeps it ignored
    ignored = signal.getsignal(signal.SIGINT) == signal.SIG_IGN
    previous_int = signal.getsignal(signal.SIGINT) if ignored else signal.signal(signal.SIGINT, on_int)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
        signal.signal(signal.SIGINT, previous_int)


def given_on_command_line(name: str) -> bool:
    """Whether the running command's option `name` was given, not left at its default."""
    source = click.get_current_context().get_parameter_source(name)
    return source is not None and source != click.core.ParameterSource.DEFAULT


def user_errors(fn: Callable[..., Any]) -> Callable[..., Any]:
    """User errors become one line on stderr and exit code 2; no traceback. SIGTERM and Ctrl-C stop a command
    alike: its cleanup runs, one line says so, exit 143 or 130."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            try:
                with terminate_as_interrupt():
                    return fn(*args, **kwargs)
            except (Exception, KeyboardInterrupt) as e:
                # a signal that a library turned into an error of its own (sentencepiece's import, a worker pool's
                # broken pipe) still ends the command as the signal does
                if (sig := received()) is not None and not isinstance(e, KeyboardInterrupt):
                    raise sig from None
                raise
        except PipelineError as e:
            click.echo(f"error: {e}", err=True)
            sys.exit(2)
        except Terminated:
            click.echo("terminated (SIGTERM); no partial outputs were left under final names", err=True)
            sys.exit(143)
        except KeyboardInterrupt:
            click.echo("interrupted; no partial outputs were left under final names", err=True)
            sys.exit(130)
        except (click.exceptions.Exit, click.ClickException, SystemExit):
            raise
        except OSError as e:
            if (line := os_error_line(e)) is None:
                raise
            click.echo(f"error: {line}", err=True)
            sys.exit(2)
        except Exception as e:
            # a library's own error around the system's (safetensors' Rust writer, torch's zip writer): said as the
            # system's when it is one the user fixes (a full or read-only disk)
            if (wrapped := os_error_in(e)) is not None and (line := os_error_line(wrapped)) is not None:
                click.echo(f"error: {line}", err=True)
                sys.exit(2)
            import traceback

            traceback.print_exc()
            click.echo(
                "error: an internal error, not a mistake in your input: this is a bug in pipeline; please "
                "report it with the traceback above",
                err=True,
            )
            sys.exit(1)

    return wrapper


OS_SAYS_NO = {
    errno.ENOSPC: "the disk is full: free space there, or write elsewhere",
    errno.EDQUOT: "your disk quota is used up: free space, or write elsewhere",
    errno.EROFS: "that file system is read-only: write elsewhere",
    errno.EACCES: "no permission there: write elsewhere, or fix the folder's owner or mode",
    errno.EPERM: "not permitted there: write elsewhere, or fix the folder's owner or mode",
    errno.EFBIG: "the file is larger than that file system allows: write elsewhere",
    errno.EIO: "the disk or mount failed: check it (dmesg, mount) and run the same command again",
    errno.ESTALE: "the network mount went stale: remount it and run the same command again",
    errno.ENOTCONN: "the mount is disconnected: remount it and run the same command again",
    errno.ENODEV: "the device is gone: check the mount and run the same command again",
}
"""The operating system refusing on the user's side, what to do about each. Every stage writes under temporary
names and renames when done, so nothing half-written is left looking complete; the command can be run again."""


def os_error_line(e: OSError) -> str | None:
    """One line for an OSError the user's system raised (a full or read-only disk, a permission, a vanished mount),
    naming the path; None for one that is not the user's to fix."""
    if e.errno not in OS_SAYS_NO:
        return None
    where = e.filename or "a file this command writes"
    return (
        f"{where}: {e.strerror or os.strerror(e.errno or 0)} ({errno.errorcode.get(e.errno or 0, e.errno)}): "
        f"{OS_SAYS_NO[e.errno]}. Nothing half-written was left under a final name"
    )


def size(ctx: click.Context, param: click.Parameter, value: str) -> int:
    """A size option (512MB, 2GB, 1.5GiB) as a positive number of bytes."""
    from pipeline.units import parse_size

    try:
        size = int(parse_size(value))
    except ValueError as e:
        raise click.BadParameter(str(e)) from None
    if size < 1:
        raise click.BadParameter(f"{value}: expected a positive size such as 2GB")
    return size


def ratios(ctx: click.Context, param: click.Parameter, value: str) -> tuple[float, ...]:
    try:
        ratios = tuple(float(x.strip().rstrip("%")) for x in value.split(","))  # 90%,5%,5% reads as 90,5,5
    except ValueError:
        ratios = ()
    if len(ratios) != 3:
        raise click.BadParameter(f"{value}: expected three ratios train,val,test such as 98,1,1")
    return ratios


class UserPath(click.ParamType):
    """A file or folder the user typed: a leading ~ is their home even where no shell expanded it (quoted, or
    from a script); relative paths stay relative to where they stand."""

    name = "path"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        return os.path.expanduser(value) if isinstance(value, str) else value


PATH = UserPath()


def output_prefix(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """An output prefix (PREFIX.bin, PREFIX.idx, ...) that names a file stem, not a folder: `data/` or an existing
    folder would write `data.bin` beside it, not in it."""
    if value is None:
        return None
    if value.endswith(("/", os.sep)) or os.path.isdir(value):
        stem = os.path.join(value.rstrip("/" + os.sep) or ".", "corpus")
        raise click.BadParameter(f"{value} names a folder; give a file prefix inside it, e.g. {stem}")
    return value


class SequenceLength(click.ParamType):
    """A --seq-len: tokens, as 4096 or with a suffix in powers of two (32k, 128K), within [low, high]."""

    name = "tokens"

    def __init__(self, low: int = 1, high: int = 2**24) -> None:
        self.low, self.high = low, high

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int:
        from pipeline.units import parse_length

        if isinstance(value, int):
            n = value
        else:
            try:
                n = parse_length(str(value).strip())
            except ValueError:
                self.fail(f"{value!r} is not a length in tokens: give e.g. 4096, 32k or 128K", param, ctx)
        if not self.low <= n <= self.high:
            self.fail(f"{value} ({n:,} tokens) is not in {self.low:,} to {self.high:,}", param, ctx)
        return n


def length_mix(ctx: click.Context, param: click.Parameter, value: str | None) -> tuple[tuple[int, float], ...]:
    """`pipeline shard --length-mix 8k:2,32k:4` as ((8192, 2.0), (32768, 4.0))."""
    from pipeline.units import parse_length_mix

    try:
        return parse_length_mix(value)
    except ValueError as e:
        raise click.BadParameter(str(e)) from None


def group(*decorators: Decorator) -> Decorator:
    """Several options as one decorator, in the order given."""

    def apply(fn: Callable[..., Any]) -> Callable[..., Any]:
        for d in reversed(decorators):
            fn = d(fn)
        return fn

    return apply


def opt(*decls: str, default: Any = None, help: str | None = None, **kw: Any) -> Decorator:
    """An option that shows its default in --help when it has one."""
    return click.option(*decls, default=default, show_default=default not in (None, False), help=help, **kw)


def config_option(required: bool, help: str) -> Decorator:
    return click.option("--config", required=required, default=None, type=PATH, help=help)


HOSTFILE = click.option(
    "--hostfile",
    default=None,
    type=PATH,
    help="DeepSpeed hostfile (see hostfiles/): the hosts, reached by ssh, and their slots.",
)
MASTER_PORT = click.option(
    "--master-port", type=click.IntRange(1, 65535), default=None, help="Rendezvous port (default: 29500)."
)
WHERE = group(
    HOSTFILE,
    click.option(
        "--num-gpus",
        type=click.IntRange(min=1),
        default=None,
        help="Ranks on this machine when no hostfile is given (CPU runs: processes).",
    ),
    MASTER_PORT,
)
SCHEDULER = group(
    click.option(
        "--from-env",
        is_flag=True,
        help="Started by a scheduler on every node alike: the nodes, this node's rank and the rendezvous from the "
        "environment (Slurm's SLURM_* under srun; else NNODES, NODE_RANK or JOB_COMPLETION_INDEX, MASTER_ADDR, "
        "MASTER_PORT as torchrun, a JobSet or SkyPilot give them); --num-gpus: ranks per node. No ssh or pdsh.",
    ),
    click.option(
        "--sbatch",
        type=PATH,
        default=None,
        help="Write a Slurm batch script for this config to FILE (one `--from-env` task per node) instead of "
        "launching; with --nodes, --num-gpus (per node), --time, --partition, --requeue, --min-nodes.",
    ),
    click.option(
        "--nodes",
        type=click.IntRange(min=1),
        default=None,
        help="With --sbatch: nodes to ask for. With --from-env: the nodes the job must have (refused otherwise).",
    ),
    click.option("--time", "time_limit", default=None, help="With --sbatch: the job's time limit (e.g. 2-00:00:00)."),
    click.option("--partition", default=None, help="With --sbatch: the Slurm partition."),
    click.option(
        "--requeue",
        is_flag=True,
        help="With --sbatch: near the time limit the run saves, stops and the job is put back in the queue; it "
        "resumes from that checkpoint (and Slurm requeues it when a node fails).",
    ),
)
SETS = click.option("--set", "sets", multiple=True, help="Override a config field: section.key=value (repeatable).")
AS_JSON = click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")


PARSERS: dict[str, Callable[[click.Context, click.Parameter, Any], Any]] = {
    "ratios": ratios,
    "length_mix": length_mix,
    "output_prefix": output_prefix,
}
"""The `fields.Parsed` parsers by name: text on the command line, a typed value in the config."""


def _option_type(info: FieldInfo) -> dict[str, Any]:
    """click's type, callback and default display for one field, from its type and markers."""
    kind: dict[str, Any] = {}
    if (parsed := info.marker(Parsed)) is not None:
        kind.update(callback=PARSERS[parsed.name], default=parsed.shown, show_default=parsed.shown is not None)
    if (unit := info.marker(Size)) is not None:
        return {"callback": size, "default": unit.shown, "show_default": True}
    if info.marker(FilePath):
        kind["type"] = PATH
    elif (length := info.marker(Tokens)) is not None:
        kind["type"] = SequenceLength(int(length.low or 1), int(length.high or 2**24))
    elif (choices := info.choices) is not None:
        kind["type"] = click.Choice(choices)
    elif "callback" not in kind:
        # a range is checked by the config itself (pipeline.fields.field_problems), every problem in one error
        kind["type"] = next((t for t in (info.base, *typing.get_args(info.base)) if t in (int, float, str)), str)
    return kind


def config_options(cls: type, *, skip: tuple[str, ...] = (), optional: tuple[str, ...] = ()) -> Decorator:
    """The command-line options (and positional arguments) of a config dataclass's fields, in their order: each
    field's type, choices, range, default and docstring become its option's type, choices, range, default and help
    (pipeline.fields). `skip`: fields the command declares itself; `optional`: required fields a command may leave
    out (shard's --output under --inspect)."""
    decorators = []
    for info in fields_of(cls):
        if info.name in skip or info.marker(Hidden):
            continue
        kind = _option_type(info)
        if info.marker(Argument):
            decorators.append(click.argument(info.name, nargs=-1 if _is_tuple(info) else 1, required=True, **kind))
            continue
        default = None if info.required or info.factory else info.default
        settings: dict[str, Any] = {"default": default, "show_default": default not in (None, False, ())}
        settings.update(kind)
        if (shown := info.marker(Default)) is not None:
            settings["show_default"] = shown.shown
        decls: tuple[str, ...] = (info.flag,)
        if info.base is bool:
            decls = (f"{info.flag}/--no-{info.flag[2:]}",) if default else (info.flag,)
            settings = {"default": bool(default), "show_default": bool(default)} | (
                {} if default else {"is_flag": True}
            )
        elif _is_tuple(info) and "callback" not in settings:
            settings.update(multiple=True, default=None, show_default=False)
        if info.flag[2:].replace("-", "_") != info.name:
            decls = (*decls, info.name)
        required = info.required and info.name not in optional
        span = info.marker(Range)
        plain = not (info.marker(Tokens) or info.marker(Size))  # a size or a length says its own unit
        help = info.help + (f" [{span.says()}]" if span is not None and plain else "")
        decorators.append(click.option(*decls, required=required, help=help or None, **settings))
    return group(*decorators)


def _is_tuple(info: FieldInfo) -> bool:
    return typing.get_origin(info.base) is tuple and typing.get_args(info.base)[-1:] == (Ellipsis,)


def config_from(cls: type, options: dict[str, Any]) -> Any:
    """The config of a command's parsed options: an option left out (None, or an empty repeatable) takes the field's
    own default; a repeatable option's values become the field's tuple."""
    given = {}
    for info in fields_of(cls):
        if info.name not in options:
            continue
        value = options[info.name]
        if value is None or (value == () and not info.required):
            continue
        given[info.name] = tuple(value) if isinstance(value, list) else value
    return cls(**given)
