"""The pure functions of stage 2, no I/O: which documents go to which split, how documents become fixed-length
samples, how many samples each blended source gives, and which. pipeline.data.shard runs them over files."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import numpy as np

from pipeline.errors import PipelineError

SPLITS = ("train", "val", "test")


def split_documents(n_docs: int, ratios: tuple[float, float, float], seed: int, source: int) -> dict[str, np.ndarray]:
    """Pure: document ids per split; a seeded permutation cut at the cumulative ratios. Disjoint and complete."""
    perm = np.random.default_rng([seed, source, 0]).permutation(n_docs)
    total = sum(ratios)
    cuts = [0] + [round(n_docs * sum(ratios[: k + 1]) / total) for k in range(3)]
    return {name: perm[cuts[k] : cuts[k + 1]] for k, name in enumerate(SPLITS)}


def pack(
    docs: Iterable[np.ndarray], seq_len: int, cross_document: bool, pad_id: int, dtype: np.dtype
) -> Iterator[tuple[np.ndarray, np.ndarray | None, int]]:
    """Pure: yields (rows (k, seq_len+1), valid lengths or None, tokens dropped) blocks.

    cross_document: documents are concatenated and cut every seq_len+1 tokens; the final tail is dropped.
    Otherwise each document is cut on its own, its last piece padded with `pad_id` (valid length recorded so
    the loss mask excludes the padding); a 1-token piece has no label and is dropped.
    """
    width = seq_len + 1
    if cross_document:
        carry = np.zeros(0, dtype)
        batch: list[np.ndarray] = []
        size = 0
        for doc in docs:
            batch.append(np.asarray(doc))
            size += len(doc)
            if size >= width * 1024:
                stream = np.concatenate([carry, *batch]).astype(dtype, copy=False)
                n = len(stream) // width
                yield stream[: n * width].reshape(n, width), None, 0
                carry, batch, size = stream[n * width :].copy(), [], 0
        stream = np.concatenate([carry, *batch]).astype(dtype, copy=False) if batch or len(carry) else carry
        n = len(stream) // width
        if n:
            yield stream[: n * width].reshape(n, width), None, 0
        yield np.zeros((0, width), dtype), None, len(stream) - n * width
        return
    rows: list[np.ndarray] = []
    lens: list[int] = []
    dropped = 0
    for doc in docs:
        doc = np.asarray(doc)
        for start in range(0, len(doc), width):
            piece = doc[start : start + width]
            if len(piece) < 2:
                dropped += len(piece)
                continue
            row = np.full(width, pad_id, dtype)
            row[: len(piece)] = piece
            rows.append(row)
            lens.append(len(piece))
        if len(rows) >= 1024:
            yield np.stack(rows), np.asarray(lens, np.int32), dropped
            rows, lens, dropped = [], [], 0
    yield (np.stack(rows) if rows else np.zeros((0, width), dtype)), np.asarray(lens, np.int32), dropped


def blend_counts(available: list[int], weights: list[float] | None) -> list[int]:
    """Pure: samples drawn per source. Without weights, each source as it is; with weights, the total is kept
    and split in proportion, so a small heavily-weighted source repeats."""
    if weights is None:
        return list(available)
    total = sum(available)
    wsum = sum(weights)
    counts = [int(round(total * w / wsum)) for w in weights]
    for i, (c, a) in enumerate(zip(counts, available, strict=True)):
        if c and not a:
            raise PipelineError(f"source {i} has weight {weights[i]} but no training samples at this --seq-len")
    return counts


def draw(n_available: int, count: int, rng: np.random.Generator) -> np.ndarray:
    """Pure: `count` sample ids out of `n_available`: whole passes, then a random subset for the remainder."""
    if count == 0:
        return np.zeros(0, np.int64)
    full, rest = divmod(count, n_available)
    parts = [np.arange(n_available)] * full + [np.sort(rng.permutation(n_available)[:rest])]
    return np.concatenate(parts).astype(np.int64)
