"""Reading the slices `pipeline probe --config` measured: the slope's arithmetic, and `pipeline plan --config`
putting a GPU's slices beside its own figures for the same ranks (a probe file as a lent H200 would write it: the
figures are the bench's 70B slices, 2026-12-04)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from click.testing import CliRunner

from pipeline.cli import main
from pipeline.plan.probe import extrapolate
from pipeline.train.measured_slices import slice_key
from pipeline.train.setup.config import load
from pipeline.train.setup.prepare import prepare
from tests.multiproc import launch

ROOT = Path(__file__).resolve().parents[3]


def test_the_slope_through_the_slices_gives_the_full_depth() -> None:
    assert extrapolate([2, 4], [7.57, 7.82], 80) == pytest.approx(17.32)  # the bench's 70B slices, 80 layers
    assert extrapolate([2, 4, 6], [1.0, 2.0, 3.0], 10) == pytest.approx(5.0)
    assert extrapolate([1, 2, 3], [1.0, 2.2, 2.9], 3) == pytest.approx(3.0, abs=0.1)  # least squares through three
    with pytest.raises(ValueError):
        extrapolate([2, 2], [1.0, 1.1], 8)


def probe_file(path: Path, key: dict, gpu: str, device: str = "cuda") -> Path:
    slices = [
        {"layers": 2, "step_s": 1.1, "optimizer_s": 0.1, "micro_step_s": 1.0, "peak_gib": 7.57},
        {"layers": 4, "step_s": 1.3, "optimizer_s": 0.1, "micro_step_s": 1.2, "peak_gib": 7.82},
    ]
    full = {"layers": key["shape"]["num_layers"], "micro_step_s": 1.6, "optimizer_s": 0.1, "peak_gib": 8.3}
    doc = {
        "host": "lent",
        "when": "2026-12-04",
        "gpu": gpu,
        "memory": {"bytes_per_s": 2e11},
        "cpu_adam": {"params_per_s": 4e9},
        "slices": {"key": key, "device": device, "ranks": 1, "when": "2026-12-04", "slices": slices, "full": full},
    }
    path.write_text(json.dumps(doc))
    return path


@pytest.mark.parametrize("gpu, ratio", [("NVIDIA H200", True), ("NVIDIA GeForce RTX 4090 D", False)])
def test_a_gpus_slices_stand_beside_the_plan_for_the_same_ranks_with_the_ratio(
    shards: Path, tmp_path: Path, gpu: str, ratio: bool
) -> None:
    cfg = launch.write_config(
        tmp_path / "c.yaml", run_dir=tmp_path / "run", shards=shards, ds_config="zero2.json", model="{preset: 125m}"
    )
    key = slice_key(prepare(load(cfg), 1, 1))
    probe = probe_file(tmp_path / "probe.json", key, gpu)
    args = ["plan", "--config", str(cfg), "--probe", str(probe), "--gpu", "h200"]
    r = CliRunner().invoke(main, args)
    assert r.exit_code in (0, 3), r.output
    assert "slices of 2 and 4 layers extrapolated to 12: a step of one micro-step 1.700 s" in r.output
    assert "peak 8.30 GiB per rank" in r.output
    if ratio:
        assert "the plan for the same 1 rank(s), one micro-step per step:" in r.output
        got = json.loads(CliRunner().invoke(main, [*args, "--json"]).output)["measured_slices"]
        assert got["ratio"]["step_s"] == pytest.approx(1.7 / got["planned"]["step_s_one_micro_step"])
        assert got["ratio"]["peak"] == pytest.approx(8.3 / got["planned"]["peak_gib"])
    else:
        assert "this plan is for H200 SXM: no ratio to the plan" in r.output
    # another config (a changed DeepSpeed JSON, micro-batch or model) is not compared
    other = CliRunner().invoke(main, [*args, "--set", f"train.deepspeed_config={ROOT}/ds_configs/zero3.json"])
    assert "were measured for another configuration (deepspeed_config differ)" in other.output


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_a_continued_model_is_sliced_in_its_own_architecture_with_fresh_weights(tmp_path: Path, family: str) -> None:
    """`model.init_from` takes no shape override (its weights have a shape): its slices are the same Hugging Face
    architecture at fewer layers (`model.architecture`), every other field as the model's, nothing loaded; the key
    that `pipeline plan` matches is the whole config's."""
    from pipeline.launch.slices import _shape_sets
    from pipeline.model import build_model
    from tests.conftest import CORPUS, shard_into, tokenize_with
    from tests.hf_families import write_model, write_tokenizer

    model = write_model(family, tmp_path / family, write_tokenizer(tmp_path / "tok"))
    tokenize_with(tmp_path / "corpus", [str(CORPUS)], model)
    shard_into([(tmp_path / "corpus", 1.0)], tmp_path / "shards", seq_len=32)
    cfg = launch.write_config(
        tmp_path / "c.yaml",
        run_dir=tmp_path / "run",
        shards=tmp_path / "shards",
        ds_config="zero2.json",
        model=f"{{init_from: {model}}}",
    )
    whole = prepare(load(cfg), 1, 1)
    sets = _shape_sets(whole, 1)
    assert sets == ["model.shape.num_layers=1", "model.init_from=null", f"model.architecture={model}"]
    sliced = prepare(load(cfg, sets), 1, 1)
    assert sliced.cfg.model.init_from is None and sliced.shape.num_layers == 1 and whole.shape.num_layers == 2
    assert sliced.shape.family == family and sliced.shape.hf_config is not None
    assert sliced.shape.hf_config["num_hidden_layers"] == 1
    assert {k: v for k, v in sliced.shape.as_dict().items() if k not in ("num_layers", "hf_config")} == {
        k: v for k, v in whole.shape.as_dict().items() if k not in ("num_layers", "hf_config")
    }
    built = {n: tuple(p.shape) for n, p in build_model(sliced.shape).named_parameters()}
    own = {n: tuple(p.shape) for n, p in build_model(whole.shape).named_parameters() if ".layers.1." not in n}
    assert built == own
    assert sliced.shape.num_params() == sum(p.numel() for p in build_model(sliced.shape).parameters())


def test_an_architecture_is_one_source_of_the_model_and_takes_only_its_own_fields(tmp_path: Path) -> None:
    from pipeline.errors import ConfigError
    from pipeline.model.families import model_shape
    from tests.hf_families import CONFIGS

    (tmp_path / "config.json").write_text(json.dumps(CONFIGS["qwen3"]))
    shape = model_shape(None, {"num_layers": 5, "hidden_size": 128}, None, 600, architecture=str(tmp_path))
    assert (shape.num_layers, shape.hidden_size, shape.family, shape.qk_norm) == (5, 128, "qwen3", True)
    for kwargs, said in [
        ({"init_from": str(tmp_path)}, "give one (init_from brings its architecture with its weights"),
        ({"preset": "tiny"}, "and model.preset tiny: give one"),
        ({"overrides": {"rope_theta": 1e6}}, "model.shape.rope_theta: not a field that model.architecture takes"),
    ]:
        args = {"preset": None, "overrides": {}, "init_from": None, **kwargs}
        with pytest.raises(ConfigError, match=re.escape(said)):
            model_shape(args["preset"], args["overrides"], args["init_from"], 600, architecture=str(tmp_path))
    with pytest.raises(ConfigError, match="no config.json there"):
        model_shape(None, {}, None, 600, architecture=str(tmp_path / "missing"))
