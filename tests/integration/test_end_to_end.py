"""The four stages through the `pipeline` command line, as a user runs them, on the fixture corpus."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import CORPUS
from tests.multiproc import launch

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


def _pipeline(*args: str, timeout: int = 900) -> subprocess.CompletedProcess:
    res = subprocess.run(
        [sys.executable, "-m", "pipeline.cli", *args],
        env=launch.env(),
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return res


def test_tokenize_shard_pretrain_evaluate_export(tmp_path: Path) -> None:
    prefix = tmp_path / "corpus"
    _pipeline(
        "tokenize",
        str(CORPUS),
        "--output-prefix",
        str(prefix),
        "--train-tokenizer",
        "--vocab-size",
        "600",
        "--workers",
        "2",
    )
    out = _pipeline(
        "shard", str(prefix), "--output", str(tmp_path / "shards"), "--seq-len", "64", "--split", "80,10,10"
    )
    assert "train:" in out.stdout
    cfg = launch.write_config(
        tmp_path / "c.yaml",
        run_dir=tmp_path / "run",
        shards=tmp_path / "shards",
        ds_config="zero2.json",
        steps=12,
        ckpt_interval=6,
    )
    res = _pipeline("pretrain", "--config", str(cfg), "--num-gpus", "2", "--master-port", str(launch.free_port()))
    assert "deepspeed --num_gpus 2" in res.stderr and "pipeline/pretrain.py" in res.stderr
    ev = _pipeline("evaluate", "--checkpoint", str(tmp_path / "run"), "--split", "test", "--max-new-tokens", "8")
    assert "perplexity" in ev.stdout and "bits per byte" in ev.stdout
    result = json.loads((tmp_path / "run" / "eval" / "step00000012-test.json").read_text())
    assert result["step"] == 12 and result["loss"] < 6.0  # ln(600) = 6.4 for a uniform guess
    assert (tmp_path / "run" / "loss.png").exists()
    _pipeline("export", "--checkpoint", str(tmp_path / "run" / "step00000006"), "--output", str(tmp_path / "hf"))
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["num_hidden_layers"] == 2
