"""train.fp8 through the real launcher (2 CPU ranks, ZeRO-2, torchao's float8 layers emulated): the log says which
layers; it trains; its checkpoint continues without fp8 within float8's rounding of its own continuation (the
weights are the bf16 model's either way); and the export is a plain Hugging Face model. Two launches."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from pipeline.train.checkpoint import files as ckpt
from tests.multiproc import launch

# Whether torchao is installed, without importing it: its import (torch._dynamo's with it) costs every pytest
# process 1.5-2.5 s at collection, deselected or not.
pytestmark = [
    pytest.mark.slow,
    pytest.mark.xdist_group("fp8"),
    pytest.mark.skipif(importlib.util.find_spec("torchao") is None, reason="torchao is not installed"),
]


def test_fp8_trains_and_its_checkpoint_resumes_with_and_without_it(shards: Path, tmp_path: Path) -> None:
    from pipeline.evaluate.export import export
    from pipeline.model import resolve_shape
    from pipeline.model.kernels import fp8_layers

    # width 64, ffn 192: every projection's dimensions are multiples of 16
    model = "{preset: tiny, shape: {hidden_size: 64, ffn_hidden_size: 192}}"
    kw = dict(shards=shards, ds_config="zero2.json", steps=6, model=model)
    run = tmp_path / "fp8"
    cfg = launch.write_config(tmp_path / "f.yaml", run_dir=run, ckpt_interval=3, **kw)
    out = launch.run(cfg, sets=("train.fp8=true", "train.precision=bf16"))
    log = out.stdout + out.stderr
    assert out.returncode == 0, log[-4000:]
    layers = fp8_layers(resolve_shape("tiny", {"hidden_size": 64, "ffn_hidden_size": 192}, 600))
    assert (
        layers == 14
        and f"fp8: {layers} of the decoder's linear layers (embeddings, norms and lm_head stay bf16)" in log
    )
    assert "in float8, emulated on cpu" in log
    losses = launch.losses(run)
    assert all(v == v for v in losses.values()) and losses[6] < losses[1], losses
    assert ckpt.latest_complete(run) == "step00000006"
    # its checkpoint at step 3 continued without fp8: the same weights and data, so step 4 moves by float8's
    # rounding only from the fp8 run's own continuation (which is the resume with fp8: no float8 state to save)
    branch = tmp_path / "without"
    b = launch.write_config(tmp_path / "without.yaml", run_dir=branch, ckpt_interval=3, **kw)
    res = launch.run(b, sets=("train.fp8=false", "train.precision=bf16", f"checkpoint.branch_from={run}/step00000003"))
    assert res.returncode == 0, (res.stdout + res.stderr)[-4000:]
    assert max(launch.losses(branch)) == 6 and "branch" in (res.stdout + res.stderr)
    assert launch.losses(branch)[4] == pytest.approx(losses[4], rel=0.02)
    hf = export(str(run), str(tmp_path / "hf"))
    from transformers import AutoModelForCausalLM

    assert type(AutoModelForCausalLM.from_pretrained(hf).model.layers[0].self_attn.q_proj).__name__ == "Linear"
