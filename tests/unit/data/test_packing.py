"""pipeline.data.packing: the split is disjoint, complete and seeded; packing across documents is exact, and
packing each document alone pads and masks its last piece."""

from __future__ import annotations

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from pipeline.data.packing import bucket_counts, length_buckets, pack, pack_whole, split_documents


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


@given(
    lengths=st.lists(st.integers(1, 200), min_size=1, max_size=60),
    seq_len=st.integers(8, 64),
    open_rows=st.sampled_from([1, 4, 256]),
)
def test_whole_document_packing_keeps_each_short_document_whole_in_one_row(
    lengths: list[int], seq_len: int, open_rows: int
) -> None:
    """Each document of up to seq_len + 1 tokens lands whole and contiguous in exactly one row (and a longer one
    fills rows of its own, its remainder placed whole); no token is lost but 1-token remainders; rows are padded
    after their documents; however few rows stay open."""
    width = seq_len + 1
    docs = [np.full(n, 10 + i, np.uint16) for i, n in enumerate(lengths)]  # each doc its own token value
    blocks = list(pack_whole(docs, seq_len, 3, np.dtype(np.uint16), open_rows))
    rows = np.concatenate([b[0] for b in blocks])
    lens = np.concatenate([b[1] for b in blocks])
    assert rows.shape[1] == width and (lens >= 2).all() and (lens <= width).all()
    seen: dict[int, list[int]] = {}
    for row, n in zip(rows, lens, strict=True):
        assert (row[n:] == 3).all(), "padding only after the documents"
        values, starts, counts = np.unique(row[:n], return_index=True, return_counts=True)
        for v, a, c in zip(values.tolist(), starts.tolist(), counts.tolist(), strict=True):
            assert (row[a : a + c] == v).all(), "a document's tokens are contiguous in its row"
            seen.setdefault(v - 10, []).append(c)
    for i, n in enumerate(lengths):
        full, rest = (n // width, n % width) if n > width else (0, n)
        expected = [width] * full + ([rest] if rest >= 2 else [])
        assert sorted(seen.get(i, [])) == sorted(expected), f"document {i} of {n} tokens"
    assert int(lens.sum()) + sum(b[2] for b in blocks) == sum(lengths)


def test_whole_document_packing_fills_rows_better_than_one_document_each() -> None:
    """Best fit: many short documents share rows (what makes whole-document packing affordable)."""
    rng = np.random.default_rng(0)
    docs = [np.full(int(n), 7, np.uint16) for n in rng.integers(2, 300, 2000)]
    lens = np.concatenate([b[1] for b in pack_whole(docs, 1023, 3, np.dtype(np.uint16))])
    assert lens.sum() / (len(lens) * 1024) > 0.97
    assert len(lens) < len(docs) / 5


@given(
    available=st.lists(st.integers(0, 1000), min_size=1, max_size=5),
    weights=st.lists(st.floats(0.1, 10), min_size=5, max_size=5),
    count=st.integers(0, 5000),
)
def test_bucket_counts_keep_the_total_and_follow_available_times_weight(
    available: list[int], weights: list[float], count: int
) -> None:
    w = weights[: len(available)]
    counts = bucket_counts(available, w, count)
    if not sum(available):
        assert counts == [0] * len(available)
        return
    assert sum(counts) == count
    total = sum(a * x for a, x in zip(available, w, strict=True))
    for c, a, x in zip(counts, available, w, strict=True):
        assert abs(c - count * a * x / total) < 1
    assert all(c == 0 for c, a in zip(counts, available, strict=True) if a == 0)


def test_length_buckets_edges_are_inclusive_from_below() -> None:
    lengths = np.array([1, 8191, 8192, 20000, 32768, 10**6])
    assert length_buckets(lengths, ((8192, 2.0), (32768, 4.0))).tolist() == [0, 0, 1, 1, 2, 2]
