"""pipeline.train.runtime.dist across two real ranks: rank 0 decides, every rank gets the same answer or the same
error."""

from __future__ import annotations

from typing import Any

import pytest

from tests.distributed.runner import run_distributed

pytestmark = pytest.mark.dist


def _decide(rank: int, world: int, mode: str) -> tuple[str, Any, list[int]]:
    from pipeline.errors import PipelineError
    from pipeline.train.runtime.dist import on_rank0

    called: list[int] = []

    def fn() -> dict[str, int]:
        called.append(rank)
        if mode == "user":
            raise PipelineError("checkpoint.resume step00000007: no complete checkpoint of that tag")
        if mode == "internal":
            raise ValueError("disk on fire")
        return {"decided_by": rank, "world": world}

    try:
        return "value", on_rank0(fn), called
    except PipelineError as e:
        return "PipelineError", str(e), called
    except Exception as e:  # noqa: BLE001 - the test looks at what each rank got
        return type(e).__name__, str(e), called


def test_rank0_decides_and_every_rank_gets_its_value() -> None:
    got = run_distributed(_decide, "value")
    assert [g[1] for g in got] == [{"decided_by": 0, "world": 2}] * 2
    assert [g[2] for g in got] == [[0], []]  # fn ran on rank 0 only


def test_a_user_error_on_rank0_is_the_same_error_on_every_rank() -> None:
    got = run_distributed(_decide, "user")
    assert {(g[0], g[1]) for g in got} == {
        ("PipelineError", "checkpoint.resume step00000007: no complete checkpoint of that tag")
    }


def test_an_internal_error_on_rank0_reaches_every_rank_instead_of_hanging_them() -> None:
    kinds = run_distributed(_decide, "internal", timeout=120)
    assert kinds[0][:2] == ("ValueError", "disk on fire")
    assert kinds[1][0] == "RuntimeError" and "rank 0 failed" in kinds[1][1] and "disk on fire" in kinds[1][1]
