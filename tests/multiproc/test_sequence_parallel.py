"""Sequence parallelism through the real launcher (CPU ranks, fp32): 2 ranks sharing each sample train step by step
the losses of 1 rank holding the whole sequence, under ZeRO-2 and under ZeRO-3 with parameters and optimizer
offloaded to the CPU (there with each MLP computed in tiles too); a checkpoint of such a run resumes on 4 ranks
with sequence parallel 2 and on 1 rank without it, the first resumed step's loss that of the uninterrupted run."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from pipeline.train.checkpoint import files as ckpt
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
    tmp_path: Path, name: str, shards: Path, ds_config: str, ranks: int, sp: int, tiles: int = 0
) -> tuple[Path, str]:
    run_dir = tmp_path / name
    cfg = launch.write_config(
        tmp_path / f"{name}.yaml", run_dir=run_dir, shards=shards, ds_config=ds_config, steps=STEPS, global_batch=4
    )
    out = launch.run(cfg, num_gpus=ranks, sets=(f"train.sequence_parallel={sp}", f"train.tiled_mlp={tiles}"))
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
