"""Stage 1: readers for every format, the trained tokenizer, Megatron compatibility, bad input, atomicity."""

from __future__ import annotations

import gzip
import json
import os
import resource
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from pipeline.cli import main
from pipeline.data import tokenize as tokenizing
from pipeline.data.config import TokenizeConfig
from pipeline.data.indexed import IndexedReader
from pipeline.data.manifest import read_tokenize_manifest
from pipeline.data.readers import read_records, resolve_inputs
from pipeline.data.tokenizer import Tokenizer
from pipeline.errors import PipelineError
from tests.conftest import CORPUS

DOCS = ["First document.\nWith two lines.", "第二个文档：中文也可以。", "Third, with digits 12345."]


def _tok(prefix: Path, inputs: list[str], tokenizer: Path, **kw) -> tokenizing.TokenizeResult:
    return tokenizing.run(
        TokenizeConfig(inputs=tuple(inputs), output_prefix=str(prefix), tokenizer=str(tokenizer), progress=False, **kw)
    )


def _model(tokenized: Path) -> Path:
    return Path(str(tokenized) + ".tokenizer.model")


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


def test_trained_tokenizer_round_trips_english_and_chinese(tokenized: Path) -> None:
    tok = Tokenizer(_model(tokenized))
    assert (tok.vocab_size, tok.eos_id, tok.bos_id, tok.pad_id) == (600, 2, 1, 3)
    for text in [
        "  Hello,\tworld!\n\nSecond paragraph 2026 ",
        "春天来了，花园里的花都开了。",
        "naïve — “quotes” é",
        "Unseen script: Ελληνικά и кириллица 🙂",
    ]:
        ids = tok.encode(text)
        assert 0 not in ids, "byte fallback means no <unk>"
        assert tok.decode(ids) == text
    assert "1 2 3" not in tok._sp.encode("123", out_type=str)  # digits split: one piece each
    assert len(tok._sp.encode("123", out_type=str)) == 3


def test_tokenizer_training_is_deterministic(tmp_path: Path, tokenized: Path) -> None:
    res = tokenizing.run(
        TokenizeConfig(
            inputs=(str(CORPUS),),
            output_prefix=str(tmp_path / "again"),
            train_tokenizer=True,
            vocab_size=600,
            progress=False,
        )
    )
    a, b = Tokenizer(tmp_path / "again.tokenizer.model")._sp, Tokenizer(_model(tokenized))._sp
    # The serialized model also records its temporary file name; the vocabulary and scores are what count.
    assert [(a.id_to_piece(i), a.get_score(i)) for i in range(600)] == [
        (b.id_to_piece(i), b.get_score(i)) for i in range(600)
    ]
    assert (tmp_path / "again.bin").read_bytes() == Path(str(tokenized) + ".bin").read_bytes()
    assert res.manifest["totals"]["documents"] == 36


def test_megatron_core_reads_our_output(tokenized: Path) -> None:
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    theirs = IndexedDataset(str(tokenized))
    ours = IndexedReader(tokenized)
    tok = Tokenizer(_model(tokenized))
    docs = [json.loads(line)["text"] for line in CORPUS.read_text().splitlines()]
    assert len(theirs) == len(ours) == len(docs)
    assert theirs[0].dtype == np.uint16
    for i in (0, 5, len(docs) - 1):
        assert np.array_equal(theirs[i], ours[i])
        assert theirs[i][-1] == tok.eos_id
        assert tok.decode(theirs[i][:-1]) == docs[i]


def test_manifest_records_inputs_and_tokenizer(tokenized: Path) -> None:
    m = json.loads(Path(str(tokenized) + ".manifest.json").read_text())
    assert m["tokenizer"]["vocab_size"] == 600 and len(m["tokenizer"]["sha256"]) == 64
    [inp] = m["inputs"]
    assert inp["documents"] == 36 and inp["bytes"] == CORPUS.stat().st_size and len(inp["sha256"]) == 64
    assert m["totals"]["tokens"] == inp["tokens"] == os.path.getsize(str(tokenized) + ".bin") // 2
    assert m["throughput"]["tokens_per_s"] > 0 and m["version"]


