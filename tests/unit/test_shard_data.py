"""Stage 2 and the loader: split, pack, blend, shuffle, manifest, rerun rules, integrity, elastic order."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.data import shard as shard_stage
from pipeline.data import tokenize as tokenizing
from pipeline.data.config import ShardConfig, TokenizeConfig
from pipeline.data.indexed import IndexedReader
from pipeline.data.loader import ShardedDataset, build_loader, rank_batches
from pipeline.data.shard import blend_counts, pack, split_documents
from pipeline.errors import PipelineError
from tests.conftest import CORPUS


def _shard(sources, out: Path, **kw) -> shard_stage.ShardResult:
    srcs = tuple((str(p), w) for p, w in sources)
    return shard_stage.run(ShardConfig(sources=srcs, output=str(out), progress=False, **kw))


@given(
    n=st.integers(0, 500),
    r=st.tuples(st.integers(1, 100), st.integers(0, 20), st.integers(0, 20)),
    seed=st.integers(0, 2**31),
)
def test_split_is_disjoint_complete_and_seeded(n: int, r: tuple[int, int, int], seed: int) -> None:
    parts = split_documents(n, tuple(float(x) for x in r), seed, 0)  # type: ignore[arg-type]
    allv = np.concatenate(list(parts.values()))
    assert sorted(allv.tolist()) == list(range(n))
    again = split_documents(n, tuple(float(x) for x in r), seed, 0)  # type: ignore[arg-type]
    assert all(np.array_equal(parts[k], again[k]) for k in parts)
    assert abs(len(parts["train"]) - n * r[0] / sum(r)) <= 1


@given(lengths=st.lists(st.integers(1, 300), min_size=1, max_size=40), seq_len=st.integers(8, 64))
def test_cross_document_packing_is_exact(lengths: list[int], seq_len: int) -> None:
    rng = np.random.default_rng(0)
    docs = [rng.integers(4, 600, n).astype(np.uint16) for n in lengths]
    blocks = list(pack(docs, seq_len, True, 3, np.dtype(np.uint16)))
    rows = np.concatenate([b[0] for b in blocks])
    dropped = sum(b[2] for b in blocks)
    stream = np.concatenate(docs)
    assert rows.shape[1] == seq_len + 1
    assert dropped == len(stream) % (seq_len + 1) and dropped < seq_len + 1
    assert np.array_equal(rows.reshape(-1), stream[: len(stream) - dropped])


@given(lengths=st.lists(st.integers(1, 300), min_size=1, max_size=40), seq_len=st.integers(8, 64))
def test_no_cross_document_packing_pads_and_masks(lengths: list[int], seq_len: int) -> None:
    docs = [np.full(n, 10 + i, np.uint16) for i, n in enumerate(lengths)]  # each doc its own token value
    blocks = list(pack(docs, seq_len, False, 3, np.dtype(np.uint16)))
    rows = np.concatenate([b[0] for b in blocks])
    lens = np.concatenate([b[1] for b in blocks])
    for row, n in zip(rows, lens, strict=True):
        assert len(set(row[:n].tolist())) == 1, "a sample never mixes documents"
        assert (row[n:] == 3).all()
    assert int(lens.sum()) + sum(b[2] for b in blocks) == sum(lengths)


def test_shard_outputs_manifest_and_reader(shards: Path, tokenized: Path) -> None:
    m = json.loads((shards / "manifest.json").read_text())
    assert m["seq_len"] == 64 and len(m["fingerprint"]) == 16
    tok_docs = IndexedReader(tokenized)
    assert sum(m["splits"][s]["documents"] for s in ("train", "val", "test")) == len(tok_docs)
    for split in ("train", "val", "test"):
        dataset = ShardedDataset(shards, split)
        s = m["splits"][split]
        assert len(dataset) == s["samples"] > 0
        assert s["input_tokens"] == s["samples"] * 65 + s["dropped_tokens"]
        assert dataset[0].shape == (65,) and dataset.loss_mask(0) is None
    assert (shards / "tokenizer.model").exists()
    text = shard_stage.describe(shards)
    assert "train:" in text and "fingerprint" in text


def test_rerun_is_a_noop_and_other_args_are_refused(shards: Path, tokenized: Path, tmp_path: Path) -> None:
    out = tmp_path / "s"
    _shard([(tokenized, 1.0)], out, seq_len=32, split=(80.0, 10.0, 10.0))
    before = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    again = _shard([(tokenized, 1.0)], out, seq_len=32, split=(80.0, 10.0, 10.0))
    assert again.skipped and {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == before
    with pytest.raises(PipelineError, match="pass --overwrite"):
        _shard([(tokenized, 1.0)], out, seq_len=48, split=(80.0, 10.0, 10.0))
    res = _shard([(tokenized, 1.0)], out, seq_len=48, split=(80.0, 10.0, 10.0), overwrite=True)
    assert res.manifest["seq_len"] == 48 and res.manifest["fingerprint"] != again.manifest["fingerprint"]
    assert not list(out.glob(".tmp-*"))


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


def test_mixed_tokenizers_are_refused(tokenized: Path, tmp_path: Path) -> None:
    other = tmp_path / "other"
    tokenizing.run(
        TokenizeConfig(
            inputs=(str(CORPUS),), output_prefix=str(other), train_tokenizer=True, vocab_size=700, progress=False
        )
    )
    with pytest.raises(PipelineError, match="different tokenizers"):
        _shard([(tokenized, 1.0), (other, 1.0)], tmp_path / "mix", seq_len=32)


def test_blend_draws_in_proportion_and_repeats_small_sources(tokenized: Path, tmp_path: Path) -> None:
    lines = CORPUS.read_text().splitlines(keepends=True)
    model = str(tokenized) + ".tokenizer.model"
    for name, part in (("big", lines[:12] * 3), ("small", lines[12:])):
        (tmp_path / f"{name}.jsonl").write_text("".join(part))
        tokenizing.run(
            TokenizeConfig(
                inputs=(str(tmp_path / f"{name}.jsonl"),),
                output_prefix=str(tmp_path / name),
                tokenizer=model,
                progress=False,
            )
        )
    res = _shard(
        [(tmp_path / "big", 0.5), (tmp_path / "small", 0.5)],
        tmp_path / "blend",
        seq_len=32,
        split=(100.0, 0.0, 0.0),
        weights_given=True,
    )
    srcs = res.manifest["splits"]["train"]["sources"]
    drawn = [s["drawn_samples"] for s in srcs]
    assert abs(drawn[0] / sum(drawn) - 0.5) < 0.01
    assert srcs[1]["effective_epochs"] > 1.5 and srcs[0]["effective_epochs"] < 1.0
    assert blend_counts([100, 10], [0.7, 0.3]) == [77, 33]
    assert blend_counts([100, 10], None) == [100, 10]


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
    _shard([(tokenized, 1.0)], out, seq_len=64, cross_document=False)
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


def test_a_split_without_validation_is_said(tokenized: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("WARNING"):
        res = _shard([(tokenized, 1.0)], tmp_path / "s", seq_len=32, split=(100.0, 0.0, 0.0))
    assert res.manifest["splits"]["val"]["samples"] == 0
    assert "--split 100,0,0 leaves no validation split: training will run without validation" in caplog.text


def test_outputs_are_readable_by_the_group_as_the_umask_says(tokenized: Path, tmp_path: Path) -> None:
    """Runs and data often live on a shared mount: tokenize, shard and their manifests come out with a plain
    file's permissions (0644 under umask 022), not the owner-only 0600 of a temporary file."""
    import os
    import stat

    old = os.umask(0o022)
    try:
        tok = tmp_path / "t"
        tokenizing.run(
            TokenizeConfig(
                inputs=(str(CORPUS),),
                output_prefix=str(tok),
                tokenizer=str(tokenized) + ".tokenizer.model",
                progress=False,
            )
        )
        out = tmp_path / "s"
        _shard([(tok, 1.0)], out, seq_len=32, split=(80.0, 10.0, 10.0))
    finally:
        os.umask(old)
    made = [*tmp_path.glob("t.*"), out, *out.iterdir()]
    assert made and all(p.stat().st_mode & (stat.S_IRGRP | stat.S_IROTH) for p in made), [
        (p.name, oct(p.stat().st_mode)) for p in made
    ]


def test_a_held_out_split_too_small_to_compare_checkpoints_is_said(
    tokenized: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level("WARNING"):
        res = _shard([(tokenized, 1.0)], tmp_path / "s", seq_len=512, split=(98.0, 1.0, 1.0))
    val = res.manifest["splits"]["val"]["samples"]
    assert 0 < val < 32 and f"the val split has only {val} samples" in caplog.text
    assert "larger --split share (e.g. 90,5,5)" in caplog.text
