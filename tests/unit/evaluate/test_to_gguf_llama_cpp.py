"""`pipeline export --gguf` checked by llama.cpp itself, the way users run the file (llama-cpp-python, in its own
venv): for our preset with our sentencepiece tokenizer, and for Llama 3.1 (its RoPE scaling, a begin-of-sequence
id), Mistral, Qwen2 and Qwen3 models with byte-level BPE tokenizers split as Llama 3's, Qwen2's and GPT-2's are,
llama.cpp's tokenizer gives transformers' ids for the export, and its logits on those ids are transformers'
(f16 and q8_0, tolerances below). llama-cpp-python has no wheel in the package index: `make llama-cpp` builds
llama.cpp once (about 15 minutes here) into a wheel cache outside the checkout; `make test-gguf` builds it if
needed and runs this file; without it, this file is skipped (the suite checks the same files with transformers'
GGUF loader, tests/unit/evaluate/test_to_gguf.py)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.conftest import tokenizer_model

ROOT = Path(__file__).resolve().parents[3]
LLAMA_PYTHON = Path(os.environ.get("LLAMA_CPP_PYTHON", ROOT / ".venv-llama-cpp" / "bin" / "python"))
WORKER = ROOT / "tests" / "llama_cpp_worker.py"

pytest.importorskip("gguf", reason="pip install -e '.[gguf]'")
if not LLAMA_PYTHON.exists() or subprocess.run([str(LLAMA_PYTHON), "-c", "import llama_cpp"]).returncode != 0:
    pytest.skip(
        f"llama.cpp is not installed in {LLAMA_PYTHON.parent.parent} (`make llama-cpp`)", allow_module_level=True
    )
pytestmark = pytest.mark.slow

PROMPTS = [
    "To be, or not to be: that is the question",
    "KING HENRY. Once more unto the breach, 1415 friends; don't stop",
    "Caf\u00e9 na\u00efve -- 12345 words\n\n  indented, twice",
]
TOLERANCE = {"f16": 0.01, "q8_0": 0.15}
"""llama.cpp's logits against transformers' (float32 on the export's bf16 weights), as a share of the largest
logit: f16 computes in half precision; q8_0 also rounds each block of 32 weights to 8 bits."""


def llama_cpp(gguf_file: Path, prompts: list[str], ids: list[list[int]], tmp: Path) -> dict[str, Any]:
    request, answer = tmp / f"{gguf_file.stem}.request.json", tmp / f"{gguf_file.stem}.answer.json"
    request.write_text(json.dumps({"gguf": str(gguf_file), "prompts": prompts, "ids": ids}))
    done = subprocess.run([str(LLAMA_PYTHON), str(WORKER), str(request), str(answer)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(answer.read_text())


def check(hf_dir: Path, tmp: Path) -> dict[str, float]:
    """Each GGUF kind of `hf_dir` through llama.cpp against transformers on the same folder: the token ids equal,
    the logits within TOLERANCE; returns each kind's largest difference as a share of the largest logit."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pipeline.evaluate.to_gguf import write_gguf

    tok = AutoTokenizer.from_pretrained(str(hf_dir))
    expected = [tok(p)["input_ids"] for p in PROMPTS]
    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        reference = [model(torch.tensor([ids])).logits[0] for ids in expected]
    worst = {}
    for kind, tolerance in TOLERANCE.items():
        got = llama_cpp(write_gguf(hf_dir, tmp / f"{hf_dir.name}-{kind}.gguf", kind), PROMPTS, expected, tmp)
        assert got["tokens"] == expected, (kind, got["tokens"], expected)
        shares = [
            ((torch.tensor(lc) - ref).abs().max() / ref.abs().max()).item()
            for lc, ref in zip(got["logits"], reference, strict=True)
        ]
        worst[kind] = max(shares)
        assert worst[kind] <= tolerance, (kind, shares)
    print(f"{hf_dir.name}: llama.cpp's logits within {worst} of the largest")
    return worst


def test_our_preset_and_sentencepiece_tokenizer_run_in_llama_cpp_as_in_transformers(
    tokenized: Path, tmp_path: Path
) -> None:
    import sentencepiece as spm

    from pipeline.evaluate.export import model_token_ids, write_hf_model
    from pipeline.model import build_model, resolve_shape

    tok = tokenizer_model(tokenized)
    sp = spm.SentencePieceProcessor(model_file=str(tok))
    shape = resolve_shape("tiny", {"hidden_size": 128, "ffn_hidden_size": 256}, sp.vocab_size())
    torch.manual_seed(0)
    out = write_hf_model(
        iter(build_model(shape).state_dict().items()), shape, tok, tmp_path / "ours", tok_ids=model_token_ids(None)
    )
    check(out, tmp_path)


@pytest.mark.parametrize(
    "family, split, bos",
    [("llama", "llama3", True), ("qwen2", "qwen2", False), ("qwen3", "qwen2", False), ("mistral", None, False)],
)
def test_each_family_and_byte_level_bpe_tokenizer_runs_in_llama_cpp_as_in_transformers(
    tmp_path: Path, family: str, split: str | None, bos: bool
) -> None:
    """Llama is Llama 3.1's config (rope_scaling llama3: llama.cpp's rope_freqs) with a tokenizer split as Llama
    3's that puts <s> first; Qwen2 and Qwen3 split as Qwen2's; Mistral here with GPT-2's split."""
    from pipeline.evaluate.to_gguf import LLAMA3_SPLIT, QWEN2_SPLIT
    from tests.hf_families import write_model, write_tokenizer

    expression = {"llama3": LLAMA3_SPLIT, "qwen2": QWEN2_SPLIT, None: None}[split]
    model = write_model(family, tmp_path / family, write_tokenizer(tmp_path / "tok", expression, bos))
    check(model, tmp_path)


@pytest.mark.parametrize(
    "family, scaling",
    [
        ("qwen2", {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}),
        ("mistral", {"rope_type": "linear", "factor": 2.0}),
    ],
)
def test_a_context_extended_model_runs_in_llama_cpp_with_its_rope_scaling(
    tmp_path: Path, family: str, scaling: dict[str, Any]
) -> None:
    """YaRN as Qwen2.5's model cards tell users to set it (`rope_scaling` with `type: yarn`, what `model.rope`
    writes for a context extension), and linear position interpolation: llama.cpp's own scaling types, its logits
    transformers'."""
    from tests.hf_families import write_model, write_tokenizer

    model = write_model(family, tmp_path / family, write_tokenizer(tmp_path / "tok"), rope_scaling=scaling)
    check(model, tmp_path)
