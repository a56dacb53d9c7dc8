"""Hugging Face families, the fast parts: config.json -> shape (parameter counts as transformers builds them, and as
published), unsupported families named, the data's tokenizer checked against the model's before launch, and
`pipeline plan --model` on a published architecture."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from pipeline.cli import main
from pipeline.data import shard as shard_stage
from pipeline.data import tokenize as tokenizing
from pipeline.data.config import ShardConfig, TokenizeConfig
from pipeline.errors import ConfigError, PipelineError
from pipeline.model.families import model_shape, read_config, shape_from_config
from pipeline.train.setup.config import load
from pipeline.train.setup.prepare import prepare
from tests.conftest import CORPUS, ROOT
from tests.hf_families import CONFIGS, FAMILIES, write_model, write_tokenizer

PUBLISHED = {  # parameters as each model card states them, to three digits
    "llama-3.1-8b": 8.03e9,
    "llama-3.1-70b": 70.6e9,
    "mistral-7b-v0.1": 7.24e9,
    "qwen2.5-7b": 7.62e9,
    "qwen2.5-72b": 72.7e9,
    "qwen3-8b": 8.19e9,
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_published_architectures_count_the_parameters_transformers_builds(name: str) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    raw = read_config(ROOT / "configs" / "hf" / f"{name}.json")
    shape = shape_from_config(raw, name)
    config = AutoConfig.for_model(raw["model_type"], **{k: v for k, v in raw.items() if k != "model_type"})
    with torch.device("meta"):
        built = AutoModelForCausalLM.from_config(config)
    assert shape.num_params() == sum(p.numel() for p in built.parameters())
    assert abs(shape.num_params() / PUBLISHED[name] - 1) < 0.005


@pytest.mark.parametrize("family", FAMILIES)
def test_tiny_families_build_as_transformers_does(family: str) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    from pipeline.model import build_model

    shape = shape_from_config(dict(CONFIGS[family]), family)
    ours = build_model(shape)
    raw = CONFIGS[family]
    theirs = AutoModelForCausalLM.from_config(
        AutoConfig.for_model(family, **{k: v for k, v in raw.items() if k != "model_type"})
    )
    assert type(ours).__mro__[1] is type(theirs)
    assert {n: tuple(p.shape) for n, p in ours.named_parameters()} == {
        n: tuple(p.shape) for n, p in theirs.named_parameters()
    }
    assert shape.num_params() == sum(p.numel() for p in ours.parameters())
    assert shape.family == family and (shape.qkv_bias, shape.qk_norm) == (family == "qwen2", family == "qwen3")


def test_an_unsupported_family_is_named_with_the_supported_ones(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_embd": 768}))
    with pytest.raises(ConfigError) as e:
        model_shape(None, {}, str(tmp_path), 600)
    assert "model_type 'gpt2' is not supported" in str(e.value)
    assert all(f in str(e.value) for f in ("llama", "mistral", "qwen2", "qwen3"))
    with pytest.raises(ConfigError, match="no config.json there"):
        model_shape(None, {}, str(tmp_path / "not-downloaded"), 600)
    with pytest.raises(ConfigError, match="model.shape"):
        (tmp_path / "config.json").write_text(json.dumps(CONFIGS["llama"]))
        model_shape(None, {"num_layers": 1}, str(tmp_path), 600)


@pytest.fixture(scope="module")
def hf_shards(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(tokenize prefix, shards) of the fixture corpus with a tiny Qwen2 folder's tokenizer (601 tokens: the
    byte-level BPE's 600 plus the <|endoftext|> transformers' Qwen2 tokenizer class adds; eos 2)."""
    base = tmp_path_factory.mktemp("hfdata")
    folder = write_model("qwen2", base / "qwen2", write_tokenizer(base / "tokenizer"))
    tokenizing.run(
        TokenizeConfig(
            inputs=(str(CORPUS),), output_prefix=str(base / "corpus"), tokenizer=str(folder), workers=1, progress=False
        )
    )
    shard_stage.run(
        ShardConfig(
            sources=((str(base / "corpus"), 1.0),),
            output=str(base / "shards"),
            seq_len=32,
            split=(80.0, 10.0, 10.0),
            progress=False,
        )
    )
    return base / "corpus", base / "shards"


def _model(tmp_path: Path, hf_shards: tuple[Path, Path], **changes: object) -> Path:
    tok = Path(json.loads(Path(str(hf_shards[0]) + ".manifest.json").read_text())["tokenizer"]["path"]).parent
    folder = write_model("qwen2", tmp_path / "model", tok / "tokenizer")
    raw = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**raw, **changes}))
    return folder


def test_pretrain_refuses_data_of_another_tokenizer_before_launch(tmp_path: Path, hf_shards: tuple[Path, Path]) -> None:
    cfg_path = tmp_path / "c.yaml"
    for changes, expected in (
        ({"eos_token_id": 151643}, "end-of-sequence id is 2, the model's 151643"),
        ({"vocab_size": 500}, "601 tokens, the model's embedding 500"),
    ):
        folder = _model(tmp_path, hf_shards, **changes)
        cfg_path.write_text(
            f"run_dir: {tmp_path / 'run'}\nmodel: {{init_from: {folder}}}\n"
            f"data: {{path: {hf_shards[1]}}}\nbatch: {{global_batch_size: 2}}\n"
            "train: {max_steps: 1}\n"
        )
        with pytest.raises(PipelineError) as e:
            prepare(load(cfg_path), world_size=1)
        msg = str(e.value)
        assert expected in msg and str(folder) in msg and "manifest.json" in msg and "--tokenizer MODEL_DIR" in msg
    ok = _model(tmp_path, hf_shards)
    cfg_path.write_text(
        f"run_dir: {tmp_path / 'run'}\nmodel: {{init_from: {ok}}}\ndata: {{path: {hf_shards[1]}}}\n"
        "batch: {global_batch_size: 2}\ntrain: {max_steps: 1}\n"
    )
    prepared = prepare(load(cfg_path), world_size=1)
    assert prepared.shape.family == "qwen2" and prepared.shape.vocab_size == 640


