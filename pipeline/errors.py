"""User-facing errors: the CLI prints them as one line and exits with code 2, without a traceback. And the exit
codes a stopped training uses."""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterator
from pathlib import Path


class PipelineError(Exception):
    """A problem the user can fix (bad input, bad config, missing file). The message says what and how."""


class ConfigError(PipelineError):
    """One or more invalid configuration fields; the message lists every problem at once."""

    def __init__(self, problems: list[str], source: str = "config", footer: str = ""):
        self.problems = list(problems)
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"{source} has {len(self.problems)} problem(s):\n{lines}" + (f"\n{footer}" if footer else ""))


class SaidOnRankZero(PipelineError):
    """The same user error on every rank, decided by rank 0 (pipeline.train.runtime.dist.on_rank0): rank 0 prints
    it, the other ranks exit with it silently, so the user reads it once."""


EXIT_STOPPED = 143
"""The exit code of a training stopped before its end by a signal (SIGTERM's 128 + 15), after its ranks saved a
checkpoint: never 0, so that `pipeline pretrain ... && pipeline export ...` does not export a half-trained run, and
never relaunched by --max-restarts. `pipeline pretrain` stopped by SIGINT (Ctrl-C) exits 130."""


def os_error_in(e: BaseException) -> OSError | None:
    """The system error inside a library's exception: an OSError it was raised from (its cause or context), or the
    `(os error N)` a Rust library (safetensors, tokenizers) writes into its message."""
    seen: set[int] = set()
    current: BaseException | None = e
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, OSError):
            return current
        if m := re.search(r"\(os error (\d+)\)", str(current)):
            code = int(m.group(1))
            return OSError(code, os.strerror(code))
        current = current.__cause__ or current.__context__
    return None


@contextlib.contextmanager
def writing_into(path: str | Path) -> Iterator[None]:
    """A system error a library raised while writing `path` without saying where (datatrove's workers,
    safetensors' Rust writer): raised again as an OSError that names `path`, for the one line the CLI prints."""
    try:
        yield
    except PipelineError:
        raise
    except Exception as e:
        found = os_error_in(e)
        if found is None or found.errno is None or found.filename:
            raise
        raise OSError(found.errno, found.strerror or os.strerror(found.errno), str(path)) from e
