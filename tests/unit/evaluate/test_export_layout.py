"""The Hugging Face export in the layout serving stacks read (vLLM, TGI, llama.cpp's converter): HF parameter names
in safetensors shards with an index that covers every tensor, and a config.json that a reader on transformers 4
(vLLM's pin through 2025) reads as transformers 5 does. transformers 5 writes only `dtype` and `rope_parameters`;
4 would take a missing `rope_theta` as 10000 and no scaling, silently."""

from __future__ import annotations

import json
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from pipeline.evaluate.export import write_hf_model
from pipeline.model import build_model
from pipeline.model.families import model_shape

ROOT = Path(__file__).resolve().parents[3]
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256, "rope_theta": 500000}


def export_tiny(out: Path, rope: dict | None = None) -> Path:
    shape = model_shape("tiny", {}, None, 600, 1024, rope or {}, None)
    torch.manual_seed(0)
    model = build_model(shape)
    return write_hf_model(iter(model.state_dict().items()), shape, None, out, max_shard_bytes=60_000)


def test_the_shards_and_their_index_cover_every_tensor_by_its_hugging_face_name(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    out = export_tiny(tmp_path / "hf")
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(out.glob("model-*-of-*.safetensors"))
    assert len(shards) > 1 and set(index["weight_map"].values()) == {s.name for s in shards}
    held = {}
    for s in shards:
        with safe_open(str(s), "pt") as f:
            held.update(dict.fromkeys(f.keys(), s.name))
    assert held == index["weight_map"]
    # readable by the group on a shared mount, as a plain open() makes files (safetensors' writer makes 0600)
    assert all(p.stat().st_mode & stat.S_IRGRP for p in out.iterdir()), [
        (p.name, oct(p.stat().st_mode)) for p in out.iterdir()
    ]
    model, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert set(held) == set(model.state_dict())


@pytest.mark.parametrize("rope", [None, YARN])
def test_config_json_also_says_rope_and_dtype_in_transformers_4s_keys(tmp_path: Path, rope: dict | None) -> None:
    from transformers import AutoConfig

    out = export_tiny(tmp_path / "hf", rope)
    doc = json.loads((out / "config.json").read_text())
    assert doc["architectures"] == ["LlamaForCausalLM"] and doc["torch_dtype"] == doc["dtype"] == "bfloat16"
    assert doc["rope_theta"] == doc["rope_parameters"]["rope_theta"] == (500000 if rope else 10000)
    if rope:
        assert doc["rope_scaling"] == {k: v for k, v in YARN.items() if k != "rope_theta"}
    else:
        assert "rope_scaling" not in doc
    # transformers 5 still reads what it wrote
    assert AutoConfig.from_pretrained(out).rope_parameters == doc["rope_parameters"]


@pytest.mark.slow
def test_a_reader_on_transformers_4_gets_the_same_rope(tmp_path: Path) -> None:
    """transformers 4.57 (with the tokenizers and huggingface_hub it needs) in a folder of its own, reading the
    export's config.json as vLLM on transformers 4 does."""
    lib = ROOT / ".transformers4"
    if not (lib / "transformers").is_dir():
        pins = ["transformers>=4.57,<5", "tokenizers>=0.22,<0.23", "huggingface_hub>=0.34,<1.0"]
        got = subprocess.run(
            [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(lib), *pins],
            capture_output=True,
            text=True,
        )
        if got.returncode != 0:
            pytest.skip(f"transformers 4 cannot be installed here: {got.stderr.strip()[-300:]}")
    out = export_tiny(tmp_path / "hf", YARN)
    read = f"from transformers import AutoConfig as A; c = A.from_pretrained({str(out)!r}); "
    read += "import json, transformers; print(json.dumps([transformers.__version__, c.rope_theta, c.rope_scaling]))"
    env = {"PYTHONPATH": str(lib), "PATH": "/usr/bin:/bin"}
    got = subprocess.run([sys.executable, "-c", read], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert got.returncode == 0, got.stderr[-2000:]
    version, theta, scaling = json.loads(got.stdout.strip().splitlines()[-1])
    assert version.startswith("4.") and theta == 500000
    assert scaling == {k: v for k, v in YARN.items() if k != "rope_theta"}
