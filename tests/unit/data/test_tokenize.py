"""Stage 1 (pipeline.data.tokenize): identical bytes for any worker count, bad records skipped and counted or
stopped at, one-line errors, atomicity when interrupted or killed, flat memory."""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from pipeline.cli import main
from pipeline.data import encode
from pipeline.data.indexed import IndexedReader
from tests.conftest import CORPUS, tokenize_with, tokenizer_model

BAD = [
    (b'{"text": "fine"}\n', None),
    (b'{"text": "broken"\n', "malformed JSON"),
    (b'{"body": "no text key"}\n', "missing field 'text'"),
    (b'{"text": 42}\n', "field 'text' is int, not a string"),
    (b'{"text": "bad \xff byte"}\n', "invalid UTF-8"),
    (b'{"text": "   "}\n', "empty document"),
    (b'{"text": "a\tb\x01"}\n', "malformed JSON (Invalid control character at column 12)"),
]


def _peak_rss_mb(args: list[str]) -> float:
    code = (
        "import resource, sys; from pipeline.cli import main\n"
        "try:\n    main(sys.argv[1:])\nexcept SystemExit:\n    pass\n"
        "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)"
    )
    out = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, check=True)
    return int(out.stdout.strip().splitlines()[-1]) / 1024


def test_workers_give_identical_bytes(tmp_path: Path, tokenized: Path) -> None:
    big = tmp_path / "big.jsonl"
    big.write_text(CORPUS.read_text() * 8)  # several chunks, so ordering across workers matters
    tokenize_with(tmp_path / "w1", [str(big)], tokenizer_model(tokenized), workers=1)
    tokenize_with(tmp_path / "w2", [str(big)], tokenizer_model(tokenized), workers=2)
    for ext in (".bin", ".idx"):
        assert (tmp_path / f"w1{ext}").read_bytes() == (tmp_path / f"w2{ext}").read_bytes()


def test_bad_records_are_skipped_counted_and_listed(tmp_path: Path, tokenized: Path) -> None:
    f = tmp_path / "bad.jsonl"
    f.write_bytes(b"".join(line for line, _ in BAD))
    res = tokenize_with(tmp_path / "out", [str(f)], tokenizer_model(tokenized))
    t = res.manifest["totals"]
    assert t["documents"] == 1 and t["skipped"] == 6
    assert t["skipped_by_reason"] == {
        "malformed_json": 2,
        "missing_field": 1,
        "not_a_string": 1,
        "invalid_utf8": 1,
        "empty_document": 1,
    }
    for n, (_, msg) in enumerate(BAD, start=1):
        if msg:
            assert any(e.startswith(f"{f}:{n}: {msg}") for e in res.manifest["errors"]), msg
    assert "skipped 6 records" in res.summary and "iconv -f cp1252 -t utf-8" in res.summary


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
            str(tokenizer_model(tokenized)),
            "--on-error",
            "fail",
        ],
    )
    assert r.exit_code == 2
    assert f"{f}:2: {BAD[n - 1][1]}" in r.output and "Traceback" not in r.output
    assert not list(tmp_path.glob("o.*"))


@pytest.mark.parametrize("case", ["missing_input", "bad_tokenizer", "unwritable_output", "no_tokenizer_choice"])
def test_clear_one_line_errors(tmp_path: Path, tokenized: Path, case: str) -> None:
    model = str(tokenizer_model(tokenized))
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
            str(tokenizer_model(tokenized)),
            "--output-prefix",
            str(tmp_path / "out" / "deeper" / "x"),
        ],
    )
    assert r.exit_code == 0, r.output
    assert len(IndexedReader(tmp_path / "out" / "deeper" / "x")) > 0


