"""Host memory at start-up, measured: a rank without ZeRO-3 builds the whole model in host memory before DeepSpeed
takes it. Each build runs in a process of its own (the peak RSS is a process's), for two presets: the bf16 build
the trainer does now holds about half the fp32 build's bytes, and the planner's term for it
(pipeline.plan.memory.build_bytes) is within 10% of the measured peak and never under it."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.multiproc import launch

pytestmark = pytest.mark.slow

BUILD = """
import json, resource, sys
import psutil, torch
from pipeline.model import resolve_shape
from pipeline.train.engine import build_for
from pipeline.train.runtime.weights import init_weights
preset, precision = sys.argv[1], sys.argv[2]
shape = resolve_shape(preset, {}, 32000)
ds = {"zero_optimization": {"stage": 2}, "bf16": {"enabled": precision == "bf16"}}
tok = {"eos_id": 2, "bos_id": 1, "pad_id": 3, "vocab_size": 32000}
build_for(shape, ds, tok, 2)  # the first build pays transformers' lazy imports; the one measured below does not
import gc; gc.collect()
before = psutil.Process().memory_info().rss
model = build_for(shape, ds, tok, 2)
init_weights(model, 1234, 0, False)
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
dtypes = sorted({str(p.dtype) for p in model.parameters()})
print(json.dumps({"before": before, "peak": peak, "dtypes": dtypes}))
"""


def measured(preset: str, precision: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", BUILD, preset, precision],
        env=launch.env(),
        capture_output=True,
        text=True,
        timeout=600,
        cwd=launch.ROOT,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("preset", ["350m", "1b"])
def test_a_rank_builds_the_model_in_its_training_dtype_and_the_planner_counts_the_peak(preset: str) -> None:
    from pipeline.model import resolve_shape
    from pipeline.plan.memory import build_bytes

    shape = resolve_shape(preset, {}, 32000)
    bf16, fp32 = measured(preset, "bf16"), measured(preset, "fp32")
    assert bf16["dtypes"] == ["torch.bfloat16"] and fp32["dtypes"] == ["torch.float32"]
    grew = {k: m["peak"] - m["before"] for k, m in (("bf16", bf16), ("fp32", fp32))}
    planned = build_bytes(shape)
    print(
        f"{preset}: build peak bf16 {grew['bf16'] / 1e9:.3f} GB, fp32 {grew['fp32'] / 1e9:.3f} GB, planned "
        f"{planned / 1e9:.3f} GB"
    )
    assert grew["bf16"] <= planned <= 1.10 * grew["bf16"], (grew, planned)
    assert grew["bf16"] < 0.6 * grew["fp32"]  # half the bytes of the fp32 build it replaces
