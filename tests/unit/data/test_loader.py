"""pipeline.data.loader: damaged shards detected, the same global batches for any world size, shifted labels and
loss masks."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.data.loader import ShardedDataset, build_loader, rank_batches
from pipeline.errors import PipelineError
from tests.conftest import shard_into


def _global_batches(n: int, seed: int, micro: int, world: int, accum: int, count: int, consumed: int = 0):
    its = [rank_batches(n, seed, micro, world, r, consumed) for r in range(world)]
    out = []
    for _ in range(count):
        batch = []
        for _ in range(accum):
            for it in its:
                batch.extend(next(it))
        out.append(sorted(batch))
    return out


def test_truncated_and_altered_shards_are_detected(shards: Path, tmp_path: Path) -> None:
    copy = tmp_path / "copy"
    shutil.copytree(shards, copy)
    f = copy / "train-00000.bin"
    data = bytearray(f.read_bytes())
    data[100] ^= 0xFF
    f.write_bytes(bytes(data))
    dataset = ShardedDataset(copy, "train")  # same size: opens
    with pytest.raises(PipelineError, match="checksum differs"):
        dataset.verify()
    f.write_bytes(bytes(data[:-10]))
    with pytest.raises(PipelineError, match="truncated or altered"):
        ShardedDataset(copy, "train")


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(16, 300),
    seed=st.integers(0, 1000),
    global_batch=st.sampled_from([8, 16, 32]),
    micro=st.sampled_from([1, 2]),
    skip=st.integers(0, 12),
)
def test_elastic_order_same_global_batches_for_any_world_size(
    n: int, seed: int, global_batch: int, micro: int, skip: int
) -> None:
    ref = _global_batches(n, seed, micro, 1, global_batch // micro, 20)
    for world in (2, 4, 8):
        if global_batch % (micro * world):
            continue  # not a valid batch plan; batch_plan refuses it
        accum = global_batch // (micro * world)
        assert _global_batches(n, seed, micro, world, accum, 20) == ref
        # resume at any global-batch boundary: no replay, nothing skipped
        assert _global_batches(n, seed, micro, world, accum, 20 - skip, skip * global_batch) == ref[skip:]
    flat = [i for b in ref for i in b]
    epoch = flat[: n - n % global_batch] if n >= global_batch else []
    assert len(set(epoch)) == len(epoch), "no sample repeats within an epoch"


def test_loader_gives_shifted_labels_and_masks(tmp_path: Path, tokenized: Path) -> None:
    out = tmp_path / "nocross"
    shard_into([(tokenized, 1.0)], out, seq_len=64, cross_document=False)
    dataset = ShardedDataset(out, "train")
    assert dataset.has_loss_mask
    padded = next(i for i in range(len(dataset)) if not dataset.loss_mask(i).all())  # type: ignore[union-attr]
    loader = build_loader(dataset, seed=1, micro_batch_size=2, data_parallel_size=1, rank=0, num_workers=0)
    batch = next(iter(loader))
    assert batch["input_ids"].shape == (2, 64) and batch["labels"].shape == (2, 64)
    first = next(rank_batches(len(dataset), 1, 2, 1, 0))
    assert batch["input_ids"][0].tolist() == dataset[first[0]][:-1].tolist()
    from pipeline.data.loader import collate_samples

    b = collate_samples(dataset, [padded])
    mask = dataset.loss_mask(padded)
    assert ((b["labels"][0] == -100).numpy() == ~mask[1:]).all()  # type: ignore[index]
