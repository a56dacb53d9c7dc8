"""`pipeline export --gguf`: the GGUF file llama.cpp runs, checked the way the suite can check it here:
transformers' own GGUF loader (which undoes llama.cpp's q/k order and dequantises q8_0) gives the logits the Hugging
Face export gives, and the file's vocabulary, read back with llama.cpp's own reader (gguf.GGUFReader), is our
sentencepiece model's: every piece, score and type, the special ids, and whether a space is put before the text.
(transformers' GGUF tokenizer would not do: it always puts the space, whatever the file says, which llama.cpp
does not.) llama.cpp itself checks the same files in tests/unit/evaluate/test_to_gguf_llama_cpp.py, where it is
installed."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from pipeline.errors import PipelineError
from tests.conftest import tokenizer_model

pytest.importorskip("gguf", reason="pip install -e '.[gguf]'")
pytest.importorskip("accelerate", reason="transformers loads GGUF files with accelerate")

PROMPTS = ["To be, or not to be: that is the question", "KING HENRY. Once more unto the breach, 1415 friends"]


def export_of(model: Any, tok: Path, out: Path) -> Path:
    """A Hugging Face folder as `pipeline export` writes it: bf16 safetensors, config, our tokenizer."""
    from pipeline.evaluate.export import hf_tokenizer

    model.to(torch.bfloat16).save_pretrained(out)
    hf_tokenizer(tok).save_pretrained(out)
    shutil.copyfile(tok, out / "tokenizer.model")
    return out


def loaded(gguf_file: Path) -> Any:
    """The GGUF file through transformers, alone in its folder (its config from the file, not the export's)."""
    from transformers import AutoModelForCausalLM

    alone = gguf_file.parent / f"{gguf_file.stem}-alone"
    alone.mkdir()
    shutil.copyfile(gguf_file, alone / gguf_file.name)
    return AutoModelForCausalLM.from_pretrained(alone, gguf_file=gguf_file.name, dtype=torch.float32).eval()


def assert_vocabulary_is(path: Path, sp: Any) -> None:
    """The GGUF's tokenizer fields, read with llama.cpp's reader, are the sentencepiece model's."""
    from gguf import GGUFReader, TokenType

    r = GGUFReader(str(path))

    def field(name: str) -> list[Any]:
        f = r.fields[name]
        return [f.parts[i].tolist() if f.types[-1].name != "STRING" else bytes(f.parts[i]).decode() for i in f.data]

    n = sp.vocab_size()
    assert field("tokenizer.ggml.model") == ["llama"]
    assert field("tokenizer.ggml.tokens")[:n] == [sp.id_to_piece(i) for i in range(n)]
    scores = [s[0] for s in field("tokenizer.ggml.scores")[:n]]
    assert scores == pytest.approx([sp.get_score(i) for i in range(n)])
    types = [t[0] for t in field("tokenizer.ggml.token_type")[:n]]
    assert all(t == TokenType.BYTE for i, t in enumerate(types) if sp.is_byte(i))
    assert all(t == TokenType.CONTROL for i, t in enumerate(types) if sp.is_control(i))
    assert field("tokenizer.ggml.add_space_prefix") == [[False]]  # our models put no space before the text
    assert field("tokenizer.ggml.eos_token_id") == [[sp.eos_id()]] and field("tokenizer.ggml.bos_token_id") == [
        [sp.bos_id()]
    ]


def logits(model: Any, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits.float()


@pytest.fixture(scope="module")
def sp_model(tokenized: Path) -> Any:
    import sentencepiece as spm

    return spm.SentencePieceProcessor(model_file=str(tokenizer_model(tokenized)))


def test_our_model_f16_matches_the_export_and_q8_0_within_its_rounding(
    tokenized: Path, sp_model: Any, tmp_path: Path
) -> None:
    """A preset model as `pipeline export` writes it, in f16 (bf16 weights carried exactly) and q8_0 (8-bit
    blocks of 32: the logits within 2% of their largest value here), and the file's vocabulary ours."""
    from transformers import AutoModelForCausalLM

    from pipeline.evaluate.export import model_token_ids, write_hf_model
    from pipeline.evaluate.to_gguf import write_gguf
    from pipeline.model import build_model, resolve_shape

    shape = resolve_shape("tiny", {"hidden_size": 128, "ffn_hidden_size": 256}, sp_model.vocab_size())
    torch.manual_seed(0)
    tok = tokenizer_model(tokenized)
    out = write_hf_model(
        iter(build_model(shape).state_dict().items()), shape, tok, tmp_path / "hf", tok_ids=model_token_ids(None)
    )
    ref = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    for kind, tolerance in (("f16", 1e-4), ("q8_0", 0.02)):
        path = write_gguf(out, out / f"m-{kind}.gguf", kind)
        model = loaded(path)
        assert_vocabulary_is(path, sp_model)
        for p in PROMPTS:
            ids = sp_model.encode(p)
            a, b = logits(ref, ids), logits(model, ids)
            assert (a - b).abs().max().item() <= tolerance * a.abs().max().item(), (kind, p)
    assert (out / "m-q8_0.gguf").stat().st_size < 0.7 * (out / "m-f16.gguf").stat().st_size
    assert not list(out.glob(".*.tmp"))


@pytest.mark.slow  # three models built, exported and loaded back: about 15 s
@pytest.mark.parametrize("family", ["mistral", "qwen2", "qwen3"])
def test_each_exported_family_carries_its_weights(tokenized: Path, sp_model: Any, tmp_path: Path, family: str) -> None:
    """Mistral (run by llama.cpp as llama: q/k reordered), Qwen2 (q/k/v biases) and Qwen3 (q/k norms), each a
    tiny model with our tokenizer: the f16 file's logits are the export's."""
    import transformers as T

    config = {"mistral": T.MistralConfig, "qwen2": T.Qwen2Config, "qwen3": T.Qwen3Config}[family]
    # transformers' GGUF loader reads Qwen3's head size as its default 128, not from the file: keep it 128 here
    head = {"head_dim": 128} if family == "qwen3" else {}
    cfg = config(
        vocab_size=sp_model.vocab_size(),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        **head,
    )
    torch.manual_seed(0)
    model = T.AutoModelForCausalLM.from_config(cfg)
    # (a folder named after the family would make transformers' loader, which reads general.name, load a Mistral
    # as its own class, which it has no GGUF names for; llama.cpp reads the architecture, llama)
    out = export_of(model, tokenizer_model(tokenized), tmp_path / f"tiny-{len(family)}")
    ref = T.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    from pipeline.evaluate.to_gguf import write_gguf

    path = write_gguf(out, out / "m.gguf", "f16")
    ids = sp_model.encode(PROMPTS[1])
    a, b = logits(ref, ids), logits(loaded(path), ids)
    assert (a - b).abs().max().item() <= 1e-3 * a.abs().max().item() + 1e-5


def test_what_the_conversion_cannot_carry_is_refused_naming_the_way_out(tokenized: Path, tmp_path: Path) -> None:
    import transformers as T

    from pipeline.evaluate.to_gguf import write_gguf

    cfg = T.LlamaConfig(
        vocab_size=600,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=4,
        max_position_embeddings=128,
    )
    out = export_of(T.AutoModelForCausalLM.from_config(cfg), tokenizer_model(tokenized), tmp_path / "m")
    (out / "tokenizer.model").unlink()  # as a byte-level BPE model's folder has none
    with pytest.raises(PipelineError, match="convert_hf_to_gguf.py"):
        write_gguf(out, out / "m.gguf")
    shutil.copyfile(tokenizer_model(tokenized), out / "tokenizer.model")
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps(config | {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}))
    with pytest.raises(PipelineError, match="rope_parameters .default. and rope_scaling .yarn. disagree"):
        write_gguf(out, out / "m.gguf")
    dynamic = {"rope_type": "dynamic", "factor": 4.0, "rope_theta": 10000.0}
    (out / "config.json").write_text(json.dumps(config | {"rope_parameters": dynamic}))
    with pytest.raises(PipelineError, match="scales RoPE as .*dynamic.*convert_hf_to_gguf.py"):
        write_gguf(out, out / "m.gguf")
    yarn = {"rope_type": "yarn", "factor": 4.0, "beta_fast": 16.0, "rope_theta": 10000.0}
    (out / "config.json").write_text(json.dumps(config | {"rope_parameters": yarn}))
    with pytest.raises(PipelineError, match="YaRN with transformers' defaults"):
        write_gguf(out, out / "m.gguf")
    with pytest.raises(PipelineError, match="q4_k"):
        write_gguf(out, out / "m.gguf", "q4_k")
    assert not (out / "m.gguf").exists()


@pytest.mark.parametrize(
    "split, bos, pre", [(None, False, "gpt-2"), ("llama3", True, "llama-bpe"), ("qwen2", False, "qwen2")]
)
def test_a_byte_level_bpe_tokenizer_is_carried_as_llama_cpps_gpt2_model(
    tmp_path: Path, split: str | None, bos: bool, pre: str
) -> None:
    """A Qwen2 model with a byte-level BPE tokenizer split as GPT-2's, Llama 3's (putting <s> first) or Qwen2's:
    the file names llama.cpp's pre-tokenizer for that split, holds every token as tokenizer.json spells it in id
    order (the embedding's extra rows as unused padding), the specials as control tokens, the merges, and whether
    a begin-of-sequence id comes first; its weights are the model's."""
    from gguf import GGUFReader, TokenType

    from pipeline.evaluate.to_gguf import LLAMA3_SPLIT, QWEN2_SPLIT, write_gguf
    from tests.hf_families import VOCAB, write_model, write_tokenizer

    expression = {"llama3": LLAMA3_SPLIT, "qwen2": QWEN2_SPLIT, None: None}[split]
    model = write_model("qwen2", tmp_path / "m", write_tokenizer(tmp_path / "tok", expression, bos))
    path = write_gguf(model, tmp_path / "m.gguf", "f16")
    r = GGUFReader(str(path))

    def field(name: str) -> list[Any]:
        f = r.fields[name]
        return [f.parts[i].tolist() if f.types[-1].name != "STRING" else bytes(f.parts[i]).decode() for i in f.data]

    doc = json.loads((model / "tokenizer.json").read_text())
    by_id = {i: t for t, i in doc["model"]["vocab"].items()}
    assert field("tokenizer.ggml.model") == ["gpt2"] and field("tokenizer.ggml.pre") == [pre]
    tokens = field("tokenizer.ggml.tokens")
    assert len(tokens) == VOCAB and tokens[: len(by_id)] == [by_id[i] for i in range(len(by_id))]
    assert tokens[len(by_id) :] == [f"[PAD{i}]" for i in range(len(by_id), VOCAB)]
    types = [t[0] for t in field("tokenizer.ggml.token_type")]
    assert types[:3] == [TokenType.CONTROL] * 3 and set(types[3 : len(by_id)]) == {TokenType.NORMAL}
    assert set(types[len(by_id) :]) == {TokenType.UNUSED}
    assert len(field("tokenizer.ggml.merges")) == len(doc["model"]["merges"])
    assert field("tokenizer.ggml.add_bos_token") == [[bos]] and field("tokenizer.ggml.bos_token_id") == [[1]]
    assert field("tokenizer.ggml.eos_token_id") == [[2]]
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    ids = [1, 50, 60, 70, 300, 599, 5]
    assert torch.equal(logits(ref, ids), logits(loaded(path), ids))


def test_a_pre_tokenizer_llama_cpp_is_not_told_of_here_is_refused_naming_the_way_out(tmp_path: Path) -> None:
    from pipeline.evaluate.to_gguf import write_gguf
    from tests.hf_families import write_model, write_tokenizer

    model = write_model("qwen2", tmp_path / "m", write_tokenizer(tmp_path / "tok", r"\p{L}+|\p{N}|\s+"))
    with pytest.raises(PipelineError, match="its pre-tokenizer is none that this conversion names for llama.cpp"):
        write_gguf(model, tmp_path / "m.gguf")
    assert not (tmp_path / "m.gguf").exists()


def test_a_tokenizer_the_conversion_cannot_carry_is_refused_before_the_export(tokenized: Path, tmp_path: Path) -> None:
    """Asked before a weight is read (`tokenizer_problem`, what `pipeline export --gguf` checks first): a
    sentencepiece model is carried, a byte-level BPE tokenizer.json too; a Metaspace one (Llama 2's tokenizer.json
    without its tokenizer.model) is refused naming the way out."""
    from pipeline.evaluate.to_gguf import tokenizer_problem
    from tests.hf_families import write_tokenizer

    assert tokenizer_problem(tokenizer_model(tokenized)) is None
    folder = write_tokenizer(tmp_path / "bpe")  # GPT-2's split
    assert tokenizer_problem(folder) is None
    doc = json.loads((folder / "tokenizer.json").read_text())
    (folder / "tokenizer.json").write_text(json.dumps(doc | {"decoder": {"type": "Metaspace"}}))
    problem = tokenizer_problem(folder)
    assert problem and "is not a byte-level BPE tokenizer (model BPE, decoder Metaspace)" in problem
    assert "convert_hf_to_gguf.py" in problem
    assert "neither a sentencepiece tokenizer.model nor a tokenizer.json" in str(tokenizer_problem(tmp_path))


def test_an_interrupted_re_export_leaves_the_earlier_one_whole(
    tokenized: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The GGUF files are written in the export's temporary folder, which replaces the earlier export whole: a
    Ctrl-C (or SIGTERM) while the second GGUF is written leaves the earlier folder as it was, its GGUF files with
    it, and nothing beside it."""
    import pipeline.evaluate.to_gguf as to_gguf
    from pipeline.evaluate.export import gguf_name, write_hf_model
    from pipeline.model import build_model
    from pipeline.model.families import model_shape

    shape = model_shape("tiny", {}, None, 600, 1024, {}, None)
    tok = tokenizer_model(tokenized)
    out = tmp_path / "export"
    torch.manual_seed(0)
    write_hf_model(iter(build_model(shape).state_dict().items()), shape, tok, out, gguf=("f16", "q8_0"))
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    assert gguf_name(out, "q8_0") in before and gguf_name(out, "f16") in before
    real, calls = to_gguf.write_gguf, []

    def second_interrupted(hf_dir: Path, path: Path, kind: str = "f16") -> Path:
        calls.append(kind)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(hf_dir, path, kind)

    monkeypatch.setattr(to_gguf, "write_gguf", second_interrupted)
    torch.manual_seed(1)
    with pytest.raises(KeyboardInterrupt):
        write_hf_model(iter(build_model(shape).state_dict().items()), shape, tok, out, gguf=("f16", "q8_0"))
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]
