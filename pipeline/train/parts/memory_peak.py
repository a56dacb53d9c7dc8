"""What the card held at its peak, for the GPU bench and for anyone chasing memory: with
`PIPELINE_MEMORY_SNAPSHOT=PATH:STEP`, rank 0 on a CUDA device records torch's allocator history from the start
and, after step STEP, writes PATH: the live blocks at the peak of that history, grouped by where they were
allocated (the first frame in this pipeline, DeepSpeed or transformers), largest first. The planner's memory terms
are held against such a summary (`pipeline/plan/memory.py`: what the 70B slices hold beyond the terms is a named
measured term until a summary says what it is). Nothing is recorded without the variable, nor on the CPU."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeline.atomic import write_json

if TYPE_CHECKING:
    from pipeline.train.state import StepEnd, TrainState

ENV = "PIPELINE_MEMORY_SNAPSHOT"
GiB = 2**30
OURS = ("/pipeline/", "/deepspeed/", "/transformers/", "/liger_kernel/", "/torchao/")
"""Frames that say who allocated (torch's own frames say only how)."""


def site(frames: list[dict[str, Any]]) -> str:
    """Where a block was allocated: the first frame in our code or a library we drive, else the first frame."""
    for f in frames:
        name = str(f.get("filename", ""))
        if any(part in name for part in OURS):
            short = name[max(name.rfind(p) for p in OURS if p in name) + 1 :]
            return f"{short}:{f.get('line')} {f.get('name')}"
    if frames:
        return f"{frames[0].get('filename')}:{frames[0].get('line')} {frames[0].get('name')}"
    return "before the recording began (no frames)"


def peak_summary(snapshot: dict[str, Any], top: int = 20) -> dict[str, Any]:
    """The live blocks at the highest point of a `torch.cuda.memory._snapshot()`'s history, grouped by `site`.
    The snapshot's blocks are what is live at its end; its trace, walked backwards, undoes each allocation and
    redoes each free, so the live set at every earlier event is known without the ring buffer's lost beginning."""
    live: dict[int, tuple[int, str]] = {}
    for seg in snapshot.get("segments", []):
        addr = int(seg.get("address", 0))
        for block in seg.get("blocks", []):
            if block.get("state") == "active_allocated":
                live[addr] = (int(block["size"]), site(block.get("frames") or []))
            addr += int(block["size"])
    trace = (snapshot.get("device_traces") or [[]])[0]

    def undo(event: dict[str, Any], state: dict[int, tuple[int, str]]) -> int:
        """The state before `event`, from the state after it; returns the change of the live total."""
        if event["action"] == "alloc":
            gone = state.pop(int(event["addr"]), None)
            return -gone[0] if gone else 0
        if event["action"] == "free_completed" and int(event["addr"]) not in state:
            state[int(event["addr"])] = (int(event["size"]), site(event.get("frames") or []))
            return int(event["size"])
        return 0

    state = dict(live)
    total = sum(size for size, _ in state.values())
    best, best_at = total, len(trace)  # best_at: the events from it on are undone at the peak
    for i in range(len(trace) - 1, -1, -1):
        total += undo(trace[i], state)
        if total > best:
            best, best_at = total, i
    state = dict(live)
    for i in range(len(trace) - 1, best_at - 1, -1):
        undo(trace[i], state)
    by_site: dict[str, list[int]] = {}
    for size, where in state.values():
        by_site.setdefault(where, [0, 0])
        by_site[where][0] += size
        by_site[where][1] += 1
    ranked = sorted(by_site.items(), key=lambda kv: -kv[1][0])
    return {
        "peak_live_gib": sum(size for size, _ in state.values()) / GiB,
        "events": len(trace),
        "sites": [{"site": k, "gib": v[0] / GiB, "blocks": v[1]} for k, v in ranked[:top]],
        "other_gib": sum(v[0] for _, v in ranked[top:]) / GiB,
    }


class PeakRecorder:
    """Rank 0's allocator history, written summarised after the step `PIPELINE_MEMORY_SNAPSHOT` names."""

    def __init__(self, rank: int, device_type: str):
        self.path: Path | None = None
        self.step = 0
        spec = os.environ.get(ENV)
        if not spec or rank != 0 or device_type != "cuda":
            return
        import torch

        path, _, step = spec.rpartition(":")
        self.path, self.step = Path(path), int(step)
        torch.cuda.memory._record_memory_history(max_entries=200_000)

    def after_step(self, end: StepEnd) -> None:
        self.after(end.state.step)

    def at_end(self, state: TrainState) -> None:
        """Nothing to do at the run's end."""

    def after(self, step: int) -> None:
        if self.path is None or step != self.step:
            return
        import torch

        snapshot = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        summary = peak_summary(snapshot) | {"step": step, "max_allocated_gib": torch.cuda.max_memory_allocated() / GiB}
        write_json(self.path, summary)
        self.path = None