def test_workers_give_identical_bytes(tmp_path: Path, tokenized: Path) -> None:
    big = tmp_path / "big.jsonl"
    big.write_text(CORPUS.read_text() * 8)  # several chunks, so ordering across workers matters
    _tok(tmp_path / "w1", [str(big)], _model(tokenized), workers=1)
    _tok(tmp_path / "w2", [str(big)], _model(tokenized), workers=2)
    for ext in (".bin", ".idx"):
        assert (tmp_path / f"w1{ext}").read_bytes() == (tmp_path / f"w2{ext}").read_bytes()


BAD = [
    (b'{"text": "fine"}\n', None),
    (b'{"text": "broken"\n', "malformed JSON"),
    (b'{"body": "no text key"}\n', "missing field 'text'"),
    (b'{"text": 42}\n', "field 'text' is int, not a string"),
    (b'{"text": "bad \xff byte"}\n', "invalid UTF-8"),
    (b'{"text": "   "}\n', "empty document"),
]


def test_bad_records_are_skipped_counted_and_listed(tmp_path: Path, tokenized: Path) -> None:
    f = tmp_path / "bad.jsonl"
    f.write_bytes(b"".join(line for line, _ in BAD))
    res = _tok(tmp_path / "out", [str(f)], _model(tokenized))
    t = res.manifest["totals"]
    assert t["documents"] == 1 and t["skipped"] == 5
    assert t["skipped_by_reason"] == {
        "malformed_json": 1,
        "missing_field": 1,
        "not_a_string": 1,
        "invalid_utf8": 1,
        "empty_document": 1,
    }
    for n, (_, msg) in enumerate(BAD, start=1):
        if msg:
            assert any(e.startswith(f"{f}:{n}: {msg}") for e in res.manifest["errors"]), msg
    assert "skipped 5 records" in res.summary


@pytest.mark.parametrize("n", range(2, len(BAD) + 1))
def test_on_error_fail_stops_with_exit_2(tmp_path: Path, tokenized: Path, n: int) -> None:
    f = tmp_path / "bad.jsonl"
    f.write_bytes(BAD[0][0] + BAD[n - 1][0])
    r = CliRunner().invoke(
        main,
        [
            "tokenize",
            str(f),
            "--output-prefix",
            str(tmp_path / "o"),
            "--tokenizer",
            str(_model(tokenized)),
            "--on-error",
            "fail",
        ],
    )
    assert r.exit_code == 2
    assert f"{f}:2: {BAD[n - 1][1]}" in r.output and "Traceback" not in r.output
    assert not list(tmp_path.glob("o.*"))


@pytest.mark.parametrize("case", ["missing_input", "bad_tokenizer", "unwritable_output", "no_tokenizer_choice"])
def test_clear_one_line_errors(tmp_path: Path, tokenized: Path, case: str) -> None:
    model = str(_model(tokenized))
    junk = tmp_path / "junk.model"
    junk.write_bytes(b"not a model")
    args = {
        "missing_input": [str(tmp_path / "nope.jsonl"), "--tokenizer", model, "--output-prefix", str(tmp_path / "o")],
        "bad_tokenizer": [str(CORPUS), "--tokenizer", str(junk), "--output-prefix", str(tmp_path / "o")],
        "unwritable_output": [str(CORPUS), "--tokenizer", model, "--output-prefix", str(junk / "o")],
        "no_tokenizer_choice": [str(CORPUS), "--output-prefix", str(tmp_path / "o")],
    }[case]
    expected = {
        "missing_input": "nope.jsonl: no such file",
        "bad_tokenizer": "junk.model: cannot load tokenizer",
        "unwritable_output": "junk.model is not a folder",
        "no_tokenizer_choice": "exactly one of --tokenizer",
    }[case]
    r = CliRunner().invoke(main, ["tokenize", *args])
    assert r.exit_code == 2, r.output
    assert expected in r.output and "Traceback" not in r.output