def test_interrupted_run_leaves_no_outputs(tmp_path: Path, tokenized: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = {"n": 0}
    real = encode.encode_chunk

    def interrupt_second_chunk(*a, **kw):
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyboardInterrupt
        return real(*a, **kw)

    monkeypatch.setattr(encode, "encode_chunk", interrupt_second_chunk)
    big = tmp_path / "big.jsonl"
    big.write_text(CORPUS.read_text() * 8)
    with pytest.raises(KeyboardInterrupt):
        tokenize_with(tmp_path / "out", [str(big)], tokenizer_model(tokenized))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["big.jsonl"]


def _tokenize_caught_writing(tmp_path: Path, tokenized: Path) -> tuple[subprocess.Popen, Path]:
    """`pipeline tokenize` of a corpus large enough to stop midway, as a process, once it has begun writing."""
    import time

    big = tmp_path / "big.jsonl"
    big.write_text(CORPUS.read_text() * 200)
    args = [
        "tokenize",
        str(big),
        "--output-prefix",
        str(tmp_path / "out"),
        "--tokenizer",
        str(tokenizer_model(tokenized)),
    ]
    proc = subprocess.Popen([sys.executable, "-m", "pipeline.cli", *args], stderr=subprocess.PIPE, text=True)
    t0 = time.time()
    while not list(tmp_path.glob(".out.bin.*")) and proc.poll() is None and time.time() - t0 < 60:
        time.sleep(0.05)
    assert proc.poll() is None, "tokenize ended before it could be stopped: give it more text"
    return proc, big


@pytest.mark.slow  # a tokenize process killed midway, then a second run: seconds of interpreter starts
def test_killed_run_leaves_no_final_outputs(tmp_path: Path, tokenized: Path) -> None:
    proc, big = _tokenize_caught_writing(tmp_path, tokenized)
    proc.kill()
    proc.communicate()
    assert not (tmp_path / "out.bin").exists() and not (tmp_path / "out.idx").exists()
    assert not (tmp_path / "out.manifest.json").exists()
    # a rerun completes and replaces nothing half-written
    tokenize_with(tmp_path / "out", [str(big)], tokenizer_model(tokenized))
    assert IndexedReader(tmp_path / "out").tokens.size > 0


@pytest.mark.slow  # a tokenize process stopped by SIGTERM midway: seconds of interpreter start
def test_sigterm_stops_as_ctrl_c_does_and_leaves_nothing_behind(tmp_path: Path, tokenized: Path) -> None:
    """`kill`, `docker stop` or a scheduler's time limit: the same cleanup as Ctrl-C (temporary files, the output's
    lock, the worker pool), one line, exit 143; nothing beside the input is left, and a rerun completes."""
    proc, big = _tokenize_caught_writing(tmp_path, tokenized)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 143, err
    assert "terminated (SIGTERM); no partial outputs were left under final names" in err
    assert "Traceback" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["big.jsonl"]
    tokenize_with(tmp_path / "out", [str(big)], tokenizer_model(tokenized))
    assert IndexedReader(tmp_path / "out").tokens.size > 0


@pytest.mark.slow  # tokenize in subprocesses, their peak memory measured at two corpus sizes
def test_memory_does_not_grow_with_corpus_size(tmp_path: Path, tokenized: Path) -> None:
    small, large = tmp_path / "small.jsonl", tmp_path / "large.jsonl"
    small.write_text(CORPUS.read_text() * 5)
    large.write_text(CORPUS.read_text() * 150)  # ~30 MB of text
    model = str(tokenizer_model(tokenized))
    a = _peak_rss_mb(["tokenize", str(small), "--tokenizer", model, "--output-prefix", str(tmp_path / "s")])
    b = _peak_rss_mb(["tokenize", str(large), "--tokenizer", model, "--output-prefix", str(tmp_path / "l")])
    assert os.path.getsize(tmp_path / "l.bin") > 25 * os.path.getsize(tmp_path / "s.bin")
    assert b - a < 40, f"peak RSS grew from {a:.0f} MB to {b:.0f} MB with 30x the input"
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss > 0


def test_a_vocabulary_larger_than_the_text_supports_is_said(tmp_path: Path) -> None:
    """--train-tokenizer --vocab-size 100000 on a small corpus: legal, almost surely a mistake (most pieces would
    occur a few times, their embeddings barely trained); the summary says so, the demo-sized vocabulary does not."""
    runner = CliRunner()
    big = runner.invoke(
        main,
        ["tokenize", str(CORPUS), "--output-prefix", str(tmp_path / "big"), "--train-tokenizer", "--vocab-size",
         "100000", "--workers", "1"],
    )  # fmt: skip
    assert big.exit_code == 0, big.output
    assert "note: --vocab-size 100,000: " in big.output and "occur fewer than 10 times" in big.output
    manifest = json.loads((tmp_path / "big.manifest.json").read_text())
    assert manifest["notes"] and manifest["tokenizer"]["vocab_size"] > 10_000
    fitting = runner.invoke(
        main,
        ["tokenize", str(CORPUS), "--output-prefix", str(tmp_path / "fit"), "--train-tokenizer", "--vocab-size",
         "600", "--workers", "1"],
    )  # fmt: skip
    assert fitting.exit_code == 0 and "note:" not in fitting.output, fitting.output
