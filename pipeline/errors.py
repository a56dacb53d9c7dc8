"""User-facing errors: the CLI prints them as one line and exits with code 2, without a traceback. And the exit
codes a stopped training uses."""

from __future__ import annotations


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