def test_missing_output_folder_is_created(tmp_path: Path, tokenized: Path) -> None:
    r = CliRunner().invoke(
        main,
        [
            "tokenize",
            str(CORPUS),
            "--tokenizer",
            str(_model(tokenized)),
            "--output-prefix",
            str(tmp_path / "out" / "deeper" / "x"),
        ],
    )
    assert r.exit_code == 0, r.output
    assert len(IndexedReader(tmp_path / "out" / "deeper" / "x")) > 0


def test_interrupted_run_leaves_no_outputs(tmp_path: Path, tokenized: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = {"n": 0}
    real = tokenizing.encode_chunk

    def interrupt_second_chunk(*a, **kw):
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyboardInterrupt
        return real(*a, **kw)

    monkeypatch.setattr(tokenizing, "encode_chunk", interrupt_second_chunk)
    big = tmp_path / "big.jsonl"
    big.write_text(CORPUS.read_text() * 8)
    with pytest.raises(KeyboardInterrupt):
        _tok(tmp_path / "out", [str(big)], _model(tokenized))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["big.jsonl"]


def test_killed_run_leaves_no_final_outputs(tmp_path: Path, tokenized: Path) -> None:
    big = tmp_path / "big.jsonl"
    big.write_text(CORPUS.read_text() * 200)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "pipeline.cli",
            "tokenize",
            str(big),
            "--output-prefix",
            str(tmp_path / "out"),
            "--tokenizer",
            str(_model(tokenized)),
        ]
    )
    deadline = 60.0
    import time

    t0 = time.time()
    while not list(tmp_path.glob(".out.bin.*")) and time.time() - t0 < deadline:
        time.sleep(0.05)
    proc.kill()
    proc.wait()
    assert not (tmp_path / "out.bin").exists() and not (tmp_path / "out.idx").exists()
    assert not (tmp_path / "out.manifest.json").exists()
    # a rerun completes and replaces nothing half-written
    _tok(tmp_path / "out", [str(big)], _model(tokenized))
    assert IndexedReader(tmp_path / "out").tokens.size > 0


def _peak_rss_mb(args: list[str]) -> float:
    code = (
        "import resource, sys; from pipeline.cli import main\n"
        "try:\n    main(sys.argv[1:])\nexcept SystemExit:\n    pass\n"
        "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)"
    )
    out = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, check=True)
    return int(out.stdout.strip().splitlines()[-1]) / 1024


def test_memory_does_not_grow_with_corpus_size(tmp_path: Path, tokenized: Path) -> None:
    small, large = tmp_path / "small.jsonl", tmp_path / "large.jsonl"
    small.write_text(CORPUS.read_text() * 5)
    large.write_text(CORPUS.read_text() * 150)  # ~30 MB of text
    model = str(_model(tokenized))
    a = _peak_rss_mb(["tokenize", str(small), "--tokenizer", model, "--output-prefix", str(tmp_path / "s")])
    b = _peak_rss_mb(["tokenize", str(large), "--tokenizer", model, "--output-prefix", str(tmp_path / "l")])
    assert os.path.getsize(tmp_path / "l.bin") > 25 * os.path.getsize(tmp_path / "s.bin")
    assert b - a < 40, f"peak RSS grew from {a:.0f} MB to {b:.0f} MB with 30x the input"
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss > 0


def test_pipeline_error_names_the_prefix_when_manifest_is_missing(tmp_path: Path) -> None:
    with pytest.raises(PipelineError, match="not a finished `pipeline tokenize` output"):
        read_tokenize_manifest(tmp_path / "nothing")


def test_hugging_face_tokenizer_folder_as_input_tokenizer(tmp_path: Path, tokenized: Path) -> None:
    from pipeline.evaluate.export import hf_tokenizer

    hf_dir = tmp_path / "hf_tok"
    hf_tokenizer(_model(tokenized)).save_pretrained(hf_dir)
    res = _tok(tmp_path / "via_hf", [str(CORPUS)], hf_dir)
    assert res.manifest["tokenizer"]["kind"] == "hf"
    assert (tmp_path / "via_hf.bin").read_bytes() == Path(str(tokenized) + ".bin").read_bytes()
