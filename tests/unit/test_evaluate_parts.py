"""Evaluation's pure parts: whether one device holds a checkpoint, and how parameters are grouped for ZeRO-3
filling."""

from __future__ import annotations

import pytest
import torch

from pipeline.errors import PipelineError
from pipeline.evaluate.run import check_fits_device
from pipeline.model import PRESETS, build_model
from pipeline.train.weights import parameter_groups

GIB = 2**30


def test_a_checkpoint_larger_than_the_gpu_is_sent_to_zero3_across_ranks() -> None:
    cuda = torch.device("cuda", 0)
    check_fits_device(PRESETS["1b"], cuda, 22 * GIB, 24 * GIB)  # 2.2 GB in bf16
    with pytest.raises(PipelineError, match=r"needs 14\.6 GiB in bf16.*--num-gpus N.*--hostfile HOSTFILE"):
        check_fits_device(PRESETS["7b"], cuda, 12 * GIB, 24 * GIB)
    with pytest.raises(PipelineError, match="--hostfile"):
        check_fits_device(PRESETS["70b"], cuda, 23 * GIB, 24 * GIB)
    check_fits_device(PRESETS["70b"], torch.device("cpu"), 0, 0)  # host RAM: the one-process CPU path streams


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
