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
