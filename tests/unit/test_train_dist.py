"""pipeline.train.dist without a process group: each rank's device."""

from __future__ import annotations

import torch

from pipeline.train.dist import device_for, local_rank_from_env


def test_each_rank_gets_the_gpu_of_its_local_rank() -> None:
    # Ranks 1..3 of a 4-GPU node must not land on cuda:0 (DeepSpeed selects no device at init_distributed).
    assert [device_for("cuda", local_rank_from_env({"LOCAL_RANK": str(r)})) for r in range(4)] == [
        torch.device("cuda", r) for r in range(4)
    ]
    assert device_for("cpu", 3) == torch.device("cpu")
    assert local_rank_from_env({}) == 0
