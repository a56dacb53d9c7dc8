"""The pure functions of stage 2, no I/O: which documents go to which split, how documents become fixed-length
samples, how many samples each blended source gives, and which. pipeline.data.shard runs them over files."""

from __future__ import annotations

import bisect
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


OPEN_SAMPLES = 256
"""Whole-document packing keeps this many part-filled samples open for the next documents (best fit among them)."""


def pack_whole(
    docs: Iterable[np.ndarray], seq_len: int, pad_id: int, dtype: np.dtype, open_samples: int = OPEN_SAMPLES
) -> Iterator[tuple[np.ndarray, np.ndarray, int]]:
    """Pure: yields (rows (k, seq_len+1), valid lengths, tokens dropped) blocks, each document whole in one row.

    Documents of up to seq_len+1 tokens are never cut: each goes into the open row with the least room that holds
    it (best fit among `open_samples` open rows; a new row when none does; the fullest row is closed when too many
    are open), so a row holds several whole documents, then padding. A longer document fills whole rows of its own
    and its remainder is placed like a document. A 1-token piece has no label and is dropped. The documents in a
    row are told apart by the EOS each ends with (pipeline.data.loader masks attention and the loss there)."""
    width = seq_len + 1
    open_rows: list[tuple[int, int]] = []  # (room left, row id), sorted
    contents: dict[int, list[np.ndarray]] = {}
    rows: list[np.ndarray] = []
    lens: list[int] = []
    dropped = 0
    next_id = 0

    def close(row_id: int) -> None:
        parts = contents.pop(row_id)
        row = np.full(width, pad_id, dtype)
        filled = np.concatenate(parts) if len(parts) > 1 else parts[0]
        row[: len(filled)] = filled
        rows.append(row)
        lens.append(len(filled))

    for doc in docs:
        doc = np.asarray(doc)
        full = len(doc) // width if len(doc) > width else 0
        for k in range(full):
            contents[-1] = [doc[k * width : (k + 1) * width]]
            close(-1)
        piece = doc[full * width :]
        if len(piece) < 2:
            dropped += len(piece)
        else:
            at = bisect.bisect_left(open_rows, (len(piece), -1))
            if at < len(open_rows):
                room, row_id = open_rows.pop(at)
            else:
                room, row_id, next_id = width, next_id, next_id + 1
                contents[row_id] = []
            contents[row_id].append(piece)
            room -= len(piece)
            if room >= 2:
                bisect.insort(open_rows, (room, row_id))
            else:
                close(row_id)
            if len(open_rows) > open_samples:
                close(open_rows.pop(0)[1])
        if len(rows) >= 1024:
            yield np.stack(rows), np.asarray(lens, np.int32), dropped
            rows, lens, dropped = [], [], 0
    for _, row_id in sorted(open_rows, key=lambda r: r[1]):
        close(row_id)
    yield (np.stack(rows) if rows else np.zeros((0, width), dtype)), np.asarray(lens, np.int32), dropped


def length_buckets(lengths: np.ndarray, mix: tuple[tuple[int, float], ...]) -> np.ndarray:
    """Pure: each document's bucket under a length mix ((shortest length, weight), ... ascending): 0 for documents
    shorter than the first edge, k for those at least the k-th edge long."""
    return np.searchsorted(np.asarray([e for e, _ in mix], np.int64), lengths, side="right")


def bucket_counts(available: list[int], weights: list[float], count: int) -> list[int]:
    """Pure: `count` samples of one source split over its length buckets in proportion to available x weight, so
    a bucket of weight 3 is drawn three times as often for its size as one of weight 1 (the source's total kept)."""
    shares = [a * w for a, w in zip(available, weights, strict=True)]
    total = sum(shares)
    if not total:
        return [0] * len(available)
    counts = [int(count * s // total) for s in shares]
    rest = count - sum(counts)
    for i in sorted(range(len(shares)), key=lambda i: -(count * shares[i] / total - counts[i]))[:rest]:
        counts[i] += 1  # largest remainders, so the total is exact
    return counts


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