def test_shard_with_model_refuses_another_tokenizer(tmp_path: Path, hf_shards: tuple[Path, Path]) -> None:
    folder = _model(tmp_path, hf_shards, eos_token_id=7)
    args = ["shard", str(hf_shards[0]), "--output", str(tmp_path / "s"), "--seq-len", "32", "--model", str(folder)]
    res = CliRunner().invoke(main, args)
    assert res.exit_code != 0 and "end-of-sequence id is 2, the model's 7" in res.output
    assert not (tmp_path / "s").exists()
    good = _model(tmp_path, hf_shards)
    res = CliRunner().invoke(main, [*args[:-1], str(good)])
    assert res.exit_code == 0, res.output


def test_plan_takes_a_hugging_face_config() -> None:
    res = CliRunner().invoke(
        main,
        [
            "plan",
            "--model",
            str(ROOT / "configs/hf/qwen2.5-7b.json"),
            "--hostfile",
            str(ROOT / "hostfiles/8node"),
            "--seq-len",
            "4096",
            "--tokens",
            "1B",
        ],
    )
    assert res.exit_code == 0, res.output
    assert "qwen2" in res.output and "7.62B parameters" in res.output and "28 layers" in res.output
    as_json = CliRunner().invoke(
        main,
        [
            "plan",
            "--model",
            str(ROOT / "configs/hf/qwen2.5-7b.json"),
            "--hostfile",
            str(ROOT / "hostfiles/8node"),
            "--json",
        ],
    )
    assert json.loads(as_json.output)["best"] is not None


def test_readme_recipe_plan_is_what_the_planner_prints() -> None:
    """The lines docs/continued-pretraining.md quotes for "continue Qwen2.5-7B" come from step 1 of its recipe, and the
    recipe's config fits the seed cluster as that page says."""
    readme = (ROOT / "docs" / "continued-pretraining.md").read_text()
    quoted = readme.split("<!-- qwen-plan -->")[1].strip().strip("`").strip().splitlines()
    res = CliRunner().invoke(
        main,
        [
            "plan",
            "--model",
            str(ROOT / "configs/hf/qwen2.5-7b.json"),
            "--hostfile",
            str(ROOT / "hostfiles/8node"),
            "--seq-len",
            "4096",
            "--tokens",
            "1B",
        ],
    )
    assert res.exit_code == 0, res.output
    printed = res.output.splitlines()
    assert len(quoted) == 4 and all(line in printed for line in quoted), quoted
    check = CliRunner().invoke(
        main,
        [
            "plan",
            "--config",
            str(ROOT / "configs/continue_qwen2.5-7b.yaml"),
            "--set",
            f"model.init_from={ROOT / 'configs/hf/qwen2.5-7b.json'}",
            "--seq-len",
            "4096",
            "--hostfile",
            str(ROOT / "hostfiles/8node"),
        ],
    )
    spare = re.search(r"checks the config itself: FITS, ([\d.]+) GiB to spare", " ".join(readme.split()))
    assert spare and check.exit_code == 0 and f"FITS: +{spare[1]} GiB" in check.output, check.output


def test_a_context_extension_reaches_the_model_and_its_export() -> None:
    """model.rope and model.max_position_embeddings: a preset gets YaRN scaling in its LlamaConfig (the rotary
    embedding transformers builds is YaRN's); Llama 3.1's own llama3 scaling keeps its fields under a new
    rope_theta; both are what the export's config.json says; a RoPE transformers would not build, and a declared
    context below the training seq_len, are refused naming the field."""
    from pipeline.errors import ConfigError
    from pipeline.model import build_model, model_config
    from pipeline.model.families import model_shape

    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
    shape = model_shape("tiny", {}, None, 500, 64, yarn, 256)
    config = model_config(shape)
    assert config.rope_parameters == {**yarn, "rope_theta": 10000.0} and config.max_position_embeddings == 256
    assert build_model(shape).model.rotary_emb.rope_type == "yarn"
    llama = str(ROOT / "configs/hf/llama-3.1-8b.json")
    longer = model_shape(None, {}, llama, None, 8192, {"rope_theta": 2_000_000.0}, 262144)
    written = model_config(longer).to_dict()  # what save_pretrained writes into config.json
    assert written["rope_parameters"]["rope_type"] == "llama3" and written["rope_parameters"]["factor"] == 8.0
    assert written["rope_parameters"]["rope_theta"] == 2_000_000.0 and written["max_position_embeddings"] == 262144
    untouched = model_shape(None, {}, llama, None, 8192).hf_config or {}
    assert untouched.get("rope_scaling") == json.loads(Path(llama).read_text())["rope_scaling"]
    with pytest.raises(ConfigError, match="model.rope.rope_type ntk: expected one of default, linear"):
        model_shape("tiny", {}, None, 500, 64, {"rope_type": "ntk"})
    with pytest.raises(ConfigError, match="model.max_position_embeddings 32 is below the shards' seq_len 64"):
        model_shape("tiny", {}, None, 500, 64, None, 32)
