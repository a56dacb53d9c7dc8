"""Fixtures of the multi-process tests: runs through the real `deepspeed` launcher that several tests share."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.multiproc import launch

STEPS = 20


@pytest.fixture(scope="session")
def zero_runs(shards: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    """One 20-step 2-rank run per ZeRO stage (fp32) through the deepspeed launcher, shared by several tests."""
    runs = {}
    base = tmp_path_factory.mktemp("zero")
    for stage in (1, 2, 3):
        run_dir = base / f"zero{stage}"
        cfg = launch.write_config(
            base / f"zero{stage}.yaml", run_dir=run_dir, shards=shards, ds_config=f"zero{stage}.json", steps=STEPS
        )
        out = launch.run(cfg)
        assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
        runs[stage] = run_dir
    return runs


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own hook reads the groups into the test ids
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Under `pytest -n 2` (make test) the tests that read the shared ZeRO runs go to one worker, so the three
    launches behind them run once."""
    for item in items:
        if "zero_runs" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.xdist_group("zero_runs"))
