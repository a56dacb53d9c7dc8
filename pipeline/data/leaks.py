"""A cheap check `pipeline shard` runs on the split it made: how many validation and test documents are near
duplicates of a training document. Shard splits by document, so a copy of a training document with a few words
changed can land in val or test and flatter every evaluation. `pipeline curate` removes such copies before
tokenizing; on a corpus that was not curated this says how many crossed.

MinHash over token n-grams (the token ids shard has; no text), LSH in bands: a held-out document is counted when
it shares a band with a training document. Bounded work: every held-out document up to MAX_HELD_OUT, against a
seeded sample of MAX_TRAIN training documents (the count is then a lower bound, and says so), each document's
first MAX_TOKENS tokens. Pure numpy."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

NGRAM = 5
"""Tokens per shingle (about four words of English)."""
BANDS, ROWS = 8, 4
"""32 hashes in 8 bands of 4: documents whose 5-gram sets have Jaccard similarity 0.59 are found half the time,
0.8 almost always (99.9%), 0.3 rarely (6%): copies with a few edits, not documents on one topic."""
MAX_TRAIN, MAX_HELD_OUT, MAX_TOKENS = 20_000, 10_000, 2048
_MASK = np.uint64((1 << 64) - 1)


@dataclass(frozen=True, slots=True)
class LeakCount:
    held_out: dict[str, int]
    """Documents checked per held-out split (val, test)."""
    near_duplicates: dict[str, int]
    """Of those, how many share an LSH band with a checked training document."""
    train_checked: int
    train_documents: int

    @property
    def sampled(self) -> bool:
        return self.train_checked < self.train_documents

    def __add__(self, other: LeakCount) -> LeakCount:
        """Two sources' counts together (each source is checked within itself)."""
        return LeakCount(
            {k: self.held_out.get(k, 0) + other.held_out.get(k, 0) for k in {*self.held_out, *other.held_out}},
            {
                k: self.near_duplicates.get(k, 0) + other.near_duplicates.get(k, 0)
                for k in {*self.near_duplicates, *other.near_duplicates}
            },
            self.train_checked + other.train_checked,
            self.train_documents + other.train_documents,
        )

    def as_dict(self) -> dict[str, Any]:
        return {
            "held_out_checked": self.held_out,
            "near_duplicates_of_train": self.near_duplicates,
            "train_checked": self.train_checked,
            "train_documents": self.train_documents,
            "method": f"MinHash of token {NGRAM}-grams, {BANDS} bands x {ROWS} rows, first {MAX_TOKENS} tokens",
        }

    def line(self) -> str | None:
        """A warning for the shard's output, or None when nothing crossed."""
        found = {s: n for s, n in self.near_duplicates.items() if n}
        if not found:
            return None
        said = ", ".join(f"{n:,} of {self.held_out[s]:,} {s}" for s, n in found.items())
        bound = (
            f" (against a sample of {self.train_checked:,} of {self.train_documents:,} training documents: "
            "there are likely more)"
            if self.sampled
            else ""
        )
        return (
            f"warning: {said} documents are near duplicates of training documents{bound}; they flatter the "
            "evaluation: remove them before tokenizing (`pipeline curate`, docs/curate.md)"
        )


def _hash_params(seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    a = rng.integers(1, 2**63, size=BANDS * ROWS, dtype=np.uint64) | np.uint64(1)  # odd multipliers
    b = rng.integers(0, 2**63, size=BANDS * ROWS, dtype=np.uint64)
    return a, b


def signature(tokens: np.ndarray, a: np.ndarray, b: np.ndarray) -> np.ndarray | None:
    """The document's MinHash signature (BANDS x ROWS uint64), or None when it is shorter than one shingle."""
    t = np.asarray(tokens[:MAX_TOKENS], dtype=np.uint64)
    if len(t) < NGRAM:
        return None
    windows = np.lib.stride_tricks.sliding_window_view(t, NGRAM)
    powers = np.array([0x9E3779B97F4A7C15**k & int(_MASK) for k in range(NGRAM)], dtype=np.uint64)
    with np.errstate(over="ignore"):
        shingles = np.unique((windows * powers).sum(axis=1, dtype=np.uint64))
        hashed = shingles[None, :] * a[:, None] + b[:, None]  # (hashes, shingles), wrapping mod 2^64
    return hashed.min(axis=1)


def _bands(sig: np.ndarray) -> list[bytes]:
    return [bytes([i]) + sig[i * ROWS : (i + 1) * ROWS].tobytes() for i in range(BANDS)]


def count_leaks(docs: Any, split_ids: dict[str, np.ndarray], seed: int = 0) -> LeakCount:
    """`docs`: the documents' token arrays by id (an IndexedReader, or a list); `split_ids`: each split's document
    ids (train, val, test). Counts held-out documents that share an LSH band with a (sampled) training one."""
    a, b = _hash_params(seed)
    rng = np.random.default_rng(seed)
    train = split_ids.get("train", np.array([], dtype=np.int64))
    checked = train if len(train) <= MAX_TRAIN else np.sort(rng.choice(train, MAX_TRAIN, replace=False))
    index: set[bytes] = set()
    for d in checked:
        if (sig := signature(docs[int(d)], a, b)) is not None:
            index.update(_bands(sig))
    held, found = {}, {}
    for split in ("val", "test"):
        ids = split_ids.get(split, np.array([], dtype=np.int64))[:MAX_HELD_OUT]
        held[split] = len(ids)
        found[split] = sum(
            1
            for d in ids
            if (sig := signature(docs[int(d)], a, b)) is not None and any(x in index for x in _bands(sig))
        )
    return LeakCount(held, found, len(checked), len(train))
