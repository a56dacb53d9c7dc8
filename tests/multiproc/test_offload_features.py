"""DeepSpeed 0.19's offload features through the real launcher, on CPU ranks: bf16 master weights and optimizer
states (train, resume exactly, resume on another world size, the states really bf16 on disk), ZenFlow on ZeRO-2
(trains, resumes from a checkpoint on its update boundary on the same or another world size; its GPU-side states
measured against the planner) and activation offload (wired in, and exact: on the CPU accelerator it moves
nothing, so the losses are those of the run without it). What only a GPU can show (their speed) is in
bench/gpu_bench.py."""

from __future__ import annotations

import glob
import json
import shutil
from pathlib import Path

import pytest
import torch

from pipeline.plan.cluster import ZENFLOW_TOPK
from pipeline.plan.memory import ZENFLOW_STATE_BYTES
from pipeline.train.checkpoint import files as ckpt
from tests.multiproc import launch

pytestmark = pytest.mark.slow

BF16_STATES = {"bf16": {"bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}}
ZENFLOW = {
    "zenflow": {
        "topk_ratio": ZENFLOW_TOPK,
        "select_strategy": "step",
        "select_interval": 2,
        "update_interval": 2,
        "overlap_step": False,
        "full_warm_up_rounds": 0,
    }
}


def ds_file(tmp_path: Path, base: str, name: str, **sections: dict) -> Path:
    """A project DeepSpeed JSON with `sections` merged into its own (zero_optimization keys go inside it)."""
    ds = json.loads((launch.ROOT / "ds_configs" / base).read_text())
    for key, value in sections.items():
        ds.setdefault(key, {}).update(value)
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(ds))
    return path


def config(tmp_path: Path, name: str, shards: Path, ds: Path, *, precision: str = "fp32", **kw) -> Path:
    cfg = launch.write_config(
        tmp_path / f"{name}.yaml", run_dir=tmp_path / name, shards=shards, ds_config=str(ds), **kw
    )
    text = cfg.read_text().replace("precision: fp32", f"precision: {precision}")
    cfg.write_text(text)
    return cfg


def resume_from(run_dir: Path, tag: str, tmp_path: Path, cfg: Path) -> tuple[Path, str]:
    """A copy of `run_dir` cut back to checkpoint `tag`, trained on to the end with the same config."""
    copy = tmp_path / (run_dir.name + "-resumed")
    shutil.copytree(run_dir, copy)
    for later in ckpt.complete_tags(copy):
        if later > tag:
            shutil.rmtree(copy / later)
    again = cfg.with_name(cfg.stem + "-resumed.yaml")
    again.write_text(cfg.read_text().replace(f"run_dir: {run_dir}", f"run_dir: {copy}"))
    out = launch.run(again)
    log = out.stdout + out.stderr
    assert out.returncode == 0 and f"resumed from {copy}/{tag}" in log, log[-3000:]
    return copy, log


def test_bf16_master_weights_and_optimizer_states_train_resume_and_change_world_size(
    shards: Path, tmp_path: Path
) -> None:
    ds = ds_file(tmp_path, "zero2.json", "bf16states", zero_optimization={"offload_optimizer": {"device": "cpu"}})
    ds.write_text(json.dumps(json.loads(ds.read_text()) | BF16_STATES))
    cfg = config(tmp_path, "bf16states", shards, ds, precision="bf16", steps=10, ckpt_interval=5)
    out = launch.run(cfg)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    got = launch.losses(tmp_path / "bf16states")
    assert got[10] < got[1] - 0.3
    # What CPU Adam keeps and checkpoints is bf16: the moments and the master partition.
    (optim,) = glob.glob(str(tmp_path / "bf16states" / "step00000005" / "*zero_pp_rank_0_*optim_states.pt"))
    state = torch.load(optim, map_location="cpu", weights_only=False)["optimizer_state_dict"]
    moments = next(iter(state["base_optimizer_state"]["state"].values()))
    assert moments["exp_avg"].dtype == moments["exp_avg_sq"].dtype == torch.bfloat16
    assert state["single_partition_of_fp32_groups"][0].dtype == torch.bfloat16
    # The same world resumes bit for bit; another one through the universal checkpoint, continuing the run.
    copy, _ = resume_from(tmp_path / "bf16states", "step00000005", tmp_path, cfg)
    again = launch.losses(copy)
    assert [again[s] for s in range(6, 11)] == [got[s] for s in range(6, 11)]
    shutil.rmtree(copy)
    shutil.copytree(tmp_path / "bf16states", copy)
    shutil.rmtree(copy / "step00000010")
    cfg.with_name("one.yaml").write_text(
        cfg.read_text().replace(f"run_dir: {tmp_path / 'bf16states'}", f"run_dir: {copy}")
    )
    out = launch.run(cfg.with_name("one.yaml"), num_gpus=1)
    assert out.returncode == 0 and "now 1: through the universal checkpoint" in out.stdout + out.stderr
    one = launch.losses(copy)
    assert all(abs(one[s] - got[s]) < 0.02 * got[s] for s in range(6, 11)), [(one[s], got[s]) for s in range(6, 11)]


def test_zenflow_trains_resumes_and_holds_what_the_planner_counts(shards: Path, tmp_path: Path) -> None:
    """ZeRO-2 ZenFlow: 4 sequences per step (grad_accum 1), the other columns applied every 2 steps. A resume from
    a checkpoint on that boundary, by 2 ranks or by 1, continues within 2% (the GPU-side selective moments are not
    in DeepSpeed's checkpoint, and ZenFlow clears them at each reselection anyway). On a real bf16 engine its
    selective Adam holds what the planner counts: ZENFLOW_STATE_BYTES x topk_ratio x parameters, per rank."""
    ds = ds_file(
        tmp_path, "zero2.json", "zenflow", zero_optimization={"offload_optimizer": {"device": "cpu"}, **ZENFLOW}
    )
    cfg = config(tmp_path, "zenflow", shards, ds, steps=12, ckpt_interval=4, global_batch=4)
    out = launch.run(cfg)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    got = launch.losses(tmp_path / "zenflow")
    # It learns, more slowly than plain offload at this size (bench/offload_quality.py measures by how much).
    assert sum(got[s] for s in (10, 11, 12)) < sum(got[s] for s in (1, 2, 3)) - 0.15
    copy, _ = resume_from(tmp_path / "zenflow", "step00000008", tmp_path, cfg)
    again = launch.losses(copy)
    assert all(abs(again[s] - got[s]) < 0.02 * got[s] for s in range(9, 13)), [(again[s], got[s]) for s in range(9, 13)]
    # On another world size through the universal checkpoint: one rank of micro-batch 4 keeps 4 sequences a step
    # without gradient accumulation (which ZenFlow replaces).
    shutil.rmtree(copy)
    shutil.copytree(tmp_path / "zenflow", copy)
    shutil.rmtree(copy / "step00000012")
    one = cfg.with_name("one.yaml")
    one.write_text(cfg.read_text().replace(f"run_dir: {tmp_path / 'zenflow'}", f"run_dir: {copy}"))
    out = launch.run(one, num_gpus=1, sets=("batch.micro_batch_size=4",))
    assert out.returncode == 0 and "now 1: through the universal checkpoint" in out.stdout + out.stderr
    alone = launch.losses(copy)
    assert all(abs(alone[s] - got[s]) < 0.02 * got[s] for s in range(9, 13)), [(alone[s], got[s]) for s in range(9, 13)]

    bf16 = config(tmp_path, "zenflow-bf16", shards, ds, precision="bf16", steps=2, global_batch=4, ckpt_interval=2)
    cases = json.dumps([{"config": str(bf16)}])
    probe = launch.run_script(launch.ROOT / "tests" / "multiproc" / "engine_memory.py", cases, tmp_path / "out.json")
    assert probe.returncode == 0, probe.stdout[-3000:] + probe.stderr[-3000:]
    [measured] = json.loads((tmp_path / "out.json").read_text())
    planned = ZENFLOW_STATE_BYTES * ZENFLOW_TOPK * measured["psi"]
    assert measured["zenflow_selective"] == pytest.approx(planned, rel=0.1)


def test_activation_offload_is_wired_in_and_exact(shards: Path, tmp_path: Path) -> None:
    """activation_checkpointing.cpu_checkpointing runs each micro-step inside DeepSpeed's offload context (it marks
    every checkpointed layer input); on the CPU accelerator it moves nothing, so the losses equal the plain run's."""
    losses = {}
    for name, extra in (("plain", {}), ("offload", {"activation_checkpointing": {"cpu_checkpointing": True}})):
        ds = ds_file(tmp_path, "zero3_offload.json", name, **extra)
        cfg = config(tmp_path, name, shards, ds, steps=4)
        cfg.write_text(
            cfg.read_text().replace("loss_chunk_tokens: 48}", "loss_chunk_tokens: 48, activation_checkpointing: true}")
        )
        out = launch.run(cfg)
        log = out.stdout + out.stderr
        assert out.returncode == 0, log[-3000:]
        losses[name] = launch.losses(tmp_path / name)
        if name == "offload":
            assert "activation offload: 0 of 2 checkpointed layer inputs moved to host memory" in log, log[-3000:]
    assert losses["offload"] == losses["plain"] and len(losses["plain"]) == 4
