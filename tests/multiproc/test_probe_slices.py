"""`pipeline probe --config`: the config's own model measured at 2 and 4 layers through the trainer and the real
launcher (a CPU rank here), extrapolated by the slope to its full depth, predicts the full model's measured step
within 15%; `pipeline plan --config` reads it back beside its plan, and says when the probe measured another
configuration. CPU ranks are timed in their CPU seconds, so a second job on the machine (the other test worker)
does not decide the ratio: it passed beside two busy loops on this machine's two cores."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.launch.slices import run_slice
from pipeline.train.setup.config import load
from pipeline.train.setup.prepare import prepare
from tests.multiproc import launch

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
MODEL = "{preset: null, shape: {hidden_size: 512, num_layers: 6, ffn_hidden_size: 1536, num_heads: 8, num_kv_heads: 8}}"


def pipeline(*args: str) -> subprocess.CompletedProcess:
    cmd = [str(Path(sys.executable).parent / "pipeline"), *args]
    return subprocess.run(cmd, env=launch.env(), capture_output=True, text=True, timeout=900, cwd=ROOT)


def test_slices_at_2_and_4_layers_predict_the_full_models_step_and_the_plan_reads_them(
    shards: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = launch.write_config(
        tmp_path / "c.yaml",
        run_dir=tmp_path / "run",
        shards=shards,
        ds_config="zero2.json",
        micro=4,
        global_batch=32,
        model=MODEL,
    )
    probe = tmp_path / "node.probe.json"
    out = pipeline(
        "probe", "--config", str(cfg), "--quick", "--num-gpus", "1", "--slice-steps", "6", "--slice-repeats", "2",
        "--out", str(probe),
    )  # fmt: skip
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "slice of 2 layers on 1 rank(s), 6 steps, run 2" in out.stderr
    s = json.loads(probe.read_text())["slices"]
    assert [m["layers"] for m in s["slices"]] == [2, 4] and s["full"]["layers"] == 6 and s["ranks"] == 1
    assert s["slices"][1]["micro_step_s"] > s["slices"][0]["micro_step_s"]  # a layer costs time
    predicted = s["full"]["micro_step_s"] + s["full"]["optimizer_s"]
    # The full model, measured the same way (its fastest steady step of two launches)
    for k, v in launch.env().items():
        monkeypatch.setenv(k, v)
    prepared = prepare(load(cfg), 1, 1)
    full = min(
        run_slice(str(cfg), [], prepared, 6, num_gpus=1, steps=6, work=tmp_path / f"full{i}")["step_s"]
        for i in range(2)
    )
    assert abs(predicted / full - 1) < 0.15, (predicted, full, s["slices"])
    # The plan reads the slices of this config, and only of this config
    plan = pipeline("plan", "--config", str(cfg), "--probe", str(probe), "--json")
    assert plan.returncode in (0, 3), plan.stderr[-3000:]
    got = json.loads(plan.stdout)["measured_slices"]
    assert got["layers"] == 6 and got["step_s_one_micro_step"] == pytest.approx(predicted)
    assert got["device"] == "cpu" and "ratio" not in got  # CPU ranks: no ratio to a GPU's plan
    other = pipeline("plan", "--config", str(cfg), "--probe", str(probe), "--set", "batch.micro_batch_size=2")
    assert "were measured for another configuration (micro_batch_size differ)" in other.stdout
