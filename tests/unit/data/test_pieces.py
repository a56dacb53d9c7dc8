"""Long documents are read and encoded in pieces (pipeline.data.pieces) with the ids of the whole text, for the
trained sentencepiece model and a Hugging Face byte-level BPE; the output is the same for any worker count; a
JSON record over the size limit is refused with its file, line and size."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeline.data import tokenize as tokenizing
from pipeline.data.config import TokenizeConfig
from pipeline.data.indexed import IndexedReader
from pipeline.data.pieces import Cutter, cut_positions, safe_rules
from pipeline.data.tokenizer import Tokenizer
from pipeline.errors import PipelineError

ENGLISH = "It was the best of times, it was the worst of times.  Indented\tand tabbed text follows.\n\n"
CHINESE = "春天来了，花园里的花都开了。我们去公园散步吧！\n天气很好，阳光明媚。\n"
EMOJI = "Rockets 🚀🚀 and smiles 🙂 between words 👍, flags 🇨🇳🇫🇷 too.\n"


def long_text(unit: str, chars: int) -> str:
    return (unit * (chars // len(unit) + 1))[:chars].rstrip() + "."


@pytest.fixture(scope="module")
def hf_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A byte-level BPE (GPT-2 style) trained here, saved as a transformers tokenizer folder."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator([ENGLISH * 20, CHINESE * 20, EMOJI * 20], vocab_size=600, special_tokens=["</s>"])
    out = tmp_path_factory.mktemp("hf") / "tok"
    PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="</s>").save_pretrained(str(out))
    return out


def tokenize(inputs: list[Path], prefix: Path, tokenizer: Path, **kw) -> dict:
    res = tokenizing.run(
        TokenizeConfig(
            inputs=tuple(map(str, inputs)), output_prefix=str(prefix), tokenizer=str(tokenizer), progress=False, **kw
        )
    )
    return res.manifest


@pytest.mark.parametrize("which", ["sentencepiece", "hf"])
def test_pieces_give_the_ids_of_the_whole_document(
    tmp_path: Path, tokenized: Path, hf_tokenizer: Path, which: str
) -> None:
    tok_path = Path(str(tokenized) + ".tokenizer.model") if which == "sentencepiece" else hf_tokenizer
    tok = Tokenizer(tok_path)
    assert safe_rules(tok.encode) == ("newline", "space")
    docs = [long_text(ENGLISH, 40_000), long_text(CHINESE, 30_000), long_text(EMOJI + CHINESE + ENGLISH, 50_000)]
    txt = []
    for k, d in enumerate(docs):
        (tmp_path / f"{k}.txt").write_text(d)
        txt.append(tmp_path / f"{k}.txt")
    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    for inputs, name in ((txt, "txt"), ([tmp_path / "d.jsonl"], "jsonl")):
        m = tokenize(inputs, tmp_path / name, tok_path, piece_chars=3000)
        assert m["long_documents"]["documents_in_pieces"] == 3 and m["long_documents"]["unchecked_cuts"] == 0
        reader = IndexedReader(tmp_path / name)
        for k, d in enumerate(docs):
            assert reader[k].tolist() == tok.encode(d) + [tok.eos_id], (name, k)


def test_any_worker_count_gives_the_same_bytes(tmp_path: Path, tokenized: Path) -> None:
    model = Path(str(tokenized) + ".tokenizer.model")
    (tmp_path / "a.txt").write_text(long_text(ENGLISH + CHINESE, 200_000))
    (tmp_path / "b.txt").write_text(long_text(EMOJI, 5_000))
    tokenize([tmp_path / "a.txt", tmp_path / "b.txt"], tmp_path / "w1", model, piece_chars=4000)
    tokenize([tmp_path / "a.txt", tmp_path / "b.txt"], tmp_path / "w2", model, piece_chars=4000, workers=2)
    for ext in (".bin", ".idx"):
        assert (tmp_path / f"w1{ext}").read_bytes() == (tmp_path / f"w2{ext}").read_bytes()


def test_a_json_record_over_the_limit_is_refused_with_file_line_and_size(tmp_path: Path, tokenized: Path) -> None:
    model = Path(str(tokenized) + ".tokenizer.model")
    path = tmp_path / "d.jsonl"
    path.write_text(
        json.dumps({"text": "small one"})
        + "\n"
        + json.dumps({"text": "x" * 5000})
        + "\n"
        + json.dumps({"text": "after it"})
        + "\n"
    )
    m = tokenize([path], tmp_path / "o", model, max_record_bytes=1000)
    assert m["totals"]["documents"] == 2 and m["totals"]["skipped_by_reason"] == {"record_too_large": 1}
    assert m["errors"][0].startswith(f"{path}:2: record of 5,013 bytes is larger than --max-record-bytes 1,000")
    with pytest.raises(PipelineError, match=rf"{path}:2: record of 5,013 bytes"):
        tokenize([path], tmp_path / "f", model, max_record_bytes=1000, on_error="fail")


def test_invalid_utf8_deep_in_a_long_text_file_writes_nothing_of_it(tmp_path: Path, tokenized: Path) -> None:
    model = Path(str(tokenized) + ".tokenizer.model")
    bad = tmp_path / "bad.txt"
    head = long_text(ENGLISH, 300_000).encode()
    bad.write_bytes(head + b"\xff\xfe" + b"tail\n")
    good = tmp_path / "good.txt"
    good.write_text(long_text(CHINESE, 1000))
    m = tokenize([bad, good], tmp_path / "o", model, piece_chars=3000)
    assert m["totals"]["documents"] == 1 and m["totals"]["skipped_by_reason"] == {"invalid_utf8": 1}
    line = head.count(b"\n") + 1
    assert f"{bad}:{line}: invalid UTF-8 at byte {len(head)}" in m["errors"][0]
    assert IndexedReader(tmp_path / "o")[0].tolist() == Tokenizer(model).encode(good.read_text()) + [2]


def test_cuts_only_where_the_rule_says() -> None:
    text = "ab cd  ef\n\ngh\n ij"
    assert list(cut_positions(text, "space")) == [2]  # not inside a run of spaces, not before whitespace
    assert list(cut_positions(text, "newline")) == [11]  # after a newline run, before a non-space
    cutter = Cutter(("newline", "space"), piece_chars=8)
    pieces = cutter.feed(text) + [cutter.end()]
    assert "".join(pieces) == text and all(len(p) <= 8 for p in pieces[:-1])
    assert len(pieces) > 1
    assert Cutter((), piece_chars=4).feed("x" * 100) == []  # no safe rule: the document stays whole


@pytest.mark.slow
def test_memory_of_one_huge_document_stays_flat(tmp_path: Path, tokenized: Path) -> None:
    """An 80 MB single-document .txt peaks at about the RSS of an 8 MB one (both in pieces; one process does all
    the work, so its peak RSS is the whole cost): a document held whole would add its 72 MB of text and more.
    Measured at 200 MB: 147 MB against 135 MB (README); 80 MB keeps the test at a third of that time."""
    from tests.unit.data.test_tokenize import _peak_rss_mb

    model = str(Path(str(tokenized) + ".tokenizer.model"))
    unit = (ENGLISH + CHINESE + EMOJI).encode()
    block = unit * (8_000_000 // len(unit))
    small, huge = tmp_path / "small.txt", tmp_path / "huge.txt"
    small.write_bytes(block)
    with open(huge, "wb") as f:
        for _ in range(10):
            f.write(block)
    a = _peak_rss_mb(["tokenize", str(small), "--tokenizer", model, "--output-prefix", str(tmp_path / "s")])
    b = _peak_rss_mb(["tokenize", str(huge), "--tokenizer", model, "--output-prefix", str(tmp_path / "h")])
    manifest = json.loads((tmp_path / "h.manifest.json").read_text())
    assert manifest["totals"]["documents"] == 1 and manifest["long_documents"]["documents_in_pieces"] == 1
    assert (tmp_path / "h.bin").stat().st_size > 9 * (tmp_path / "s.bin").stat().st_size
    assert b - a < 40, f"peak RSS grew from {a:.0f} MB to {b:.0f} MB with a 10x larger document"
