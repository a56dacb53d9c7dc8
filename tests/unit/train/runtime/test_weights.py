"""pipeline.train.runtime.weights: how parameters are grouped for ZeRO-3 filling."""

from __future__ import annotations

from pipeline.model import PRESETS, build_model
from pipeline.train.runtime.weights import parameter_groups


def test_parameter_groups_keep_order_and_bound_each_group() -> None:
    model = build_model(PRESETS["tiny"], skip_init=True)
    named = list(model.named_parameters())
    groups = list(parameter_groups(named, 20_000))
    assert [n for g in groups for n, _ in g] == [n for n, _ in named]
    for g in groups:
        sizes = [p.numel() for _, p in g]
        assert len(g) == 1 or sum(sizes) <= 20_000  # a larger tensor forms a group of its own
    assert any(len(g) > 1 for g in groups) and len(groups) < len(named)
    assert len(list(parameter_groups(named, 10**12))) == 1
