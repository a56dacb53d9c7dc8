"""pipeline.train.runtime.sequence and the batch arithmetic of sequence parallelism: each rank of a group keeps its
piece of every sample with the tokens' positions in the whole sample; a group is one data-parallel replica; what
cannot work is refused before launch, naming the field and the sizes that would."""

from __future__ import annotations

import pytest
import torch

from pipeline.errors import ConfigError
from pipeline.model import PRESETS
from pipeline.model import sequence_parallel_problems as problems
from pipeline.train.runtime.ds_workarounds import SequenceGroups, sequence_parallel_loss_factor
from pipeline.train.runtime.sequence import SequenceShard
from pipeline.train.setup.config import from_dict
from pipeline.train.setup.ds_config import batch_plan, resolve


def test_each_rank_of_a_group_keeps_its_piece_with_its_positions() -> None:
    ids = torch.arange(2 * 12).reshape(2, 12)
    batch = {"input_ids": ids, "labels": ids + 100}
    pieces = [SequenceShard.of(3, rank).shard(batch) for rank in (3, 4, 5)]  # the second group of 3: index 0, 1, 2
    assert torch.equal(torch.cat([p["input_ids"] for p in pieces], dim=1), ids)
    assert torch.equal(torch.cat([p["labels"] for p in pieces], dim=1), ids + 100)
    assert torch.equal(torch.cat([p["position_ids"] for p in pieces], dim=1), torch.arange(12).expand(2, 12))
    assert SequenceShard.of(1, 7).shard(batch) is batch  # off: the whole sample, no positions added


def test_a_group_is_one_data_parallel_replica() -> None:
    cfg = from_dict({"batch": {"micro_batch_size": 2, "global_batch_size": 16}, "train": {"max_steps": 1}})
    plain = batch_plan(cfg, 4, 64)
    shared = batch_plan(from_dict({**cfg.to_dict(), "train": {"max_steps": 1, "sequence_parallel": 2}}), 4, 64)
    assert (plain.data_parallel_size, plain.grad_accum) == (4, 2)
    assert (shared.data_parallel_size, shared.grad_accum, shared.sequence_parallel) == (2, 4, 2)
    assert shared.global_batch_size == plain.global_batch_size and shared.tokens_per_step == plain.tokens_per_step
    assert "2 ranks share each sample, 32 of its 64 tokens each; 2 data-parallel replica(s)" in shared.sequence_note


@pytest.mark.parametrize(
    "world, seq_len, sp, expected",
    [
        (6, 64, 4, r"train.sequence_parallel 4 does not divide the 6 ranks.*train.sequence_parallel=3"),
        (4, 66, 4, r"does not divide seq_len 66.*--seq-len that is a multiple of 4"),
    ],
)
def test_sizes_that_do_not_divide_are_refused_naming_what_would(
    world: int, seq_len: int, sp: int, expected: str
) -> None:
    cfg = from_dict(
        {"batch": {"micro_batch_size": 1, "global_batch_size": 8}, "train": {"max_steps": 1, "sequence_parallel": sp}}
    )
    with pytest.raises(ConfigError, match=expected):
        batch_plan(cfg, world, seq_len)
    with pytest.raises(ConfigError, match=r"train.sequence_parallel 0: expected 1"):
        from_dict({"train": {"max_steps": 1, "sequence_parallel": 0}})


def test_heads_that_do_not_split_are_refused() -> None:
    tiny = PRESETS["tiny"]  # 4 heads, 2 key/value heads
    assert problems(tiny, 1) == [] and problems(tiny, 2) == [] and problems(tiny, 4) == []  # kv replicated to 4
    (heads,) = problems(tiny, 3)[:1]
    assert "4 attention heads do not split over 3 ranks; use one of 2, 4" in heads
    seventy = PRESETS["70b"]  # 64 heads, 8 key/value heads: 2, 4, 8 split them, 16 replicates
    assert problems(seventy, 8) == [] and problems(seventy, 16) == []
    assert any("8 key/value heads" in p for p in problems(seventy, 12))


def test_zero3_scales_the_loss_and_refuses_the_path_that_would_not() -> None:
    assert sequence_parallel_loss_factor(3, 2) == 2.0 and sequence_parallel_loss_factor(3, 1) == 1.0
    assert sequence_parallel_loss_factor(2, 4) == 1.0
    cfg = from_dict(
        {"batch": {"micro_batch_size": 1, "global_batch_size": 2}, "train": {"max_steps": 1, "sequence_parallel": 2}}
    )
    plan = batch_plan(cfg, 4, 64)
    with pytest.raises(ConfigError, match="reduce_scatter false with train.sequence_parallel and ZeRO-3"):
        resolve(cfg, {"zero_optimization": {"stage": 3, "reduce_scatter": False}}, plan, accelerator="cpu")
    ds = resolve(cfg, {"zero_optimization": {"stage": 3}}, plan, accelerator="cpu")
    assert ds["sequence_parallel_size"] == 2 and ds["train_batch_size"] == 2  # DeepSpeed's world / 2 replicas
    assert SequenceGroups().get_tensor_model_parallel_world_size() == 1  # not tensor parallel in checkpoints
