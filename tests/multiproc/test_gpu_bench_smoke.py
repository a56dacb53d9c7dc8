"""`bench/gpu_bench.py --smoke`: every case of the one-call GPU benchmark runs its code path on the CPU, so the
script cannot rot between GPU leases."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.multiproc import launch

pytestmark = pytest.mark.slow


def test_gpu_bench_smoke_runs_every_case(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, str(launch.ROOT / "bench" / "gpu_bench.py"), "--smoke", "--out", str(tmp_path)],
        env=launch.env(),
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    [result] = tmp_path.glob("cpu-smoke-*.json")
    doc = json.loads(result.read_text())
    names = [c["name"] for c in doc["cases"]]
    assert names == ["plain_eager", "plain_compiled", "pipeline_1b_zero2", "70b_2layers_offload"]
    for case in doc["cases"]:
        assert "error" not in case and case["tokens_per_s"] > 0, case
    for case in doc["cases"][2:]:  # the pipeline cases stand beside the planner's prediction
        assert case["plan_step_time_s"] > 0 and case["plan_peak_allocated_gib"] > 0
    assert "| plain_eager |" in result.with_suffix(".md").read_text()
    assert not list(tmp_path.glob("**/step*")), "the benchmark must not write checkpoints"
