"""User-facing errors: the CLI prints them as one line and exits with code 2, without a traceback."""

from __future__ import annotations


class PipelineError(Exception):
    """A problem the user can fix (bad input, bad config, missing file). The message says what and how."""


class ConfigError(PipelineError):
    """One or more invalid configuration fields; the message lists every problem at once."""

    def __init__(self, problems: list[str], source: str = "config"):
        self.problems = list(problems)
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"{source} has {len(self.problems)} problem(s):\n{lines}")
