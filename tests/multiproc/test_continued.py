"""Continued-pretraining recipes through the real launcher (CPU ranks, fp32): a warmup-stable-decay run extended
while stable trains the losses of one planned that long from the start; a data stage switches the shards at a step
with the sample order the same on 1, 2 and 3 ranks and across a kill and resume inside the second stage; a cooldown
branched from a stable checkpoint continues the source exactly (its steps 1..k are the source's, its first step's
loss the source's next) and leaves the source run folder untouched."""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

import pytest
import torch

from pipeline.train.checkpoint import files as ckpt
from tests.conftest import shard_into
from tests.multiproc import launch

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("continued")]
STEPS = 16
WSD = ("optim.schedule=wsd", "optim.decay_steps=4", "checkpoint.keep_last=10")


def assert_close(got: dict[int, float], want: dict[int, float], steps: range, rel: float = 1e-4) -> None:
    assert set(steps) <= set(got), sorted(got)
    bad = [(s, got[s], want[s]) for s in steps if abs(got[s] - want[s]) > rel * abs(want[s])]
    assert not bad, bad


def tree(path: Path) -> dict[str, str]:
    return {
        str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest() for p in path.rglob("*") if p.is_file()
    }


@pytest.fixture(scope="module")
def curated(tokenized: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A second shard set of the same tokens and seq_len, in another order: the "curated mix" of the stage."""
    out = tmp_path_factory.mktemp("curated") / "seq64"
    shard_into([(tokenized, 1.0)], out, seq_len=64, split=(80.0, 10.0, 10.0), seed=4321)
    return out


@pytest.fixture(scope="module")
def planned(shards: Path, curated: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, tuple[str, ...]]:
    """The reference: 16 steps of wsd (stable to 12) planned so from the start, the curated shards from step 4."""
    tmp = tmp_path_factory.mktemp("planned")
    sets = (*WSD, f"data.stages={{4: {curated}}}")
    run_dir = tmp / "planned"
    cfg = launch.write_config(
        tmp / "p.yaml", run_dir=run_dir, shards=shards, ds_config="zero2.json", steps=STEPS, micro=1, global_batch=6
    )
    out = launch.run(cfg, num_gpus=2, sets=sets)
    log = out.stdout + out.stderr
    assert out.returncode == 0, log[-4000:]
    assert "schedule wsd: warmup 3 steps from 0 to 0.003, stable to step 12" in log
    assert f"data stage 2 from step 4: {curated}, at its sample 0" in log
    return run_dir, sets


def test_extended_while_stable_across_a_stage_and_world_sizes_trains_the_planned_losses(
    shards: Path, tmp_path: Path, planned: tuple[Path, tuple[str, ...]]
) -> None:
    """Planned for 10 steps on 3 ranks (decay from step 6), killed after step 6 (checkpoint 5, inside the second
    data stage), then extended to 16 steps on 1 rank: the resume says the extension changes no trained rate, and
    every step's loss is the 2-rank run planned 16 steps long from the start."""
    reference, sets = planned
    run_dir = tmp_path / "extended"
    kw = dict(run_dir=run_dir, shards=shards, ds_config="zero2.json", micro=1, global_batch=6)
    short = launch.write_config(tmp_path / "short.yaml", steps=10, **kw)
    first = launch.run(short, num_gpus=3, sets=sets, extra_env={"PIPELINE_FAULT_KILL_AT_STEP": "6"})
    assert first.returncode != 0 and ckpt.latest_complete(run_dir) == "step00000005"
    longer = launch.write_config(tmp_path / "long.yaml", steps=STEPS, **kw)
    out = launch.run(longer, num_gpus=1, sets=sets)
    log = out.stdout + out.stderr
    assert out.returncode == 0, log[-4000:]
    assert "the run's length changed from 10 to 16 steps since step 5; no update already trained" in log
    assert "data stage 2 from step 4" in log and "at its sample 6" in log  # 5 steps x 6 samples, 4 of stage 1
    assert_close(launch.losses(run_dir), launch.losses(reference), range(1, STEPS + 1))
    marker = ckpt.read_marker(run_dir, f"step{STEPS:08d}")
    assert marker["consumed_samples"] == STEPS * 6 and marker["schedule"]["name"] == "wsd"


def test_a_cooldown_branched_from_a_stable_checkpoint_continues_it_and_leaves_it_untouched(
    shards: Path, tmp_path: Path, planned: tuple[Path, tuple[str, ...]]
) -> None:
    """Branched at step 10 into a new run folder with its own decay (steps 11-13): its history of steps 1-10 is
    the source's, its step 11 loss is the source's (same weights, same data position; the new rate acts from
    there), step 12 differs (the cooldown's rate), and not a byte of the source run folder changed."""
    source, sets = planned
    before = tree(source)
    run_dir = tmp_path / "cooldown"
    cfg = launch.write_config(
        tmp_path / "c.yaml", run_dir=run_dir, shards=shards, ds_config="zero2.json", steps=13, micro=1, global_batch=6
    )
    branch = (*sets, "optim.decay_steps=3", f"checkpoint.branch_from={source / 'step00000010'}")
    out = launch.run(cfg, num_gpus=2, sets=branch)
    log = out.stdout + out.stderr
    assert out.returncode == 0, log[-4000:]
    assert f"branched from {source / 'step00000010'}: step 10, 60 samples consumed" in log
    got, src = launch.losses(run_dir), launch.losses(source)
    assert [got[s] for s in range(1, 11)] == [src[s] for s in range(1, 11)]
    assert got[11] == pytest.approx(src[11], rel=1e-6)
    assert abs(got[12] - src[12]) > 1e-6
    assert ckpt.complete_tags(run_dir) == ["step00000013"] and tree(source) == before


def test_three_checkpoints_averaged_export_reload_and_evaluate_as_their_mean(
    tmp_path: Path, planned: tuple[Path, tuple[str, ...]]
) -> None:
    """`pipeline export --average last:3`: each weight is the mean of the three newest checkpoints' consolidated
    weights; the export reloads in transformers with those weights; `pipeline evaluate --average last:3` writes
    its own results file, naming the checkpoints, with a loss of its own."""
    from click.testing import CliRunner
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from pipeline.cli import main
    from pipeline.train.checkpoint.consolidate import consolidated_state, materialize

    source, _ = planned
    tags = ["step00000010", "step00000015", "step00000016"]
    out = CliRunner().invoke(
        main,
        [
            "export",
            "--checkpoint",
            str(source),
            "--output",
            str(tmp_path / "avg"),
            "--dtype",
            "fp32",
            "--average",
            "last:3",
        ],
    )
    assert out.exit_code == 0, out.output
    assert f"exported the mean of last:3 of {source}" in out.output
    got = load_file(tmp_path / "avg" / "model.safetensors")
    states = [consolidated_state(source, tag) for tag in tags]
    for name, tensor in got.items():
        want = sum(materialize(s[name]) for s in states) / 3
        torch.testing.assert_close(tensor, want, rtol=1e-6, atol=1e-7)
    last = materialize(states[-1]["model.embed_tokens.weight"])
    assert not torch.allclose(got["model.embed_tokens.weight"], last), "an average, not the last checkpoint"
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "avg", local_files_only=True)
    torch.testing.assert_close(model.model.embed_tokens.weight.detach(), got["model.embed_tokens.weight"])
    results = []
    for extra in ([], ["--average", "last:3"]):
        res = CliRunner().invoke(
            main, ["evaluate", "--checkpoint", str(source), "--device", "cpu", "--max-new-tokens", "0", *extra]
        )
        assert res.exit_code == 0, res.output
        results.append(res.output)
    averaged = json.loads((source / "eval" / "step00000016-avg3-val.json").read_text())
    single = json.loads((source / "eval" / "step00000016-val.json").read_text())
    assert averaged["averaged"] == tags and "averaged" not in single
    assert math.isfinite(averaged["loss"]) and averaged["loss"] != single["loss"]


