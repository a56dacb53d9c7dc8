"""pipeline.train.ds_config: the batch arithmetic against the world size."""

from __future__ import annotations

import pytest


def test_976_sequences_on_7_nodes_are_refused_with_the_choices() -> None:
    from pipeline.errors import ConfigError
    from pipeline.train.config import from_dict
    from pipeline.train.ds_config import batch_plan

    cfg = from_dict({"batch": {"micro_batch_size": 2, "global_batch_size": 976}, "train": {"max_steps": 1}})
    with pytest.raises(
        ConfigError,
        match=r"no micro_batch_size divides it on 7 ranks; or --set "
        r"batch.global_batch_size=966 or 980",
    ):
        batch_plan(cfg, 7, 4096)
    assert batch_plan(cfg, 8, 4096).grad_accum == 61
