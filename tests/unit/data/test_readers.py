"""pipeline.data.readers: every input format (.jsonl, .txt, .parquet, compressed, save_to_disk, folders, globs)
reads the same documents."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

from pipeline.data.readers import read_records, resolve_inputs

DOCS = ["First document.\nWith two lines.", "第二个文档：中文也可以。", "Third, with digits 12345."]


def _write_all_formats(d: Path) -> list[Path]:
    import pyarrow as pa
    import pyarrow.parquet as pq
    import zstandard

    lines = "".join(json.dumps({"text": t}) + "\n" for t in DOCS).encode()
    (d / "a.jsonl").write_bytes(lines)
    (d / "b.jsonl.gz").write_bytes(gzip.compress(lines))
    (d / "c.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(lines))
    (d / "d.txt").write_text(DOCS[1], encoding="utf-8")
    (d / "e.txt.gz").write_bytes(gzip.compress(DOCS[0].encode()))
    pq.write_table(pa.table({"text": DOCS}), d / "f.parquet")
    return sorted(d.iterdir())


def test_every_format_reads_the_same_documents(tmp_path: Path) -> None:
    files = _write_all_formats(tmp_path)
    texts = {f.name: [r.text for r in read_records(s)] for f in files for s in resolve_inputs([str(f)])}
    for name in ("a.jsonl", "b.jsonl.gz", "c.jsonl.zst", "f.parquet"):
        assert texts[name] == DOCS, name
    assert texts["d.txt"] == [DOCS[1]]
    assert texts["e.txt.gz"] == [DOCS[0]]


def test_save_to_disk_dataset_and_directory_and_glob(tmp_path: Path) -> None:
    import datasets

    datasets.Dataset.from_dict({"text": DOCS, "n": [1, 2, 3]}).save_to_disk(str(tmp_path / "hf"))
    (tmp_path / "dir").mkdir()
    _write_all_formats(tmp_path / "dir")
    [hf] = resolve_inputs([str(tmp_path / "hf")])
    assert hf.kind == "hf" and [r.text for r in read_records(hf)] == DOCS
    in_dir = resolve_inputs([str(tmp_path / "dir")])
    assert [s.path.name for s in in_dir] == ["a.jsonl", "b.jsonl.gz", "c.jsonl.zst", "d.txt", "e.txt.gz", "f.parquet"]
    assert [s.path.name for s in resolve_inputs([str(tmp_path / "dir" / "*.jsonl*")])] == [
        "a.jsonl",
        "b.jsonl.gz",
        "c.jsonl.zst",
    ]
