"""pipeline.plan.command (`pipeline plan`): JSON output, the refusal's exit code, --opt-in, a rounded batch said."""

from __future__ import annotations

import json

from click.testing import CliRunner

from pipeline.cli import main


def test_plan_cli_json_and_refusal_exit_code() -> None:
    r = CliRunner().invoke(main, ["plan", "--model", "7b", "--nodes", "1", "--json"])
    assert r.exit_code == 0
    d = json.loads(r.output)
    assert d["best"]["tokens_per_s"] <= d["best"]["ceiling_tokens_per_s"]
    r = CliRunner().invoke(main, ["plan", "--model", "70b", "--nodes", "1", "--cpu-mem", "512GB"])
    assert r.exit_code == 3 and "NOTHING FITS" in r.output


def test_plan_opt_in_flag() -> None:
    args = ["plan", "--model", "configs/hf/qwen2.5-7b.json", "--hostfile", "hostfiles/4node4gpu", "--seq-len", "4096"]
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 0 and "DeepSpeed 0.19 offload features" in r.output and "--opt-in bf16-states" in r.output
    r = CliRunner().invoke(main, [*args, "--opt-in", "bf16-states", "--json"])
    d = json.loads(r.output)
    assert d["opt_in"] == ["bf16-states"] and "bf16 master/states" in d["best"]["label"]
    assert CliRunner().invoke(main, [*args, "--opt-in", "fp8"]).exit_code == 2


def test_a_rounded_global_batch_is_said() -> None:
    r = CliRunner().invoke(
        main, ["plan", "--model", "7b", "--hostfile", "hostfiles/8node", "--global-batch-tokens", "3.1M"]
    )
    assert (
        r.exit_code == 0 and "3,100,000 tokens per step were asked for; whole micro-batches on 8 GPUs give" in r.output
    )


def test_a_sequence_length_takes_the_suffixes_sequence_lengths_are_said_in() -> None:
    """--seq-len 32k is 32,768 tokens (powers of two, as --length-mix and every long-context text says them), in
    plan and shard alike; a length that is none is one line naming the forms."""
    plans = [CliRunner().invoke(main, ["plan", "--model", "7b", "--seq-len", s, "--json"]) for s in ("32k", "32768")]
    assert all(r.exit_code == 0 for r in plans)
    assert plans[0].output == plans[1].output
    r = CliRunner().invoke(main, ["plan", "--model", "7b", "--seq-len", "32x"])
    assert r.exit_code == 2 and "'32x' is not a length in tokens: give e.g. 4096, 32k or 128K" in r.output
    r = CliRunner().invoke(main, ["shard", "x", "--output", "o", "--seq-len", "2M"])
    assert r.exit_code == 2 and "2M (2,097,152 tokens) is not in 8 to 1,048,576" in r.output
