"""pipeline.train.prepare: the planner's card for this GPU under a memory cap."""

from __future__ import annotations

import pytest

from pipeline.errors import PipelineError


def test_auto_plan_uses_the_memory_cap() -> None:
    from pipeline.train.prepare import planning_card

    h200 = 143 * 10**9
    assert planning_card("NVIDIA H200", h200, None).memory_gib == pytest.approx(h200 / 2**30)
    capped = planning_card("NVIDIA H200", h200, 24.0)
    assert capped.memory_gib == 24.0 and capped.bf16_tflops == 989.0
    with pytest.raises(PipelineError, match="no planner data for GPU 'NVIDIA Voodoo2'"):
        planning_card("NVIDIA Voodoo2", h200, None)
