"""`make eval TASKS=...`: the checkpoint exported when needed and EleutherAI's lm-evaluation-harness run on the
export, from its own venv, offline, with the bundled local task."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.slow


def test_make_eval_with_tasks_runs_the_harness_offline(zero_runs: dict[int, Path]) -> None:
    from pipeline.evaluate.harness import STAMP, export_if_needed

    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    install = subprocess.run(
        ["make", "harness-install"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200
    )
    if install.returncode != 0:
        pytest.skip(f"lm-evaluation-harness could not be installed here: {install.stderr[-500:]}")
    run_dir = zero_runs[1]
    out = subprocess.run(
        ["make", "eval", f"CKPT={run_dir}", "TASKS=pipeline_demo_ppl"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "|pipeline_demo_ppl|" in out.stdout and "bits_per_byte" in out.stdout, out.stdout[-3000:]
    exported = run_dir / "export" / "step00000020"
    assert json.loads((exported / STAMP).read_text())["checkpoint"] == str(run_dir / "step00000020")
    results = list((run_dir / "eval" / "step00000020-lm-eval").rglob("results_*.json"))
    assert results, "the harness wrote its results"
    bpb = json.loads(results[0].read_text())["results"]["pipeline_demo_ppl"]["bits_per_byte,none"]
    assert 0 < bpb < 8  # a trained tiny model on English text: far below 8 bits per byte
    assert export_if_needed(str(run_dir)) == (exported, False)  # current: not exported again
