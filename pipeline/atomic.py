"""Atomic writes: a file or a whole folder is written under a temporary name beside its target and renamed into
place when complete, so a reader (or a rerun after a crash) sees the old one or the new one, never half of one."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any


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
def replacing_dir(target: Path) -> Iterator[Path]:
    """A temporary folder `.NAME.tmp` beside `target` for the caller to fill; when the block ends without an error
    it replaces `target` whole, else it is removed. One left by a killed process is cleared at the next start."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    work = target.parent / f".{target.name}.tmp"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir()
    try:
        yield work
        if target.exists():
            shutil.rmtree(target)
        os.replace(work, target)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def file_in_the_way(path: Path) -> Path | None:
    """A file that stands where `path` or one of its folders would have to be (the nearest that exists), or None."""
    for folder in (Path(path), *Path(path).parents):
        if folder.exists():
            return None if folder.is_dir() else folder
    return None