def test_a_model_with_an_extended_vocabulary_trains_exports_and_reloads_with_its_tokenizer(tmp_path: Path) -> None:
    """extend-vocab -> tokenize with the extended folder -> shard --model -> pretrain from it -> export: the export's
    tokenizer holds the added pieces and round-trips the new script with them; its embedding holds every id."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pipeline.data import tokenize as tokenizing
    from pipeline.data.config import TokenizeConfig
    from pipeline.data.tokenizer import check_model_tokenizer
    from pipeline.data.vocab import VocabConfig, extend_vocabulary
    from pipeline.evaluate.export import export
    from tests.hf_families import write_model, write_tokenizer
    from tests.unit.data.test_vocab import thai_corpus

    model_dir = write_model("llama", tmp_path / "llama", write_tokenizer(tmp_path / "tok"))
    corpus = thai_corpus(tmp_path / "thai.jsonl")
    extended = tmp_path / "llama-th"
    res = extend_vocabulary(
        VocabConfig(model_dir=str(model_dir), inputs=(str(corpus),), output=str(extended), new_tokens=150)
    )
    prefix = tmp_path / "thai"
    tokenizing.run(
        TokenizeConfig(inputs=(str(corpus),), output_prefix=str(prefix), tokenizer=str(extended), progress=False)
    )
    check_model_tokenizer(str(extended), [str(prefix)])
    shards = tmp_path / "shards"
    shard_into([(prefix, 1.0)], shards, seq_len=64, split=(80.0, 10.0, 10.0))
    run_dir = tmp_path / "run"
    cfg = launch.write_config(
        tmp_path / "r.yaml",
        run_dir=run_dir,
        shards=shards,
        ds_config="zero2.json",
        steps=3,
        model=f"{{init_from: {extended}}}",
    )
    out = launch.run(cfg, num_gpus=1)
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    exported = export(str(run_dir), str(tmp_path / "export"), dtype="fp32")
    tok = AutoTokenizer.from_pretrained(exported, local_files_only=True)
    text = json.loads(corpus.read_text().splitlines()[1])["text"]
    ids = tok.encode(text, add_special_tokens=False)
    assert len(tok) == len(AutoTokenizer.from_pretrained(model_dir, local_files_only=True)) + res.added
    assert tok.decode(ids) == text and max(ids) >= len(tok) - res.added
    model = AutoModelForCausalLM.from_pretrained(exported, local_files_only=True)
    assert model.get_input_embeddings().weight.shape[0] >= len(tok)
