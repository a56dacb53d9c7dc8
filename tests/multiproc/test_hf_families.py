"""Continued pretraining of Hugging Face models (Llama 3.1, Mistral, Qwen2, Qwen3), each a tiny random model built
here and saved as its hub folder would be: through DeepSpeed's launcher on 2 CPU ranks, the engine starts from
exactly the model transformers loads (same loss on the same samples), trains, and exports a folder that transformers
reloads offline with the same architecture and the engine's logits.

What depends on the family (the weight mapping in and out, tied embeddings, head_dim, q/k norms) is checked for
each; what does not (ZeRO-1's load path, the engine's view of a saved checkpoint) once, on the families where it
could differ: ZeRO-1 frozen steps on Llama, the engine's own logits on Llama and on Qwen2, whose tied embedding is
the one ZeRO-3 partitions and consolidates differently. Each launch costs 13 s of a 2-core machine."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from pipeline.data import shard as shard_stage
from pipeline.data import tokenize as tokenizing
from pipeline.data.config import ShardConfig, TokenizeConfig
from pipeline.data.loader import ShardedDataset, collate_samples, rank_batches
from pipeline.evaluate.export import export
from pipeline.evaluate.inputs import EvalConfig, load_model, open_run
from pipeline.evaluate.run import run as evaluate_run
from pipeline.train.checkpoint import files as ckpt
from pipeline.train.step import lm_loss
from tests.conftest import CORPUS
from tests.hf_families import CONFIGS, FAMILIES, write_model, write_tokenizer
from tests.multiproc import launch

pytestmark = pytest.mark.slow

MICRO, GLOBAL = 2, 8
ZERO1_FROZEN = {"llama"}
"""Families whose ZeRO-1 load is checked step by step against transformers (the path is the family's mapping, which
ZeRO-3's first step checks for every family, then ZeRO-1's plain copy)."""
ENGINE_LOGITS = {"llama", "qwen2"}
"""Families whose export is compared with a real engine that loaded the checkpoint (2 ranks); the others with the
checkpoint as `pipeline evaluate` loads it, which llama and qwen2 show equal to the engine's."""


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tokenizer(tmp_path_factory.mktemp("hf") / "tokenizer")


def model_and_data(family: str, tokenizer: Path, base: Path) -> tuple[Path, Path]:
    """(model folder, shards): the fixture corpus tokenized with the model folder's own tokenizer (as a user does:
    `pipeline tokenize --tokenizer MODEL_DIR`; transformers picks the family's tokenizer class there), packed to 64
    tokens."""
    model_dir = write_model(family, base / family, tokenizer)
    tokenizing.run(
        TokenizeConfig(
            inputs=(str(CORPUS),),
            output_prefix=str(base / "corpus"),
            tokenizer=str(model_dir),
            workers=1,
            progress=False,
        )
    )
    shards = base / "shards"
    shard_stage.run(
        ShardConfig(
            sources=((str(base / "corpus"), 1.0),),
            output=str(shards),
            seq_len=64,
            split=(80.0, 10.0, 10.0),
            progress=False,
        )
    )
    return model_dir, shards


