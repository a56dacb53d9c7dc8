"""pipeline.data.encode: a chunk's ids are each piece's ids with the end-of-sequence id after a document's last
piece only; a bad record is counted by reason and listed as file:line, or refused at once with --on-error fail."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from pipeline.data.encode import ErrorSink, FileStats, encode_chunk
from pipeline.data.tokenizer import Tokenizer
from pipeline.errors import PipelineError
from tests.conftest import tokenizer_model


def test_a_chunk_is_its_pieces_ids_with_eos_after_each_documents_end(tokenized: Path) -> None:
    tok = Tokenizer(str(tokenizer_model(tokenized)))
    items = [("To be, or not", False), (" to be", True), ("ROMEO. Good morrow", True)]
    dtype = np.dtype(np.uint16)
    lengths, lasts, flat = encode_chunk(tok, items, tok.eos_id, dtype)
    ids = [tok.encode(text) for text, _ in items]
    expected = ids[0] + ids[1] + [tok.eos_id] + ids[2] + [tok.eos_id]
    assert flat.dtype == dtype and flat.tolist() == expected
    assert lengths.tolist() == [len(ids[0]), len(ids[1]) + 1, len(ids[2]) + 1] and lasts.tolist() == [0, 1, 1]
    lengths, _, flat = encode_chunk(tok, items, None, dtype)  # --no-append-eos
    assert flat.tolist() == ids[0] + ids[1] + ids[2] and lengths.sum() == len(flat)
    empty = encode_chunk(tok, [], tok.eos_id, dtype)
    assert [a.size for a in empty] == [0, 0, 0]


def test_bad_records_are_counted_by_reason_or_refused_naming_the_line() -> None:
    sink, stats = ErrorSink("skip"), FileStats("a.jsonl", "jsonl")
    for line in range(1, 14):
        sink.add(stats, line, "not JSON", "invalid_json")
    sink.add(stats, 20, "no 'text' field", "missing_text")
    assert stats.skipped == {"invalid_json": 13, "missing_text": 1} and stats.first_error == "line 1: not JSON"
    assert len(sink.listed) == 10 and sink.listed[0] == "a.jsonl:1: not JSON"
    with pytest.raises(PipelineError, match=r"a.jsonl:7: not JSON \(use --on-error skip"):
        ErrorSink("fail").add(FileStats("a.jsonl", "jsonl"), 7, "not JSON", "invalid_json")
