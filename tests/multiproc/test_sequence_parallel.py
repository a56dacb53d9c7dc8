"""Sequence parallelism through the real launcher (CPU ranks, fp32): 2 ranks sharing each sample train step by step
the losses of 1 rank holding the whole sequence, under ZeRO-2 and under ZeRO-3 with parameters and optimizer
offloaded to the CPU (there with each MLP computed in tiles too); a checkpoint of such a run resumes on 4 ranks
with sequence parallel 2 and on 1 rank without it, the first resumed step's loss that of the uninterrupted run.

Masks that Ulysses drops: whole-document samples and a Mistral with a sliding window shorter than the sample, shared
by 2 ranks on the varlen path (pipeline.model.varlen), train the losses of 1 rank on SDPA with transformers' dense
mask (the model's own definition); on SDPA under sequence parallelism, or with a RoPE whose frequencies depend on
the local length, `pipeline pretrain` refuses in one line before launch."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

from pipeline.train.checkpoint import files as ckpt
from tests.hf_families import MISTRAL_WINDOW_16
from tests.multiproc import launch

# on one test worker: the 1-rank reference run is shared (a module fixture), and two workers would each make it
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("sequence_parallel")]
STEPS = 10


def offload_config(tmp_path: Path) -> str:
    ds = json.loads((launch.ROOT / "ds_configs" / "zero3_offload.json").read_text())
    assert ds["zero_optimization"]["offload_param"]["device"] == "cpu"
    assert ds["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    path = tmp_path / "zero3_offload.json"
    path.write_text(json.dumps(ds))
    return str(path)


def assert_same_losses(got: dict[int, float], want: dict[int, float], steps: range, rel: float = 1e-5) -> None:
    assert set(steps) <= set(got), sorted(got)
    bad = [(s, got[s], want[s]) for s in steps if abs(got[s] - want[s]) > rel * abs(want[s])]
    assert not bad, bad


def run_sp(
    tmp_path: Path,
    name: str,
    shards: Path,
    ds_config: str,
    ranks: int,
    sp: int,
    tiles: int = 0,
    sets: tuple[str, ...] = (),
    model: str = "{preset: tiny}",
) -> tuple[Path, str]:
    run_dir = tmp_path / name
    cfg = launch.write_config(
        tmp_path / f"{name}.yaml",
        run_dir=run_dir,
        shards=shards,
        ds_config=ds_config,
        steps=STEPS,
        global_batch=4,
        model=model,
    )
    sets = (f"train.sequence_parallel={sp}", f"train.tiled_mlp={tiles}", *sets)
    out = launch.run(cfg, num_gpus=ranks, sets=sets)
    log = out.stdout + out.stderr
    assert out.returncode == 0, log[-4000:]
    return run_dir, log


@pytest.fixture(scope="module")
def one_rank(shards: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The reference: 1 rank holding each whole sequence, ZeRO-2."""
    run_dir, _ = run_sp(tmp_path_factory.mktemp("one_rank"), "one", shards, "zero2.json", ranks=1, sp=1)
    return run_dir


@pytest.mark.parametrize("stage", ["zero2", "zero3_offload"])
def test_two_ranks_sharing_each_sample_train_the_losses_of_one_rank(
    shards: Path, tmp_path: Path, stage: str, one_rank: Path
) -> None:
    ds = offload_config(tmp_path) if stage == "zero3_offload" else "zero2.json"
    one = run_sp(tmp_path, "one", shards, ds, ranks=1, sp=1)[0] if stage == "zero3_offload" else one_rank
    # under ZeRO-3 the shared run also computes each MLP in 4 tiles (the long-context memory saver), exactly
    shared, log = run_sp(tmp_path, "shared", shards, ds, ranks=2, sp=2, tiles=4 if stage == "zero3_offload" else 0)
    assert "sequence parallel 2: 2 ranks share each sample" in log, log[-3000:]
    assert ("tiled MLP: each layer's MLP in 4 tiles" in log) == (stage == "zero3_offload")
    assert_same_losses(launch.losses(shared), launch.losses(one), range(1, STEPS + 1))
    val = [json.loads(line) for line in (shared / "metrics.jsonl").read_text().splitlines() if "val_loss" in line]
    ref = [json.loads(line) for line in (one / "metrics.jsonl").read_text().splitlines() if "val_loss" in line]
    assert val and [v["val_loss"] for v in val] == pytest.approx([r["val_loss"] for r in ref], rel=1e-5)
    marker = ckpt.read_marker(shared, f"step{STEPS:08d}")
    assert marker["consumed_samples"] == STEPS * 4 and marker["world_size"] == 2


def test_a_sequence_parallel_checkpoint_resumes_on_4_ranks_and_on_1(
    shards: Path, tmp_path: Path, one_rank: Path
) -> None:
    """Killed after step 7 of 10 (step 5 the latest checkpoint), a copy of the run folder resumes on 4 ranks with
    sequence parallel 2 and another on 1 rank without it; every step's loss is the uninterrupted run's."""
    want = launch.losses(one_rank)
    killed = tmp_path / "killed"
    cfg = launch.write_config(
        tmp_path / "killed.yaml", run_dir=killed, shards=shards, ds_config="zero2.json", steps=STEPS, global_batch=4
    )
    out = launch.run(
        cfg, num_gpus=2, sets=("train.sequence_parallel=2",), extra_env={"PIPELINE_FAULT_KILL_AT_STEP": "7"}
    )
    assert out.returncode != 0 and ckpt.latest_complete(killed) == "step00000005"
    for after, sp_after in ((4, 2), (1, 1)):
        run_dir = tmp_path / f"to{after}"
        shutil.copytree(killed, run_dir)  # a run folder copied, as a user branches one
        cfg = launch.write_config(
            tmp_path / f"to{after}.yaml",
            run_dir=run_dir,
            shards=shards,
            ds_config="zero2.json",
            steps=STEPS,
            global_batch=4,
        )
        out = launch.run(cfg, num_gpus=after, sets=(f"train.sequence_parallel={sp_after}",))
        log = out.stdout + out.stderr
        assert out.returncode == 0, log[-4000:]
        assert f"saved by 2 ranks, now {after}" in log
        assert_same_losses(launch.losses(run_dir), want, range(1, STEPS + 1))
        assert ckpt.read_marker(run_dir, f"step{STEPS:08d}")["consumed_samples"] == STEPS * 4


