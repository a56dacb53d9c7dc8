"""The planner's parameter, gradient and optimizer bytes against what a real 2-rank DeepSpeed engine holds."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeline.plan.memory import state_split
from tests.multiproc import launch

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


CASES = [("tiny", 2), ("125m", 2), ("tiny", 3), ("125m", 3)]


@pytest.fixture(scope="module")
def engines(shards: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, int], dict]:
    """The bytes of a real 2-rank bf16 engine for each case, all measured in one launch."""
    tmp = tmp_path_factory.mktemp("engines")
    cases = []
    for preset, stage in CASES:
        name = f"{preset}-zero{stage}"
        cfg = launch.write_config(
            tmp / f"{name}.yaml",
            run_dir=tmp / name,
            shards=shards,
            ds_config=f"zero{stage}.json",
            micro=1,
            global_batch=2,
        )
        cases.append({"config": str(cfg), "sets": [f"model.preset={preset}", "train.precision=bf16"]})
    res = launch.run_script(ROOT / "tests/multiproc/engine_memory.py", json.dumps(cases), tmp / "out.json")
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return dict(zip(CASES, json.loads((tmp / "out.json").read_text()), strict=True))


@pytest.mark.xdist_group("engines")  # under `pytest -n 2`, on one worker: the fixture's launch runs once
@pytest.mark.parametrize("preset,stage", CASES)
def test_model_state_bytes_match_a_real_engine(engines: dict[tuple[str, int], dict], preset: str, stage: int) -> None:
    measured = engines[preset, stage]
    assert measured["stage"] == stage
    planned = state_split(stage, measured["psi"], 2, False, False)
    for key in ("params", "grads", "optimizer"):
        assert measured[key] == pytest.approx(planned[key], rel=0.10), (key, measured, planned)


def test_from_run_puts_the_plan_beside_what_the_run_measured(zero_runs: dict[int, Path]) -> None:
    import statistics

    from click.testing import CliRunner

    from pipeline.cli import main

    run_dir = zero_runs[3]
    env = json.loads((run_dir / "environment.json").read_text())
    assert env["world_size"] == 2 and env["device"] == "cpu" and env["deepspeed"]
    r = CliRunner().invoke(main, ["plan", "--from-run", str(run_dir)])
    assert r.exit_code == 0, r.output
    assert "measured/planned" in r.output and "ZeRO-3" in r.output and "a CPU run" in r.output
    d = json.loads(CliRunner().invoke(main, ["plan", "--from-run", str(run_dir), "--json"]).output)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    # The trainer logs its own seconds per step and per optimizer step (training only; tokens/s over the interval
    # also holds validation and saves): the planner compares with those.
    steps = [row for row in rows if "tokens_per_s" in row][1:]
    assert all(0 < row["optimizer_s"] < row["step_s"] for row in steps)
    step_s = statistics.median(row["step_s"] for row in steps)
    assert d["step_time_s"]["measured"] == pytest.approx(step_s)
    assert d["tokens_per_s"]["measured"] == pytest.approx(8 * 64 / step_s)  # global batch 8 x seq 64
    assert d["measured_rates"] is None and "a CPU run measures no GPU rates" in d["notes"][0]
    for key in ("peak_memory_gib", "step_time_s", "tokens_per_s"):
        assert d[key]["predicted"] > 0 and d[key]["ratio"] == pytest.approx(d[key]["measured"] / d[key]["predicted"])
    r = CliRunner().invoke(main, ["plan", "--from-run", str(run_dir), "--nodes", "1", "--gpus-per-node", "4"])
    assert r.exit_code == 2 and "the run had 2 ranks" in r.output


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_checkpoint_bytes_match_what_deepspeed_writes(zero_runs: dict[int, Path], stage: int) -> None:
    from pipeline.evaluate.inputs import open_run
    from pipeline.plan.memory import checkpoint_bytes

    run = open_run(zero_runs[stage])
    written = sum(f.stat().st_size for f in (run.run_dir / run.tag).iterdir() if f.suffix == ".pt")
    planned = checkpoint_bytes(run.shape, stage, 2, 2, module_bytes=4)  # fp32 run: a 4-byte module
    assert written == pytest.approx(planned["per_node"], rel=0.15), (written, planned)
