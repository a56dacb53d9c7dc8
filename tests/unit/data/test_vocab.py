"""pipeline extend-vocab on tiny Hugging Face models of each family: pieces of a new script added to the
tokenizer, fewer tokens per byte on held-out text, old tokens' ids and logits unchanged, new rows near the old
rows' mean, the folder reloadable by transformers; bad inputs one line."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from pipeline.cli import main
from pipeline.data.vocab import RESULT, VocabConfig, extend_vocabulary
from tests.hf_families import write_model, write_tokenizer

THAI = [chr(c) for c in range(0x0E01, 0x0E2F)]
ENGLISH = "To be, or not to be: that is the question. Whether 'tis nobler in the mind to suffer"


def thai_corpus(path: Path, docs: int = 300) -> Path:
    """A corpus in a script the tiny tokenizer (trained on English) splits into bytes: 120 words of Thai letters."""
    rng = random.Random(0)
    words = ["".join(rng.choice(THAI) for _ in range(rng.randint(2, 6))) for _ in range(120)]
    with path.open("w") as f:
        for _ in range(docs):
            f.write(json.dumps({"text": " ".join(rng.choice(words) for _ in range(rng.randint(20, 60)))}) + "\n")
    return path


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("vocab")
    tok = write_tokenizer(base / "tok")
    return {f: write_model(f, base / f, tok) for f in ("llama", "qwen2")}


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_a_new_script_gets_its_pieces_and_old_tokens_keep_their_ids_and_logits(
    model_dirs: dict[str, Path], tmp_path: Path, family: str
) -> None:
    """qwen2's tiny model ties its output to its embedding and pads its embedding beyond the tokenizer (as
    Qwen2.5 does); llama's has its own output matrix."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = model_dirs[family]
    corpus = thai_corpus(tmp_path / "thai.jsonl")
    res = extend_vocabulary(
        VocabConfig(model_dir=str(src), inputs=(str(corpus),), output=str(tmp_path / "x"), new_tokens=150)
    )
    assert 50 <= res.added <= 150 and res.bytes_per_token_after > 1.5 * res.bytes_per_token_before
    report = json.loads((tmp_path / "x" / RESULT).read_text())
    assert report["added_tokens"] == res.added == len(report["pieces"])
    old_tok = AutoTokenizer.from_pretrained(src, local_files_only=True)
    new_tok = AutoTokenizer.from_pretrained(tmp_path / "x", local_files_only=True)
    assert len(new_tok) == len(old_tok) + res.added
    assert new_tok.encode(ENGLISH, add_special_tokens=False) == old_tok.encode(ENGLISH, add_special_tokens=False)
    text = json.loads(corpus.read_text().splitlines()[0])["text"]
    ids = new_tok.encode(text, add_special_tokens=False)
    assert new_tok.decode(ids) == text and max(ids) >= len(old_tok), "new pieces round-trip"
    assert len(ids) < len(old_tok.encode(text, add_special_tokens=False)) / 2
    old = AutoModelForCausalLM.from_pretrained(src, local_files_only=True).eval()
    new = AutoModelForCausalLM.from_pretrained(tmp_path / "x", local_files_only=True).eval()
    rows = new.get_input_embeddings().weight
    assert rows.shape[0] == max(old.config.vocab_size, len(new_tok)) == new.config.vocab_size
    english = torch.tensor([old_tok.encode(ENGLISH, add_special_tokens=False)])
    with torch.no_grad():
        before, after = old(english).logits, new(english).logits
    torch.testing.assert_close(after[..., : len(old_tok)], before[..., : len(old_tok)], rtol=1e-5, atol=1e-5)
    old_rows = old.get_input_embeddings().weight[: len(old_tok)]
    added = rows[len(old_tok) : len(old_tok) + res.added]
    assert torch.allclose(added.mean(0), old_rows.mean(0), atol=1e-3), "new rows around the old rows' mean"


@pytest.mark.parametrize(
    "args, says",
    [
        (["nowhere", "{corpus}", "--output", "{tmp}/o"], "nowhere: no config.json"),
        (["{model}", "{corpus}", "--output", "{model}"], "the model folder itself"),
        (["{model}", "{tmp}/missing.jsonl", "--output", "{tmp}/o"], "missing.jsonl"),
        (["{model}", "{corpus}", "--output", "{tmp}/o", "--new-tokens", "0"], "--new-tokens"),
    ],
)
def test_bad_inputs_are_one_line(model_dirs: dict[str, Path], tmp_path: Path, args: list[str], says: str) -> None:
    corpus = thai_corpus(tmp_path / "thai.jsonl", docs=30)
    fill = {"corpus": str(corpus), "tmp": str(tmp_path), "model": str(model_dirs["llama"])}
    result = CliRunner().invoke(main, ["extend-vocab", *(a.format(**fill) for a in args)])
    assert result.exit_code == 2 and says in result.output and "Traceback" not in result.output, result.output
    assert not (tmp_path / "o").exists()


def test_more_new_tokens_than_the_text_supports_is_said(model_dirs: dict[str, Path], tmp_path: Path) -> None:
    """--new-tokens far above what a small corpus supports: done (legal), with a note that most added rows would
    barely train, as tokenize says of a large --vocab-size; a supported count gets no note."""
    corpus = thai_corpus(tmp_path / "thai.jsonl", docs=60)
    src = str(model_dirs["llama"])
    many = extend_vocabulary(
        VocabConfig(model_dir=src, inputs=(str(corpus),), output=str(tmp_path / "m"), new_tokens=5000)
    )
    assert many.added > 200 and "note: --new-tokens 5,000: " in many.summary
    assert "added tokens occur fewer than 10 times" in many.summary
    few = extend_vocabulary(
        VocabConfig(model_dir=src, inputs=(str(corpus),), output=str(tmp_path / "f"), new_tokens=20)
    )
    assert few.added == 20 and "note:" not in few.summary


@pytest.mark.parametrize(
    "damage, says",
    [
        ("tokenizer", "no tokenizer files (tokenizer.json, tokenizer.model, vocab.json)"),
        ("weights", "no .safetensors weights in the folder"),
        ("shard", "names 1 file(s) not in the folder (model-00002-of-00005.safetensors): the download is incomplete"),
    ],
)
def test_a_model_folder_is_checked_against_itself_before_anything_is_done(
    model_dirs: dict[str, Path], tmp_path: Path, damage: str, says: str
) -> None:
    """A folder without its tokenizer, without weights, or whose safetensors index names a file it lacks (an
    interrupted download): one line naming the folder and what it lacks, before a tokenizer is trained or anything
    written; model.init_from is checked the same way before launch."""
    import shutil

    folder = tmp_path / "m"
    shutil.copytree(model_dirs["llama"], folder)
    if damage == "tokenizer":
        for f in folder.glob("tokenizer*"):
            f.unlink()
    elif damage == "weights":
        for f in folder.glob("*.safetensors*"):
            f.unlink()
    else:  # the tiny model is saved in 5 shards with their index: one of them never arrived
        (folder / "model-00002-of-00005.safetensors").unlink()
    corpus = thai_corpus(tmp_path / "thai.jsonl", docs=30)
    r = CliRunner().invoke(main, ["extend-vocab", str(folder), str(corpus), "--output", str(tmp_path / "o")])
    assert r.exit_code == 2 and says in r.output and "pieces added" not in r.output, r.output
    assert not (tmp_path / "o").exists()
    if damage == "shard":  # what pretrain checks of model.init_from before launch
        from pipeline.train.preflight import init_weights_problem

        line = init_weights_problem(str(folder))
        assert line and line.startswith(f"model.init_from {folder}: ") and says in line
