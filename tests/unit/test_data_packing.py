"""pipeline.data.packing: the split is disjoint, complete and seeded; packing across documents is exact, and
packing each document alone pads and masks its last piece."""

from __future__ import annotations

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from pipeline.data.packing import pack, split_documents


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