@pytest.fixture(scope="module")
def whole_documents(tokenized: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Samples of 64 tokens packed with whole documents (positions restart at each), as `shard --whole-documents`."""
    from tests.conftest import shard_into

    out = tmp_path_factory.mktemp("whole") / "seq64"
    shard_into(
        [(tokenized, 1.0)], out, seq_len=64, split=(80.0, 10.0, 10.0), cross_document=False, whole_documents=True
    )
    return out


def environment(run_dir: Path) -> dict:
    return json.loads((run_dir / "environment.json").read_text())


@pytest.mark.parametrize("case", ["whole_documents", "sliding_window"])
def test_masks_ulysses_drops_are_kept_on_the_varlen_path_two_ranks_train_the_dense_mask_losses_of_one(
    case: str, shards: Path, whole_documents: Path, tmp_path: Path
) -> None:
    """Whole-document samples (tiny Llama), and a Mistral with sliding_window 16 at seq 64: 1 rank on SDPA with
    transformers' dense mask (document_attention dense: the model's own definition) against 2 ranks sharing each
    sample on the varlen path (auto); every step's loss and the validation losses equal within 1e-5."""
    if case == "whole_documents":
        data, model = whole_documents, "{preset: tiny}"
        said = "documents apart (whole-document shards)"
    else:
        arch = tmp_path / "mistral.json"
        arch.write_text(json.dumps(MISTRAL_WINDOW_16))
        data, model = shards, f"{{architecture: {arch}}}"
        said = "a sliding window of 16"
    one, one_log = run_sp(
        tmp_path, "one", data, "zero2.json", ranks=1, sp=1, sets=("train.document_attention=dense",), model=model
    )
    shared, log = run_sp(tmp_path, "shared", data, "zero2.json", ranks=2, sp=2, model=model)
    assert f"attention masks: {said} through SDPA with a dense mask" in one_log, one_log[-3000:]
    assert f"attention masks: {said}, kept from the tokens' positions by a per-document reference" in log
    assert environment(one)["speed"]["attention_masks"] == "dense"
    for rank in environment(shared)["ranks"]:  # every rank's allocator (pipeline.train.runtime.env)
        assert rank["env"]["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    assert environment(shared)["speed"]["attention_masks"] == "varlen"
    assert_same_losses(launch.losses(shared), launch.losses(one), range(1, STEPS + 1))
    val = [
        json.loads(line)["val_loss"]
        for line in (shared / "metrics.jsonl").read_text().splitlines()
        if "val_loss" in line
    ]
    ref = [
        json.loads(line)["val_loss"] for line in (one / "metrics.jsonl").read_text().splitlines() if "val_loss" in line
    ]
    assert val and val == pytest.approx(ref, rel=1e-5)


def test_what_sequence_parallelism_would_silently_change_is_refused_in_one_line_before_launch(
    shards: Path, whole_documents: Path, tmp_path: Path
) -> None:
    """`pipeline pretrain --num-gpus 2` with sequence parallel 2: a longrope RoPE, and whole documents or a sliding
    window kept on SDPA (document_attention dense) exit 2 with one line naming the field and the way out, before
    the launcher starts (no run folder)."""
    import subprocess

    arch = tmp_path / "mistral.json"
    arch.write_text(json.dumps(MISTRAL_WINDOW_16))
    half = 8  # tiny's head_dim 16 / 2
    longrope = (
        "{preset: tiny, rope: {rope_type: longrope, original_max_position_embeddings: 32, "
        f"short_factor: {[1.0] * half}, long_factor: {[2.0] * half}}}}}"
    )
    cases = {
        "longrope": (shards, longrope, (), "the model's RoPE (longrope) picks its frequencies"),
        "documents": (whole_documents, "{preset: tiny}", ("train.document_attention=dense",), "--whole-documents"),
        "window": (shards, f"{{architecture: {arch}}}", ("train.document_attention=dense",), "sliding window of 16"),
    }
    for name, (data, model, sets, said) in cases.items():
        run_dir = tmp_path / name
        cfg = launch.write_config(
            tmp_path / f"{name}.yaml", run_dir=run_dir, shards=data, ds_config="zero2.json", model=model
        )
        args = ["--config", str(cfg), "--num-gpus", "2", "--set", "train.sequence_parallel=2"]
        args += [a for s in sets for a in ("--set", s)]
        out = subprocess.run(
            [str(Path(sys.executable).parent / "pipeline"), "pretrain", *args],
            env=launch.env(),
            capture_output=True,
            text=True,
            cwd=launch.ROOT,
        )
        lines = [line for line in out.stderr.splitlines() if "train.sequence_parallel 2:" in line]
        assert out.returncode == 2, (name, out.stdout[-2000:], out.stderr[-2000:])
        assert len(lines) == 1 and said in lines[0], (name, out.stderr[-2000:])
        assert "Traceback" not in out.stderr and not run_dir.exists()
