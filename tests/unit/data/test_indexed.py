"""pipeline.data.indexed: Megatron-Core's own reader reads what tokenize writes."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from pipeline.data.indexed import IndexedReader
from pipeline.data.tokenizer import Tokenizer
from tests.conftest import CORPUS, tokenizer_model


def test_megatron_core_reads_our_output(tokenized: Path) -> None:
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    theirs = IndexedDataset(str(tokenized))
    ours = IndexedReader(tokenized)
    tok = Tokenizer(tokenizer_model(tokenized))
    docs = [json.loads(line)["text"] for line in CORPUS.read_text().splitlines()]
    assert len(theirs) == len(ours) == len(docs)
    assert theirs[0].dtype == np.uint16
    for i in (0, 5, len(docs) - 1):
        assert np.array_equal(theirs[i], ours[i])
        assert theirs[i][-1] == tok.eos_id
        assert tok.decode(theirs[i][:-1]) == docs[i]
