"""pipeline.evaluate.inputs: whether one device holds a checkpoint; the prompts when none are given."""

from __future__ import annotations

import pytest
import torch

from pipeline.errors import PipelineError
from pipeline.evaluate.inputs import check_fits_device
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


def test_without_prompts_the_evaluated_split_gives_them(shards) -> None:
    """`make eval` on your own run is not prompted with the demo's Shakespeare: with no --prompts, the starts of
    samples spread over the evaluated split are the prompts."""
    from pipeline.data.loader import ShardedDataset
    from pipeline.data.tokenizer import Tokenizer
    from pipeline.evaluate.inputs import prompts_from

    val = ShardedDataset(shards, "val")
    tok = Tokenizer(val.tokenizer_path)
    prompts = prompts_from(val, tok)
    assert 1 <= len(prompts) <= 4 and all(p.strip() for p in prompts)
    first = tok.decode([int(t) for t in val[0][:12] if int(t) != tok.eos_id]).strip()
    assert prompts[0] == first
