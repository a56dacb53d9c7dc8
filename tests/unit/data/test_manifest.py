"""pipeline.data.manifest: what a tokenize manifest records, and a missing one named by its prefix."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from pipeline.data.manifest import read_tokenize_manifest
from pipeline.errors import PipelineError
from tests.conftest import CORPUS


def test_manifest_records_inputs_and_tokenizer(tokenized: Path) -> None:
    m = json.loads(Path(str(tokenized) + ".manifest.json").read_text())
    assert m["tokenizer"]["vocab_size"] == 600 and len(m["tokenizer"]["sha256"]) == 64
    [inp] = m["inputs"]
    assert inp["documents"] == 36 and inp["bytes"] == CORPUS.stat().st_size and len(inp["sha256"]) == 64
    assert m["totals"]["tokens"] == inp["tokens"] == os.path.getsize(str(tokenized) + ".bin") // 2
    assert m["throughput"]["tokens_per_s"] > 0 and m["version"]


def test_pipeline_error_names_the_prefix_when_manifest_is_missing(tmp_path: Path) -> None:
    with pytest.raises(PipelineError, match="not a finished `pipeline tokenize` output"):
        read_tokenize_manifest(tmp_path / "nothing")
