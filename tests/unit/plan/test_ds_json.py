"""pipeline.plan.ds_json: the written DeepSpeed JSON carries the choice (and its features), reads back, and is
accepted by `pipeline pretrain`."""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path

from click.testing import CliRunner

from pipeline.cli import main
from pipeline.model import PRESETS, ModelShape
from pipeline.plan.cluster import Cluster, Layout
from pipeline.plan.estimate import estimate
from pipeline.plan.gpus import GPUS
from pipeline.train.setup.config import from_dict
from pipeline.train.setup.ds_config import batch_plan, resolve

ROOT = Path(__file__).resolve().parents[3]


SEED = Cluster(8, 1, GPUS["4090d"], 512 * 10**9)


def resolve_1b() -> ModelShape:
    return replace(PRESETS["1b"], vocab_size=32000)


def test_written_ds_config_is_accepted_by_pretrain(tmp_path: Path) -> None:
    out = tmp_path / "gen.json"
    r = CliRunner().invoke(
        main, ["plan", "--model", "70b", "--hostfile", str(ROOT / "hostfiles/8node"), "--write-ds-config", str(out)]
    )
    assert r.exit_code == 0, r.output
    assert "chosen: ZeRO-3 + cpu offload (opt, params) + ckpt" in r.output and "physical ceiling" in r.output
    ds = json.loads(out.read_text())
    assert ds["zero_optimization"]["reduce_bucket_size"] <= 2e8
    # with the settings the command says to put in the pretrain config
    said = re.search(
        r"set batch.micro_batch_size: (\d+), batch.global_batch_size: (\d+), train.activation_checkpointing: true",
        r.output,
    )
    assert said, r.output
    micro, global_batch = int(said[1]), int(said[2])
    cfg = from_dict(
        {
            "batch": {"micro_batch_size": micro, "global_batch_size": global_batch},
            "train": {"max_steps": 1, "activation_checkpointing": True},
        }
    )
    resolved = resolve(cfg, ds, batch_plan(cfg, 8, 4096), accelerator="cuda")
    assert resolved["gradient_accumulation_steps"] == global_batch // (8 * micro) and resolved["bf16"]["enabled"]
    assert resolved["activation_checkpointing"]["cpu_checkpointing"] is True


def test_the_written_deepspeed_json_carries_the_features_and_reads_back() -> None:
    from pipeline.plan.ds_json import ds_config, layout_from_ds

    cand = replace(
        Layout(2, "cpu", "none", True, 4, 1),
        offload_activations=True,
        bf16_master=True,
        bf16_optimizer_states=True,
        zenflow_interval=8,
    )
    e = estimate(resolve_1b(), 2048, SEED, cand)
    ds = ds_config(e)
    assert ds["activation_checkpointing"] == {"cpu_checkpointing": True}
    assert ds["bf16"] == {"enabled": "auto", "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}
    assert ds["zero_optimization"]["zenflow"]["update_interval"] == 8
    assert ds["zero_optimization"]["zenflow"]["select_strategy"] == "step"
    back = layout_from_ds(ds, 4, 1, True)
    assert back.features() == cand.features() == {"activation-offload", "bf16-states", "zenflow"}
    assert back.zenflow_interval == 8
    # and our own validation takes it: ZeRO-2, CPU optimizer, one micro-step per step, integer intervals
    cfg = from_dict(
        {
            "batch": {"micro_batch_size": 4, "global_batch_size": 32},
            "train": {"max_steps": 1, "activation_checkpointing": True},
            "checkpoint": {"interval": 8},
        }
    )
    assert resolve(cfg, ds, batch_plan(cfg, 8, 2048), accelerator="cuda")["gradient_accumulation_steps"] == 1
