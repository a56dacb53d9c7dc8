"""Progress display: a tqdm bar with rates and ETA on a terminal; silent when output is not a terminal (CI logs)."""

from __future__ import annotations

import sys
import time
from typing import Any


class Progress:
    """Tracks bytes (for the bar and ETA) plus named counters shown as rates, e.g. docs/s and tok/s."""

    def __init__(self, total_bytes: int | None, desc: str, enabled: bool | None = None, unit: str = "B"):
        """`unit`: what the total counts ("B", bytes, by default; "tok" for tokens, shown in thousands)."""
        self.enabled = sys.stderr.isatty() if enabled is None else enabled
        self.start = time.perf_counter()
        self.counts: dict[str, int] = {}
        self._bar: Any = None
        self._last = 0.0
        if self.enabled:
            from tqdm import tqdm

            self._bar = tqdm(
                total=total_bytes,
                desc=desc,
                unit=unit,
                unit_scale=True,
                unit_divisor=1024 if unit == "B" else 1000,
                dynamic_ncols=True,
                file=sys.stderr,
            )

    def update(self, nbytes: int, **counts: int) -> None:
        for k, v in counts.items():
            self.counts[k] = self.counts.get(k, 0) + v
        if self._bar is None:
            return
        self._bar.update(nbytes)
        now = time.perf_counter()
        if now - self._last > 0.5:
            self._last = now
            dt = max(now - self.start, 1e-9)
            self._bar.set_postfix_str(", ".join(f"{_si(v / dt)} {k}/s" for k, v in self.counts.items()), refresh=False)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()

    @property
    def elapsed(self) -> float:
        return time.perf_counter() - self.start


def _si(x: float) -> str:
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:.1f}{unit}"
    return f"{x:.0f}"