def transformers_losses(model_dir: Path, shards: Path, steps: int, seed: int = 1234) -> list[float]:
    """The loss transformers' own model (loaded by AutoModelForCausalLM, fp32) gives on each step's global batch."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32, local_files_only=True).eval()
    ds = ShardedDataset(shards, "train")
    it = rank_batches(len(ds), seed, MICRO, 1, 0, 0)
    out = []
    with torch.no_grad():
        for _ in range(steps):
            total = 0.0
            for _ in range(GLOBAL // MICRO):
                batch = collate_samples(ds, next(it))
                _, loss_total, tokens = lm_loss(model(input_ids=batch["input_ids"]).logits, batch["labels"])
                total += float(loss_total) / tokens
            out.append(total / (GLOBAL // MICRO))
    return out


def engine_logits(config: Path, tag: str, out: Path) -> dict[str, torch.Tensor]:
    cases = json.dumps([{"config": str(config), "tag": tag, "out": str(out)}])
    res = launch.run_script(Path(__file__).parent / "engine_logits.py", cases, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return torch.load(out)


EXACT = {"rtol": 1e-5, "atol": 1e-5}
GGUF_CHECKED = {"qwen2", "mistral"}
"""Families whose export of a continued run is converted to GGUF here and read back by transformers' GGUF loader,
which does not apply Llama 3.1's RoPE scaling and reads Qwen3's head size as 128 whatever the file says: llama.cpp
checks every family in tests/unit/evaluate/test_to_gguf_llama_cpp.py."""


def gguf_of_export(exported: Path, tmp: Path) -> Any:
    """`pipeline export --gguf f16` of the export, loaded back by transformers' GGUF loader (alone in its folder);
    its tokenizer read back as llama.cpp's BPE model names it."""
    from gguf import GGUFReader
    from transformers import AutoModelForCausalLM

    from pipeline.evaluate.to_gguf import write_gguf

    alone = tmp / "gguf"
    alone.mkdir()
    path = write_gguf(exported, alone / "m-f16.gguf", "f16")
    field = GGUFReader(str(path)).fields["tokenizer.ggml.model"]
    assert bytes(field.parts[field.data[0]]).decode() == "gpt2"
    return AutoModelForCausalLM.from_pretrained(str(alone), gguf_file=path.name, dtype=torch.float32).eval()


def zero1_frozen_steps_are_transformers_losses(model: str, shards: Path, reference: list[float], tmp: Path) -> None:
    """ZeRO-1 at a learning rate of 1e-30 (0 is refused as a config error; this one moves no fp32 weight): every
    step's loss is transformers' loss on the same samples."""
    frozen = tmp / "zero1"
    cfg = launch.write_config(
        tmp / "z1.yaml",
        run_dir=frozen,
        shards=shards,
        ds_config="zero1.json",
        steps=3,
        model=model,
        lr=1e-30,
        min_lr=1e-30,
        micro=MICRO,
        global_batch=GLOBAL,
    )
    out = launch.run(cfg, sets=("checkpoint.enabled=false",))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    got = launch.losses(frozen)
    for step in (1, 2, 3):
        assert abs(got[step] - reference[step - 1]) <= 1e-5 * reference[step - 1], (step, got, reference)


