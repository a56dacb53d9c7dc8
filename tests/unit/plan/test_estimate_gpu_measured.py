"""The planner against every case our own GPU runs measured (bench/results/gpu-h200-2026-12-04{,b,c}.json: two
H200 leases, the second in two calls), re-planned by today's planner as the bench plans a case: its DeepSpeed
JSON, its speed switches (train.compile, train.kernels), its memory cap, the lent host's RAM, cores and `pipeline
probe` figures. Step time within 1.33x and inside the printed range, peak allocated within 0.95-1.25x of
torch.cuda.max_memory_allocated. The cases that miss are named below with what is known of why, and the test fails
when that list is no longer exactly the cases that miss (a fix shows, and so does a new miss)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import bench_module

ROOT = Path(__file__).resolve().parents[3]
RESULTS = ROOT / "bench" / "results"
LEASES = tuple(sorted(p.name for p in RESULTS.glob("gpu-*.json")))
"""Every GPU run committed (a new lease's results.json, saved as bench/results/gpu-CARD-DATE.json, joins them)."""

NOT_STEADY = {
    "7b_2layers_zenflow": "6 steps, one of them ZenFlow's first full CPU update (about 12 s): not its steady state",
}
UNEXPLAINED = {
    "7b_2layers_offload_liger": "ZeRO-3, 2 layers of 7B under Liger's modules at 32,768 tokens a micro-step: 6.11 GiB "
    "measured, planned 1.45x over, while the eager case beside it (8.54 GiB) is planned 1.15x: the layer is priced "
    "from the CPU count of Liger's autograd contract (tests/unit/plan/test_memory_graphs.py: 12 h + 6 f saved, "
    "4 f - 2 h more in its backward), which the GPU held about 1.5 GiB less of. Over, not under (the plan refuses "
    "what may fit, never the reverse); the next lent GPU's memory snapshot is to say what Liger's kernels free",
}


def gpu_bench() -> Any:
    return bench_module("gpu_bench")


def replanned() -> list[dict[str, Any]]:
    bench = gpu_bench()
    # The first lease kept no host probe: the second's, of the same kind of lent machine the same day
    probe = json.loads((RESULTS / "gpu-h200-2026-12-04b.json").read_text())["warm_up"]["host"]
    return [dict(r, lease=name) for name in LEASES for r in bench.replanned(RESULTS / name, probe)]


def misses(r: dict[str, Any]) -> list[str]:
    time = r["plan_step_time_s"] / r["step_time_s"]
    lo, hi = r["plan_step_time_range_s"]
    memory = r["plan_peak_allocated_gib"] / r["peak_allocated_gib"]
    out = []
    if not 1 / 1.33 <= time <= 1.33:
        out.append(f"step time planned {time:.2f}x the measured")
    if not lo <= r["step_time_s"] <= hi:
        out.append(f"measured {r['step_time_s']:.3f} s outside the range {lo:.3f}-{hi:.3f}")
    if not 0.95 <= memory <= 1.25:
        out.append(f"peak allocated planned {memory:.2f}x the measured")
    return out


@pytest.fixture(scope="module")
def cases() -> list[dict[str, Any]]:
    return replanned()


def test_every_measured_case_is_planned_within_its_bounds_but_the_named_ones(cases: list[dict[str, Any]]) -> None:
    measured = {r["name"] for r in cases}
    assert len(cases) >= 15 and {"70b_2layers", "1b_default", "7b_2layers_offload_liger"} <= measured
    assert set(NOT_STEADY) | set(UNEXPLAINED) <= measured
    missed = {f"{r['lease']}:{r['name']}": m for r in cases if r["name"] not in NOT_STEADY and (m := misses(r))}
    assert {k.split(":")[1] for k in missed} == set(UNEXPLAINED), missed


def test_the_speed_switches_are_priced_from_the_kernels_table(cases: list[dict[str, Any]]) -> None:
    """compile and Liger change the plan as the bench measured them: eager 1b_zero2 against the compiled and the
    Liger cases of the same lease, the step times' ratio within 10% of the measured, the peaks' within 15% (the
    eager peak itself is planned 1.10x over)."""
    b = {r["name"]: r for r in cases if r["lease"] == "gpu-h200-2026-12-04b.json"}
    c = {r["name"]: r for r in cases if r["lease"] == "gpu-h200-2026-12-04c.json"}
    eager = b["1b_zero2"]
    for fast in (b["1b_default"], b["1b_liger"], c["1b_liger_eager"]):
        for planned, measured, rel in (
            ("plan_step_time_s", "step_time_s", 0.1),
            ("plan_peak_allocated_gib", "peak_allocated_gib", 0.15),
        ):
            plan_ratio = fast[planned] / eager[planned]
            real_ratio = fast[measured] / eager[measured]
            assert plan_ratio < 1 and plan_ratio == pytest.approx(real_ratio, rel=rel), (fast["name"], planned)
    sources = {a["figure"]: a["source"] for a in b["1b_default"]["plan_assumed"]}
    assert "gpu-h200-2026-12-04b.json" in sources["speed switches"]
