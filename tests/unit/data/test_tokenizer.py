"""pipeline.data.tokenizer: a trained sentencepiece model round-trips English and Chinese and trains the same
twice; a Hugging Face tokenizer folder works as the input tokenizer."""

from __future__ import annotations

from pathlib import Path

from pipeline.data import tokenize as tokenizing
from pipeline.data.config import TokenizeConfig
from pipeline.data.tokenizer import Tokenizer
from tests.conftest import CORPUS, tokenize_with, tokenizer_model


def test_trained_tokenizer_round_trips_english_and_chinese(tokenized: Path) -> None:
    tok = Tokenizer(tokenizer_model(tokenized))
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
    a, b = Tokenizer(tmp_path / "again.tokenizer.model")._sp, Tokenizer(tokenizer_model(tokenized))._sp
    # The serialized model also records its temporary file name; the vocabulary and scores are what count.
    assert [(a.id_to_piece(i), a.get_score(i)) for i in range(600)] == [
        (b.id_to_piece(i), b.get_score(i)) for i in range(600)
    ]
    assert (tmp_path / "again.bin").read_bytes() == Path(str(tokenized) + ".bin").read_bytes()
    assert res.manifest["totals"]["documents"] == 36


def test_hugging_face_tokenizer_folder_as_input_tokenizer(tmp_path: Path, tokenized: Path) -> None:
    from pipeline.evaluate.export import hf_tokenizer

    hf_dir = tmp_path / "hf_tok"
    hf_tokenizer(tokenizer_model(tokenized)).save_pretrained(hf_dir)
    res = tokenize_with(tmp_path / "via_hf", [str(CORPUS)], hf_dir)
    assert res.manifest["tokenizer"]["kind"] == "hf"
    assert (tmp_path / "via_hf.bin").read_bytes() == Path(str(tokenized) + ".bin").read_bytes()
