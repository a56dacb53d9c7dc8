"""pipeline.evaluate.run: whether one device holds a checkpoint."""

from __future__ import annotations

import pytest
import torch

from pipeline.errors import PipelineError
from pipeline.evaluate.run import check_fits_device
from pipeline.model import PRESETS

GIB = 2**30


def test_a_checkpoint_larger_than_the_gpu_is_sent_to_zero3_across_ranks() -> None:
    cuda = torch.device("cuda", 0)
    check_fits_device(PRESETS["1b"], cuda, 22 * GIB, 24 * GIB)  # 2.2 GB in bf16
    with pytest.raises(PipelineError, match=r"needs 14\.6 GiB in bf16.*--num-gpus N.*--hostfile HOSTFILE"):
        check_fits_device(PRESETS["7b"], cuda, 12 * GIB, 24 * GIB)
    with pytest.raises(PipelineError, match="--hostfile"):
        check_fits_device(PRESETS["70b"], cuda, 23 * GIB, 24 * GIB)
    check_fits_device(PRESETS["70b"], torch.device("cpu"), 0, 0)  # host RAM: the one-process CPU path streams
