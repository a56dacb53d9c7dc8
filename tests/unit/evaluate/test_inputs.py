"""pipeline.evaluate.inputs: the batch one device evaluates with, or the refusal; the prompts when none are given."""

from __future__ import annotations

import pytest
import torch

from pipeline.errors import PipelineError
from pipeline.evaluate.inputs import batch_for_card
from pipeline.model import PRESETS

GIB = 2**30


def test_one_card_evaluates_with_the_batch_that_fits_and_refuses_what_does_not_naming_zero3(caplog) -> None:
    """One process on a 24 GiB card: 1B at 2048 keeps batch 8; 7B at 32K evaluates with batch 1 (batch 8's MLP
    intermediates alone would be 5.4 GiB), said in a warning; 7B at 128K, where one sequence does not fit beside
    the model, and 70B at any length are one line naming the ZeRO-3 path across GPUs. The dense mask of
    whole-document samples is counted: 7B at 32K with it needs 3 GiB more at batch 1."""
    from pipeline.model import loss_chunk_tokens
    from pipeline.plan.memory import inference_bytes

    cuda = torch.device("cuda", 0)
    assert batch_for_card(PRESETS["1b"], 2048, 8, cuda, 22 * GIB, 24 * GIB) == 8
    with caplog.at_level("WARNING"):
        assert batch_for_card(PRESETS["7b"], 32768, 8, cuda, 23 * GIB, 24 * GIB) == 1
    assert "--batch-size 8 does not fit 23.0 GiB free on cuda:0 at seq 32768; evaluating with batch 1" in caplog.text
    with pytest.raises(
        PipelineError, match=r"one 131072-token sequence, cuda:0 has 23\.0 of 24\.0 GiB free.*--num-gpus N"
    ):
        batch_for_card(PRESETS["7b"], 131072, 8, cuda, 23 * GIB, 24 * GIB)
    with pytest.raises(PipelineError, match="with the dense mask of whole-document samples.*--hostfile HOSTFILE"):
        batch_for_card(PRESETS["7b"], 65536, 8, cuda, 23 * GIB, 24 * GIB, dense_mask=True)
    with pytest.raises(PipelineError, match="--hostfile"):
        batch_for_card(PRESETS["70b"], 4096, 8, cuda, 23 * GIB, 24 * GIB)
    assert batch_for_card(PRESETS["70b"], 4096, 8, torch.device("cpu"), 0, 0) == 8  # host RAM: as asked
    chunk = loss_chunk_tokens(32000)
    plain, masked = (inference_bytes(PRESETS["7b"], 32768, 1, 1, chunk, m) for m in (False, True))
    assert masked["mask"] == 3 * 32768**2 and masked["total"] - plain["total"] > 3 * GIB
    assert plain["static"] == 2 * PRESETS["7b"].num_params()  # one card: the whole model, nothing gathered


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
