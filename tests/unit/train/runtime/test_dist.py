"""pipeline.train.runtime.dist without a process group: each rank's device."""

from __future__ import annotations

import pytest
import torch

from pipeline.train.runtime.dist import device_for, local_rank_from_env


def test_each_rank_gets_the_gpu_of_its_local_rank() -> None:
    # Ranks 1..3 of a 4-GPU node must not land on cuda:0 (DeepSpeed selects no device at init_distributed).
    assert [device_for("cuda", local_rank_from_env({"LOCAL_RANK": str(r)})) for r in range(4)] == [
        torch.device("cuda", r) for r in range(4)
    ]
    assert device_for("cpu", 3) == torch.device("cpu")
    assert local_rank_from_env({}) == 0


@pytest.mark.parametrize(
    "physical, logical, ranks, args, threads",
    [
        (5, 10, 4, [], 2),  # the 4-card nodes' 10 vCPUs shown as 5 cores: DeepSpeed's binding gave 1 CPU a rank
        (10, 10, 4, [], 2),  # 2 of 10 would sit idle bound
        (5, 10, 2, ["--bind_cores_to_rank", "--bind_core_list", "0-9"], 5),
        (10, 10, 2, ["--bind_cores_to_rank"], 5),
        (16, 16, 1, ["--bind_cores_to_rank"], 16),
        (2, 2, 4, [], 1),
    ],
)
def test_cpu_adam_binding_leaves_no_cpu_idle(
    physical: int, logical: int, ranks: int, args: list[str], threads: int
) -> None:
    """F6 of the multi-node review: bind only where every logical CPU gets a rank, naming the logical CPUs when
    DeepSpeed would count physical cores; else unbound, the logical CPUs shared out as threads."""
    from deepspeed.utils.numa import parse_range_list

    from pipeline.train.runtime.dist import core_binding

    got_args, got_threads, why = core_binding(physical, logical, ranks)
    assert (got_args, got_threads) == (args, threads), why
    if "--bind_core_list" in got_args:  # what DeepSpeed gives each rank from that list: all of them, shared
        cpus = parse_range_list(got_args[-1])
        assert len(cpus) // ranks * ranks == logical
    if not got_args and logical % ranks and logical >= ranks:
        assert f"would leave {logical % ranks} idle" in why
