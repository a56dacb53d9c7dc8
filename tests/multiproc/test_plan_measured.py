"""The planner's parameter, gradient and optimizer bytes against what a real 2-rank DeepSpeed engine holds."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.plan.search import _state_split
from tests.multiproc import launch

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("preset,stage", [("tiny", 2), ("125m", 2), ("tiny", 3), ("125m", 3)])
def test_model_state_bytes_match_a_real_engine(shards: Path, tmp_path: Path, preset: str, stage: int) -> None:
    cfg = launch.write_config(tmp_path / "m.yaml", run_dir=tmp_path / "run", shards=shards,
                              ds_config=f"zero{stage}.json", micro=1, global_batch=2)
    out = tmp_path / "mem.json"
    cmd = [str(Path(sys.executable).parent / "deepspeed"), "--num_gpus", "2", "--master_port", str(launch.free_port()),
           str(ROOT / "tests/multiproc/engine_memory.py"), str(cfg), str(out), f"model.preset={preset}",
           "train.precision=bf16"]
    res = subprocess.run(cmd, env=launch.env(), capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    measured = json.loads(out.read_text())
    planned = _state_split(stage, measured["psi"], 2, False, False)
    for key in ("params", "grads", "optimizer"):
        assert measured[key] == pytest.approx(planned[key], rel=0.10), (key, measured, planned)
