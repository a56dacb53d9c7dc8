"""Atomic writes: a file or a whole folder is written under a temporary name beside its target and renamed into
place when complete, so a reader (or a rerun after a crash) sees the old one or the new one, never half of one.
And one live writer per output (`OneWriter`): two would each rename their own result into place, and one would be
silently gone."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import shutil
import socket
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

_critical = 0
_deferred: BaseException | None = None


@contextlib.contextmanager
def uninterrupted() -> Iterator[None]:
    """A few steps that must happen together or not at all (a lock and the temporary folder it guards; the rename
    of a finished output over an earlier one): a Ctrl-C or SIGTERM that arrives meanwhile (through `interrupt`, which
    the commands' signal handlers call) is raised when they are done, where the caller's cleanup covers them."""
    global _critical, _deferred
    _critical += 1
    try:
        yield
    finally:
        _critical -= 1
        if not _critical and _deferred is not None:
            exc, _deferred = _deferred, None
            raise exc


_received: BaseException | None = None


def interrupt(exc: BaseException) -> None:
    """Raise `exc` (KeyboardInterrupt, or the SIGTERM's) now, or, inside `uninterrupted` steps, when they end."""
    global _deferred, _received
    _received = _received or exc
    if not _critical:
        raise exc
    if _deferred is None:
        _deferred = exc


def received(reset: bool = False) -> BaseException | None:
    """The first interrupt this process received (through `interrupt`) since the last `reset`, if any: an error
    raised after it is its consequence (a library that turned it into an ImportError of its own), and the command
    ends as interrupted. A command resets it as it starts."""
    global _received
    first = _received
    if reset:
        _received = None
    return first


def umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def tmp_path_for(path: Path) -> Path:
    """A unique temporary name beside `path` (same filesystem, so rename is atomic), with the permissions a plain
    `open` gives (0666 less the umask: readable by the group on a shared mount), not mkstemp's owner-only 0600."""
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.fchmod(fd, 0o666 & ~umask())
    os.close(fd)
    return Path(name)


def make_temp_dir(parent: Path, prefix: str) -> Path:
    """tempfile.mkdtemp with a plain mkdir's permissions (0777 less the umask), not owner-only 0700."""
    work = Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
    work.chmod(0o777 & ~umask())
    return work


def write_json(path: str | Path, obj: Any) -> None:
    path = Path(path)
    tmp = tmp_path_for(path)
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(obj, f, indent=2, sort_keys=False)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


SEAL = "sealed_sha256"
"""The field of a manifest or marker that holds the sha256 of all its other fields, as written: what a stage reads
back is what it wrote, every field of it (a field edited by hand, a file half replaced by a copy)."""


def _canonical(obj: dict[str, Any]) -> bytes:
    return json.dumps({k: v for k, v in obj.items() if k != SEAL}, sort_keys=True, separators=(",", ":")).encode()


def sealed(obj: dict[str, Any]) -> dict[str, Any]:
    """`obj` with its seal (`SEAL`), to write with write_json."""
    return {**{k: v for k, v in obj.items() if k != SEAL}, SEAL: hashlib.sha256(_canonical(obj)).hexdigest()}


def seal_broken(obj: Any) -> bool:
    """Whether a manifest or marker read back differs from what was written. Files written before seals (no
    `SEAL` field) are taken as they are."""
    if not isinstance(obj, dict) or SEAL not in obj:
        return False
    return bool(obj[SEAL] != hashlib.sha256(_canonical(obj)).hexdigest())


TEXT_SEAL = re.compile(r"^# sealed_sha256 ([0-9a-f]{64})\b")


def sealed_text(text: str) -> str:
    """A text file's seal as its first line (a YAML comment): the sha256 of the rest, as written."""
    digest = hashlib.sha256(text.encode()).hexdigest()
    return f"# sealed_sha256 {digest}: as the run wrote it; launch with your own config, not an edited copy\n{text}"


def text_seal_broken(text: str) -> bool:
    """Whether a sealed text read back differs from what was written (texts without a seal are taken as they are)."""
    first, _, rest = text.partition("\n")
    m = TEXT_SEAL.match(first)
    return bool(m and m.group(1) != hashlib.sha256(rest.encode()).hexdigest())


def write_text(path: str | Path, text: str) -> None:
    path = Path(path)
    tmp = tmp_path_for(path)
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def sha256_file(path: str | Path, chunk: int = 1 << 22) -> str:

    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


@contextlib.contextmanager
def writing_to(where: Path) -> Iterator[None]:
    """Name `where` in an OSError that a write under it raised without a file name (a file object's write or
    flush on a full disk): the user's error line can then say which disk."""
    try:
        yield
    except OSError as e:
        if e.filename is None and e.errno is not None:
            raise OSError(e.errno, e.strerror, str(where)) from e
        raise


@contextlib.contextmanager
def replacing_dir(target: Path, writer: str = "another `pipeline` command") -> Iterator[Path]:
    """A temporary folder `.NAME.tmp` beside `target` for the caller to fill; when the block ends without an error
    it replaces `target` whole, else it is removed. One left by a killed process is cleared at the next start.
    The output is held by one live writer for the block (OneWriter on `.NAME.lock`): a second is refused naming
    the holder (`writer`: what it is, for the message), instead of clearing the first's temporary folder."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)

    def busy(who: dict[str, Any] | None) -> str:
        return (
            f"{target}: {writer} is writing it{held_by(who)}; two at once would leave only one's output. Wait for "
            "it to end, or write elsewhere"
        )

    lock = OneWriter(target.parent / f".{target.name}.lock", busy, remove=True)
    work = target.parent / f".{target.name}.tmp"
    earlier = target.parent / f".{target.name}.old"
    taken = False
    try:
        with uninterrupted():  # the lock and the temporary folder: both or neither
            lock.acquire()  # a read-only or full disk: the OSError, which the command says in one line with the path
            taken = True
            shutil.rmtree(work, ignore_errors=True)
            shutil.rmtree(earlier, ignore_errors=True)  # a killed writer's, between its two renames below
            work.mkdir()
        yield work
        plain_modes(work)
        with uninterrupted():  # the earlier output is replaced whole, or kept
            if target.exists():
                os.replace(target, earlier)
            os.replace(work, target)
            shutil.rmtree(earlier, ignore_errors=True)
    finally:
        if taken:
            if earlier.exists() and not target.exists():
                os.replace(earlier, target)  # a disk error between the renames: the earlier output back
            shutil.rmtree(work, ignore_errors=True)
            lock.release()


def plain_modes(folder: Path) -> None:
    """Every file and folder under `folder` with the permissions a plain `open` and `mkdir` give (0666 and 0777
    less the umask): libraries that write owner-only files (safetensors' writer: 0600) would otherwise leave an
    output the group on a shared mount cannot read."""
    mask = umask()
    for root, dirs, files in os.walk(folder):
        for d in dirs:
            os.chmod(os.path.join(root, d), 0o777 & ~mask)
        for f in files:
            os.chmod(os.path.join(root, f), 0o666 & ~mask)


def file_in_the_way(path: Path) -> Path | None:
    """A file that stands where `path` or one of its folders would have to be (the nearest that exists), or None."""
    for folder in (Path(path), *Path(path).parents):
        if folder.exists():
            return None if folder.is_dir() else folder
    return None


class OneWriter:
    """An exclusive `flock` on the file `path` for one live writer of an output, taken with `acquire()` (or `with`)
    and held until `release()` or the process's end. The kernel drops it when the process ends, however it ends
    (SIGKILL, an OOM kill), so a killed writer never leaves a stale lock; the file stays and says who held it last.
    `busy(holder)`: the error text when another process holds it (holder: its host, pid and start, if known).
    `remove`: delete the file on release (a stage's output folder keeps nothing of the lock); a process that opened
    it just before then finds its file gone after locking it, and tries again on the new one."""

    def __init__(self, path: Path, busy: Callable[[dict[str, Any] | None], str], remove: bool = False):
        self.path, self.busy, self.remove = Path(path), busy, remove
        self._file: IO[str] | None = None

    def acquire(self) -> None:
        """Take the lock (its folder must exist) or raise PipelineError naming who holds it."""
        with uninterrupted():  # an interrupt waits until the lock is held and says so, or is not held
            self._acquire()

    def _acquire(self) -> None:
        from pipeline.errors import PipelineError

        while True:
            f = open(self.path, "a+")  # noqa: SIM115 - held open while writing: the open file is the lock
            try:
                fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                f.close()
                raise PipelineError(self.busy(read_holder(self.path))) from None
            try:
                if os.stat(self.path).st_ino == os.fstat(f.fileno()).st_ino:
                    break
            except FileNotFoundError:
                pass
            f.close()  # locked a file its holder removed on release: lock the one at the path now
        f.seek(0)
        f.truncate()
        holder = {"host": socket.gethostname(), "pid": os.getpid(), "since": time.strftime("%Y-%m-%d %H:%M:%S")}
        f.write(json.dumps(holder) + "\n")
        f.flush()
        self._file = f

    def release(self) -> None:
        if self._file is not None:
            if self.remove:
                with contextlib.suppress(OSError):
                    self.path.unlink()
            with contextlib.suppress(OSError):
                fcntl.flock(self._file.fileno(), fcntl.LOCK_UN)
            self._file.close()
            self._file = None

    def __enter__(self) -> OneWriter:
        try:
            self.acquire()
        except BaseException:  # an interrupt deferred to the lock's end: `with` will not call __exit__
            self.release()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def read_holder(path: Path) -> dict[str, Any] | None:
    """Who last held the lock file `path` (host, pid, since), if it says."""
    try:
        value = json.loads(path.read_text() or "null")
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def held_by(who: dict[str, Any] | None) -> str:
    """' (pid P on HOST, since T)' for an error text, or nothing when unknown."""
    return f" (pid {who.get('pid')} on {who.get('host')}, since {who.get('since')})" if who else ""
