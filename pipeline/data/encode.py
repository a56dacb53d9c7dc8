"""Stage 1's encoding engine: records read into chunks in input order (a long document cut into pieces where its
ids stay the same, pipeline.data.pieces), each chunk encoded here or by a pool of worker processes (at most two
chunks per worker in flight, taken back in submission order, so the output is byte-identical for any worker
count), and the bad records counted by reason. pipeline.data.tokenize runs it and writes the files."""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pipeline.data.config import TokenizeConfig
from pipeline.data.pieces import Cutter
from pipeline.data.readers import Source, read_records
from pipeline.data.tokenizer import Tokenizer
from pipeline.errors import PipelineError

CHUNK_BYTES = 1 << 20
CHUNK_DOCS = 4096
MAX_LISTED_ERRORS = 10


@dataclass
class FileStats:
    path: str
    kind: str
    documents: int = 0
    tokens: int = 0
    skipped: Counter = field(default_factory=Counter)
    first_error: str = ""
    """`line: message` of the file's first skipped record."""


class ErrorSink:
    """Counts bad records by reason, keeps the first few as `file:line: message`, or raises when on_error=fail."""

    def __init__(self, on_error: str):
        self.on_error = on_error
        self.listed: list[str] = []
        self.by_reason: Counter = Counter()

    def add(self, stats: FileStats, line: int, message: str, reason: str) -> None:
        where = f"{stats.path}:{line}: {message}"
        if self.on_error == "fail":
            raise PipelineError(where + " (use --on-error skip to count and skip such records)")
        stats.skipped[reason] += 1
        stats.first_error = stats.first_error or f"line {line}: {message}"
        self.by_reason[reason] += 1
        if len(self.listed) < MAX_LISTED_ERRORS:
            self.listed.append(where)


def chunks(
    sources: list[Source],
    cfg: TokenizeConfig,
    stats: list[FileStats],
    sink: ErrorSink,
    rules: tuple[str, ...],
    cut_stats: Counter,
) -> Iterator[tuple[int, list[tuple[str, bool]], int]]:
    """(source index, [(text, ends its document)], raw bytes) chunks, in input order. A document longer than a
    piece is cut into pieces (pipeline.data.pieces), so no chunk holds much more than CHUNK_BYTES of text."""
    for i, src in enumerate(sources):
        items: list[tuple[str, bool]] = []
        size = 0
        nbytes = 0
        cutter = Cutter(rules, cfg.piece_chars)
        in_pieces = False
        for rec in read_records(src, cfg.text_key, cfg.max_record_bytes):
            nbytes += rec.nbytes
            if rec.text is None:
                sink.add(stats[i], rec.line, rec.error or "bad record", rec.reason or "other")
                continue
            pieces = cutter.feed(rec.text)
            in_pieces = in_pieces or bool(pieces)  # a document read in blocks may be cut in any of them
            if rec.last:
                rest = cutter.end()
                cut_stats["unchecked_cuts"] += cutter.unchecked
                cutter.unchecked = 0
                pieces.append(rest)
                if in_pieces:
                    cut_stats["documents_in_pieces"] += 1
                in_pieces = False
            for k, piece in enumerate(pieces):
                items.append((piece, rec.last and k == len(pieces) - 1))
                size += len(piece)
                if size >= CHUNK_BYTES or len(items) >= CHUNK_DOCS:
                    yield i, items, nbytes
                    items, size, nbytes = [], 0, 0
        if items or nbytes:
            yield i, items, nbytes


# Worker side: the tokenizer is loaded once per process.
_WORKER_TOKENIZER: Tokenizer | None = None


def worker_init(path: str) -> None:
    global _WORKER_TOKENIZER
    _WORKER_TOKENIZER = Tokenizer(path)


def encode_chunk(
    tok: Tokenizer, items: list[tuple[str, bool]], eos_id: int | None, dtype: np.dtype
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Pure: [(text, ends its document)] -> (token count per item, ends-a-document flags, concatenated ids), each
    document's last piece followed by `eos_id` when given."""
    arrays = tok.encode_batch([t for t, _ in items])
    lasts = np.fromiter((last for _, last in items), dtype=bool, count=len(items))
    if eos_id is not None:
        eos = np.array([eos_id], dtype=dtype)
        parts = [p for a, last in zip(arrays, lasts, strict=True) for p in ((a, eos) if last else (a,))]
        lengths = np.fromiter(
            (len(a) + int(last) for a, last in zip(arrays, lasts, strict=True)), dtype=np.int64, count=len(arrays)
        )
    else:
        parts = list(arrays)
        lengths = np.fromiter((len(a) for a in arrays), dtype=np.int64, count=len(arrays))
    flat = np.concatenate(parts).astype(dtype, copy=False) if parts else np.zeros(0, dtype)
    return lengths, lasts, flat


def _worker_encode(
    items: list[tuple[str, bool]], eos_id: int | None, dtype: str
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    assert _WORKER_TOKENIZER is not None
    return encode_chunk(_WORKER_TOKENIZER, items, eos_id, np.dtype(dtype))


def encode_all(
    chunks: Iterator[tuple[int, list[tuple[str, bool]], int]],
    tok: Tokenizer,
    eos_id: int | None,
    dtype: np.dtype,
    pool: Any,
    workers: int,
    consume: Callable[..., None],
) -> None:
    """Each chunk encoded, here or by the `workers` of `pool` (at most two chunks per worker in flight, in input
    order), and handed to `consume(source index, bytes read, lengths, lasts, tokens)`."""
    if pool is None:
        for i, items, nbytes in chunks:
            consume(i, nbytes, *encode_chunk(tok, items, eos_id, dtype))
        return
    pending: deque = deque()
    for i, items, nbytes in chunks:
        pending.append((i, nbytes, pool.apply_async(_worker_encode, (items, eos_id, dtype.str))))
        while len(pending) > 2 * workers:
            j, nb, res = pending.popleft()
            consume(j, nb, *res.get())
    while pending:
        j, nb, res = pending.popleft()
        consume(j, nb, *res.get())


def refuse_lost_input(documents: int, stats: list[FileStats], sink: ErrorSink) -> None:
    """Nothing is written when no document was kept, or when every record of a file was skipped: a file of records
    lost whole is a mistake (a wrong --text-key, another format), not noise."""
    first = f"; first: {sink.listed[0]}" if sink.listed else ""
    if documents == 0:
        raise PipelineError(
            "no valid documents in the input; nothing written "
            f"({', '.join(f'{k} {v}' for k, v in sink.by_reason.items()) or 'inputs are empty'}){first}"
        )
    for st in stats:
        if st.documents == 0 and st.skipped and st.kind != "txt":  # (a .txt file is one document)
            reasons = ", ".join(f"{k} {v}" for k, v in sorted(st.skipped.items()))
            raise PipelineError(
                f"{st.path}: every record was skipped ({reasons}; first: {st.first_error}); nothing written. "
                "Fix the file or leave it out"
            )
