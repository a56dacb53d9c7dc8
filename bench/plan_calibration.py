"""The planner against the published runs of tests/unit/plan/test_timing_published.py, side by side: each row's
published
figure, the planner's point and range, the speed ratio (published / planned; above 1 the planner is too slow),
whether the run's configuration fits; then the test's criteria. `--fit` searches the time model's constants
(pipeline.plan.timing) for the smallest total log-error over the rows and the H200 anchors, coordinate by
coordinate, and prints the values to put there.

Usage: python bench/plan_calibration.py [--fit]"""

from __future__ import annotations

import argparse
import itertools
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pipeline.plan import timing  # noqa: E402
from tests.unit.plan.test_estimate import ANCHORS  # noqa: E402
from tests.unit.plan.test_timing_published import BY_ID, RAN, SPEED, within  # noqa: E402

KNOBS = {
    "EFFICIENCY_KNEE_S": [1e-4, 1.5e-4, 2e-4, 2.5e-4, 3e-4, 4e-4],
    "OVERLAP_RESIDUE": [0.15, 0.25, 0.35, 0.45],
    "OFFLOAD_BW_FRACTION": [0.04, 0.06, 0.075, 0.09, 0.11, 0.13],
    "PAGEABLE_BW_FRACTION": [0.015, 0.02, 0.027, 0.035, 0.045],
    "HOST_COPY_FRACTION": [0.08, 0.12, 0.17, 0.25, 0.35],
    "CPU_ADAM_BW_FRACTION": [0.08, 0.12, 0.17, 0.25, 0.35, 0.5],
    "CPU_ADAM_UNBOUND_SLOPE": [0.1, 0.2, 0.3, 0.45, 0.6],
    "EAGER_SCORE_BYTES": [8, 14, 20, 28, 40, 56],
}


def anchor_errors() -> list[float]:
    from pipeline.plan.estimate import estimate

    out = []
    for _, shape, seq, cluster, cand, seconds, _ in ANCHORS:
        out.append(math.log(estimate(shape, seq, cluster, cand, loss_chunk_tokens=None).step_time_s / seconds))
    return out


HELD_OUT: set[str] = set()
"""Rows the fit does not see (--holdout), to check that what it found holds for runs it was not fitted to."""


def criteria() -> dict[str, float]:
    ratios = [r.speed_ratio() for r in SPEED if r.id not in HELD_OUT]
    inside = sum(p[1] <= r.published <= p[2] for r in SPEED for p in [r.predicted()])
    base = BY_ID["S12"].predicted()[0]
    pen_param = BY_ID["S13"].predicted()[0] / base / (6.05 / 2.86)
    pen_full = BY_ID["S14"].predicted()[0] / base / (13.70 / 2.86)
    scale = (BY_ID["S4"].predicted()[0] / 4 / BY_ID["S1"].predicted()[0]) / ((6929 / 4) / 2523)
    return {
        "within_1.33": sum(within(x, 1.33) for x in ratios) / len(ratios),
        "inside_range": inside / len(SPEED),
        "penalty_param": pen_param,
        "penalty_full": pen_full,
        "scaling_1_to_4": scale,
        "loss": sum(math.log(x) ** 2 for x in ratios)
        + 3 * (math.log(pen_param) ** 2 + math.log(pen_full) ** 2 + math.log(scale) ** 2)
        + 3 * sum(e**2 for e in anchor_errors()),
    }


def report() -> None:
    print(f"{'row':5s} {'published':>10s} {'planned':>10s} {'range':>21s} {'ratio':>6s} {'fits':>5s}  setup")
    for r in SPEED:
        point, lo, hi = r.predicted()
        fits = r.estimate().fits
        print(
            f"{r.id:5s} {r.published:10,.2f} {point:10,.2f} {lo:10,.2f}-{hi:10,.2f} {r.speed_ratio():6.2f} "
            f"{'yes' if fits else 'NO':>5s}  {r.setup} [{r.unit}]"
        )
    from pipeline.plan.estimate import estimate

    refused = [f.id for f in RAN if not estimate(f.shape, f.seq_len, f.cluster, f.cand, stack=f.stack).fits]
    print("\nruns that ran, refused:", refused or "none")
    print("H200 anchors, log(planned/measured step):", [round(e, 3) for e in anchor_errors()])
    for k, v in criteria().items():
        print(f"{k:16s} {v:.3f}")


def fit(rounds: int = 3) -> None:
    best = criteria()["loss"]
    for _ in range(rounds):
        for name, values in KNOBS.items():
            scores = []
            for v in values:
                setattr(timing, name, v)
                scores.append((criteria()["loss"], v))
            loss, v = min(scores)
            setattr(timing, name, v)
            best = loss
        print("round:", {k: getattr(timing, k) for k in KNOBS}, f"loss {best:.3f}")
    _ = itertools  # the search is coordinate-wise; a full grid would take too long here


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fit", action="store_true")
    ap.add_argument("--holdout", default="", help="Comma-separated row ids the fit leaves out, e.g. S7,S8,S9,S10")
    args = ap.parse_args()
    HELD_OUT.update(x for x in args.holdout.split(",") if x)
    if args.fit:
        fit()
    report()
    if HELD_OUT:
        print("held out:", {r.id: round(r.speed_ratio(), 2) for r in SPEED if r.id in HELD_OUT})


if __name__ == "__main__":
    main()
