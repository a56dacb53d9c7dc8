"""pipeline.train.preflight: what `pipeline pretrain` refuses before launch, in one error."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from pipeline.cli import main


def test_pretrain_refuses_a_run_whose_checkpoints_do_not_fit_the_disk(tmp_path, shards) -> None:
    """70B at the fixture's vocabulary: a ZeRO-2 checkpoint is ~1.1 TB on the first node, more than this disk has."""
    import shutil

    if shutil.disk_usage(tmp_path).free > 2 * 10**12:
        pytest.skip("this disk has over 2 TB free")
    cfg = tmp_path / "c.yaml"
    cfg.write_text(
        f"run_dir: {tmp_path}/run\nmodel: {{preset: 70b}}\ndata: {{path: {shards}}}\n"
        "batch: {micro_batch_size: 1, global_batch_size: 2}\n"
        "train: {max_steps: 1, deepspeed_config: ds_configs/zero2.json}\n"
    )
    r = CliRunner().invoke(main, ["pretrain", "--config", str(cfg), "--num-gpus", "2", "--dry-run"])
    assert r.exit_code == 2 and "a checkpoint is" in r.output and "GB free" in r.output, r.output
    assert "checkpoint.keep_last" in r.output and not (tmp_path / "run").exists()
    r = CliRunner().invoke(
        main, ["pretrain", "--config", str(cfg), "--num-gpus", "2", "--dry-run", "--set", "checkpoint.enabled=false"]
    )
    assert r.exit_code == 0, r.output


def dry_run(tmp_path, shards, *sets: str, num_gpus: str = "2"):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(
        f"run_dir: {tmp_path}/run\nmodel: {{preset: tiny}}\ndata: {{path: {shards}}}\n"
        "batch: {micro_batch_size: 2, global_batch_size: 8}\noptim: {lr: 3.0e-3, warmup_steps: 3}\n"
        "train: {max_steps: 20, deepspeed_config: ds_configs/zero1.json}\n"
    )
    args = ["pretrain", "--config", str(cfg), "--num-gpus", num_gpus, "--dry-run"]
    return CliRunner().invoke(main, [*args, *(a for s in sets for a in ("--set", s))])


def test_values_that_make_no_sense_for_the_run_are_noted_before_launch(tmp_path, shards) -> None:
    """Legal, almost surely a mistake: each said in a note before the launch, the plain config says nothing."""
    import os

    plain = dry_run(tmp_path, shards)
    assert plain.exit_code == 0 and "note: " not in plain.output, plain.output
    cases = {
        "model.shape.max_seq_len=32": "model.shape.max_seq_len 32 is below the shards' seq_len 64",
        "train.max_steps=20000": "passes over the",
        "optim.lr=0.3": "optim.lr 0.3 is far from pretraining's 1e-5 to 1e-2",
        "optim.warmup_steps=50": "optim.warmup_steps 50 >= the run's 20 steps",
    }
    for override, said in cases.items():
        r = dry_run(tmp_path, shards, override)
        assert r.exit_code == 0 and said in r.output, (override, r.output)
    many = str((os.cpu_count() or 1) + 1)
    r = dry_run(tmp_path, shards, "batch.global_batch_size=" + str(8 * int(many)), num_gpus=many)
    assert f"{many} CPU ranks share this machine's" in r.output, r.output
