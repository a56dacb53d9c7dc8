"""pipeline.plan.report: what a plan prints (the assumed MFU, NVMe's resume limit) and the fits table of
docs/planning.md."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from pipeline.cli import main


def test_report_prints_the_assumed_mfu_it_was_given() -> None:
    r = CliRunner().invoke(main, ["plan", "--model", "7b", "--hostfile", "hostfiles/8node", "--mfu", "0.3"])
    assert (
        r.exit_code == 0
        and "(at 30% of peak" in r.output
        and "compute efficiency 30% of peak (given: --mfu)" in r.output
    )
    d = json.loads(CliRunner().invoke(main, ["plan", "--model", "7b", "--mfu", "0.3", "--json"]).output)
    assert d["mfu_assumed"] == 0.3


def test_an_nvme_plan_says_it_cannot_resume() -> None:
    args = ["plan", "--model", "configs/hf/qwen2.5-7b.json", "--gpus-per-node", "4", "--cpu-mem", "128GB"]
    r = CliRunner().invoke(main, [*args, "--nvme", "2TB"])
    assert r.exit_code == 0 and "chosen: ZeRO-3 + nvme offload" in r.output
    assert "this run cannot continue after a stop or a crash" in r.output


@pytest.mark.parametrize("doc, table", [("planning.md", "fits-table"), ("long-context.md", "long-context-table")])
def test_the_docs_tables_are_what_the_planner_says(doc: str, table: str) -> None:
    text = (Path(__file__).resolve().parents[3] / "docs" / doc).read_text()
    block = text.split(f"<!-- {table} -->")[1].strip()
    r = CliRunner().invoke(main, ["plan", f"--{table}"])
    assert r.exit_code == 0 and block == r.output.strip(), f"regenerate with `pipeline plan --{table}`"


def test_a_preset_says_whose_geometry_it_is_wherever_a_plan_prints_it() -> None:
    """The `70b` preset is Llama-2-70B's shape (32K vocabulary, 4K context), not the Llama-3.1-70B users continue at
    32K: its plan says so and names the config to plan instead; a Hugging Face config's plan names no preset, and a
    slice of a preset (other depth) is no longer it."""
    seventy = CliRunner().invoke(main, ["plan", "--model", "70b", "--seq-len", "8192", "--hostfile", "hostfiles/8node"])
    assert seventy.exit_code == 0
    assert "the 70b preset: Llama-2-70B's geometry: 32K vocabulary, 4K native context" in seventy.output
    assert "--model configs/hf/llama-3.1-70b.json" in seventy.output
    llama31 = CliRunner().invoke(main, ["plan", "--model", "configs/hf/llama-3.1-70b.json", "--seq-len", "8192"])
    assert llama31.exit_code in (0, 3) and "preset:" not in llama31.output
    sliced = CliRunner().invoke(main, ["plan", "--model", "70b", "--layers", "2"])
    assert sliced.exit_code == 0 and "preset:" not in sliced.output


def test_a_long_context_plan_buys_room_or_says_it_is_thin(monkeypatch) -> None:
    """7B at 192K on the rented 4x4 nodes: the fastest configuration leaves under 1.5 GiB after the margin, so
    the planner takes the fastest that leaves 1.5 GiB (it keeps 85% of the speed) and says what it passed over; where
    nothing roomy keeps that share (here: asked for 99%), the fastest is chosen and called thin, naming the roomy
    one with its speed beside."""
    import pipeline.plan.search as search_module

    args = ["plan", "--model", "7b", "--seq-len", "196608", "--hostfile", "hostfiles/4node4gpu"]
    r = CliRunner().invoke(main, args)
    (room,) = [x for x in r.output.splitlines() if x.strip().startswith("room:")]
    free = float(room.split("chosen for the ")[1].split(" GiB")[0])
    assert free >= search_module.THIN_GIB and "at 196,608 tokens; the fastest that fits, " in room
    faster = float(room.rsplit(" at ", 1)[1].rstrip("x"))
    assert 1 < faster <= 1 / search_module.ROOM_TRADE
    assert "thin:" not in r.output
    monkeypatch.setattr(search_module, "ROOM_TRADE", 0.99)
    r = CliRunner().invoke(main, args)
    (line,) = [x for x in r.output.splitlines() if x.strip().startswith("thin:")]
    assert "GiB free after the margin at 196,608 tokens" in line and " leaves " in line and "tokens/s (0." in line
    short = CliRunner().invoke(main, ["plan", "--model", "7b", "--seq-len", "4096", "--hostfile", "hostfiles/8node"])
    assert "thin:" not in short.output and "room:" not in short.output