@pytest.mark.parametrize("family", FAMILIES)
def test_continued_pretraining_starts_from_the_model_trains_and_exports(
    family: str, tokenizer: Path, tmp_path: Path
) -> None:
    model_dir, shards = model_and_data(family, tokenizer, tmp_path)
    reference = transformers_losses(model_dir, shards, steps=3)
    model = f"{{init_from: {model_dir}}}"

    if family in ZERO1_FROZEN:
        zero1_frozen_steps_are_transformers_losses(model, shards, reference, tmp_path)

    # ZeRO-3 (the weights loaded into partitioned parameters) trains from the same start.
    run_dir = tmp_path / "zero3"
    cfg = launch.write_config(
        tmp_path / "z3.yaml",
        run_dir=run_dir,
        shards=shards,
        ds_config="zero3.json",
        steps=6,
        model=model,
        ckpt_interval=6,
        micro=MICRO,
        global_batch=GLOBAL,
    )
    out = launch.run(cfg, sets=("eval.interval=3",))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    got = launch.losses(run_dir)
    val = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if "val_loss" in line]
    assert [v["step"] for v in val] == [3, 6] and all(0 < v["val_loss"] < 10 for v in val)
    assert abs(got[1] - reference[0]) <= 1e-5 * reference[0], (got[1], reference[0])
    assert got[6] < got[1], got
    assert open_run(run_dir).shape.family == family

    # Export: the same architecture, loadable offline, with the engine's logits.
    from transformers import AutoModelForCausalLM, AutoTokenizer

    exported = export(str(run_dir), str(tmp_path / "export"), dtype="fp32")
    config = json.loads((exported / "config.json").read_text())
    assert config["model_type"] == family and config["architectures"] == CONFIGS[family]["architectures"]
    for key in (
        "hidden_size",
        "num_hidden_layers",
        "num_key_value_heads",
        "tie_word_embeddings",
        "head_dim",
        "vocab_size",
        "bos_token_id",
        "eos_token_id",
    ):
        if key in CONFIGS[family]:
            assert config[key] == CONFIGS[family][key], key
    if family == "llama":
        assert (config.get("rope_parameters") or config.get("rope_scaling"))["rope_type"] == "llama3"
    reloaded = AutoModelForCausalLM.from_pretrained(str(exported), dtype=torch.float32, local_files_only=True).eval()
    assert type(reloaded).__name__ == CONFIGS[family]["architectures"][0]
    theirs = AutoTokenizer.from_pretrained(str(exported), local_files_only=True)
    source = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    assert type(theirs) is type(source) and len(theirs) == len(source) and theirs.eos_token_id == 2
    assert theirs.encode("To be, or not to be") == source.encode("To be, or not to be")
    val_data = ShardedDataset(shards, "val")
    with torch.no_grad():
        ours = load_model(open_run(run_dir), torch.device("cpu"), val_data.manifest["tokenizer"])
        if family in ENGINE_LOGITS:
            tag = ckpt.latest_complete(run_dir)
            assert tag is not None
            expected = engine_logits(cfg, tag, tmp_path / "logits.pt")
            # the checkpoint as `pipeline evaluate` loads it in one process: the engine's logits
            torch.testing.assert_close(ours(input_ids=expected["input_ids"]).logits, expected["logits"], **EXACT)
        else:
            ids = torch.from_numpy(val_data[0][:-1].astype("int64"))[None]
            expected = {"input_ids": ids, "logits": ours(input_ids=ids).logits}
        torch.testing.assert_close(reloaded(input_ids=expected["input_ids"]).logits, expected["logits"], **EXACT)
        if family in GGUF_CHECKED:  # the export, as llama.cpp takes it: its BPE tokenizer and weights carried
            gguf_logits = gguf_of_export(exported, tmp_path)(input_ids=expected["input_ids"]).logits
            largest = expected["logits"].abs().max()
            # the export is fp32 here: f16 rounds each weight (measured 0.3% of the largest logit)
            assert (gguf_logits - expected["logits"]).abs().max() <= 1e-2 * largest

    # The trainer's validation and `pipeline evaluate` work for the family.
    res = evaluate_run(
        EvalConfig(checkpoint=str(run_dir), max_batches=2, output=str(tmp_path / "e.json"), max_new_tokens=4)
    )
    assert 0 < res["loss"] < 10 and res["tokens"] > 0


def test_an_architecture_trains_from_scratch_at_another_depth_and_exports_as_that_family(
    tokenizer: Path, tmp_path: Path
) -> None:
    """`model.architecture: MODEL_DIR` with `model.shape.num_layers`: Qwen3's architecture at 1 layer, fresh
    weights (its first loss is not the saved model's), trains through the launcher and exports as a Qwen3 of 1
    layer that transformers reloads."""
    from transformers import AutoModelForCausalLM

    model_dir, shards = model_and_data("qwen3", tokenizer, tmp_path)
    run_dir = tmp_path / "scratch"
    cfg = launch.write_config(
        tmp_path / "a.yaml",
        run_dir=run_dir,
        shards=shards,
        ds_config="zero2.json",
        steps=4,
        model=f"{{architecture: {model_dir}, shape: {{num_layers: 1}}}}",
        ckpt_interval=4,
        micro=MICRO,
        global_batch=GLOBAL,
    )
    out = launch.run(cfg, num_gpus=1)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    got = launch.losses(run_dir)
    assert abs(got[1] - transformers_losses(model_dir, shards, steps=1)[0]) > 0.01  # nothing loaded
    assert got[4] < got[1], got
    exported = export(str(run_dir), str(tmp_path / "export"), dtype="fp32")
    config = json.loads((exported / "config.json").read_text())
    assert (config["model_type"], config["num_hidden_layers"], config["head_dim"]) == ("qwen3", 1, 32)
    reloaded = AutoModelForCausalLM.from_pretrained(str(exported), local_files_only=True)
    assert type(reloaded).__name__ == "Qwen3ForCausalLM" and len(reloaded.model.layers) == 1
