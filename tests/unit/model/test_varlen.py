"""pipeline.model.varlen: the varlen attention path gives the per-token losses and gradients of SDPA with
transformers' dense mask (whole documents, a sliding window, both); which path a run takes and what sequence
parallelism refuses, read from the model's own transformers config."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from pipeline.data.loader import document_positions
from pipeline.model import build_model, resolve_shape, varlen
from pipeline.model.families import read_config, shape_from_config
from pipeline.model.varlen import AttentionFacts, choose_documents, sequence_parallel_attention_problems
from tests.hf_families import MISTRAL_WINDOW_16

ROOT = Path(__file__).resolve().parents[3]
EOS = 2


def mistral(window: int | None) -> object:
    cfg = {**MISTRAL_WINDOW_16, "sliding_window": window, "vocab_size": 300, "_name_or_path": "tiny-mistral"}
    return shape_from_config(cfg, "tiny-mistral")


def batch(seed: int = 0) -> dict[str, torch.Tensor]:
    """Two rows of 64 tokens: the first holds three documents, the second two (EOS ends each)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 300, (2, 64), generator=g)
    ids[0, 20], ids[0, 45], ids[1, 5] = EOS, EOS, EOS
    return {
        "input_ids": ids,
        "labels": torch.randint(3, 300, (2, 64), generator=g),
        "position_ids": document_positions(ids, EOS),
    }


def losses_and_grads(model: torch.nn.Module, b: dict[str, torch.Tensor]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    model.zero_grad()
    per_token = model(input_ids=b["input_ids"], loss_labels=b["labels"], position_ids=b["position_ids"])
    per_token.sum().backward()
    return per_token.detach(), [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize(
    "case", ["llama_whole_documents", "mistral_window_one_document", "mistral_window_whole_documents"]
)
def test_the_varlen_path_gives_the_dense_masks_per_token_losses_and_gradients(case: str) -> None:
    shape = resolve_shape("tiny", {"vocab_size": 300}, None) if case.startswith("llama") else mistral(16)
    b = batch()
    if case == "mistral_window_one_document":
        b["position_ids"] = torch.arange(64).expand(2, 64)
    torch.manual_seed(0)
    model = build_model(shape)
    dense, dense_grads = losses_and_grads(model, b)
    varlen.use(model, varlen.DocumentAttention("varlen", ""))
    assert model.config._attn_implementation == varlen.VARLEN
    mine, grads = losses_and_grads(model, b)
    assert torch.allclose(mine, dense, atol=1e-5, rtol=1e-5), (mine - dense).abs().max()
    for got, want in zip(grads, dense_grads, strict=True):
        assert torch.allclose(got, want, atol=1e-5, rtol=1e-4)


def test_the_window_and_the_documents_change_the_losses_so_the_equality_above_can_fail() -> None:
    b = batch()
    torch.manual_seed(0)
    windowed = build_model(mistral(16))
    torch.manual_seed(0)
    full = build_model(mistral(None))
    full.load_state_dict(windowed.state_dict())
    for m in (windowed, full):
        varlen.use(m, varlen.DocumentAttention("varlen", ""))
    a, _ = losses_and_grads(windowed, b)
    c, _ = losses_and_grads(full, b)
    assert (a - c).abs().max() > 1e-3  # the window masks what a causal attention would see
    crossing = dict(b, position_ids=torch.arange(64).expand(2, 64))
    d, _ = losses_and_grads(full, crossing)
    assert (c - d).abs().max() > 1e-3  # documents apart differ from one document


def test_document_bounds_start_at_each_restart_and_at_every_row() -> None:
    positions = torch.tensor([[0, 1, 2, 0, 1, 0], [3, 4, 5, 0, 1, 2]])  # a row may start mid-document
    bounds, longest = varlen.document_bounds(positions, 6)
    assert bounds.tolist() == [0, 3, 5, 6, 9, 12] and bounds.dtype == torch.int32 and longest == 3


def test_the_path_is_chosen_where_masks_matter_and_dense_only_where_varlen_cannot_run(monkeypatch) -> None:
    facts = AttentionFacts(None, ("default",))
    window = AttentionFacts(4096, ("default",))

    def choose(setting: str, device: str, whole: bool = True, f: AttentionFacts = facts, seq: int = 32768):
        return choose_documents(
            setting, whole_documents=whole, facts=f, seq_len=seq, micro_batch_size=1, device_type=device
        )  # type: ignore[arg-type]

    assert choose("auto", "cpu", whole=False).kind == "sdpa"
    assert choose("auto", "cpu", whole=False, f=window, seq=4096).kind == "sdpa"  # a window as long as the sample
    assert choose("auto", "cpu", whole=False, f=window).kind == "varlen"
    assert choose("auto", "cpu").kind == "varlen"
    dense = choose("dense", "cpu")
    assert dense.kind == "dense" and "a 1 GiB boolean mask per micro-batch" in dense.note and "2 GiB" in dense.note
    monkeypatch.setattr(varlen.importlib.util, "find_spec", lambda name: None)  # a CUDA node without flash_attn
    fallback = choose("auto", "cuda")
    assert fallback.kind == "dense" and "flash_attn is not installed" in fallback.note
    assert choose("varlen", "cuda").kind == "dense"
    monkeypatch.setattr(varlen.importlib.util, "find_spec", lambda name: object())
    flash = choose("auto", "cuda")
    assert flash.kind == "varlen" and "FlashAttention-2's varlen kernel" in flash.note


def test_sequence_parallelism_refuses_what_it_would_silently_change_and_nothing_else() -> None:
    plain = AttentionFacts(None, ("llama3",))
    window = AttentionFacts(16, ("default",))
    assert sequence_parallel_attention_problems(2, plain, 64, False, False) == []
    assert sequence_parallel_attention_problems(1, AttentionFacts(16, ("longrope",)), 64, True, False) == []
    assert sequence_parallel_attention_problems(2, window, 64, True, True) == []
    assert sequence_parallel_attention_problems(2, window, 16, False, False) == []  # window = sample
    both = sequence_parallel_attention_problems(2, window, 64, True, False)
    assert len(both) == 2 and "--whole-documents" in both[0] and "sliding window of 16" in both[1]
    for kind in ("dynamic", "longrope"):
        (line,) = sequence_parallel_attention_problems(4, AttentionFacts(None, (kind,)), 64, False, True)
        assert line.startswith("train.sequence_parallel 4: ") and f"RoPE ({kind})" in line and "yarn" in line


@pytest.mark.parametrize(
    "name, window, rope",
    [
        ("mistral-7b-v0.1", 4096, "default"),
        ("llama-3.1-70b", None, "llama3"),
        ("qwen2.5-7b", None, "default"),  # sliding_window in config.json, use_sliding_window false
    ],
)
def test_attention_facts_are_the_shipped_configs_own(name: str, window: int | None, rope: str) -> None:
    path = ROOT / "configs" / "hf" / f"{name}.json"
    facts = varlen.attention_facts(shape_from_config(read_config(path), path))
    assert facts.sliding_window == window and facts.rope_types == (rope,)


def test_qwen_with_sliding_layers_past_max_window_layers_has_a_window(tmp_path: Path) -> None:
    raw = json.loads((ROOT / "configs" / "hf" / "qwen2.5-7b.json").read_text())
    raw.update(use_sliding_window=True, sliding_window=1024, max_window_layers=20)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    facts = varlen.attention_facts(shape_from_config(read_config(tmp_path), tmp_path))
    assert facts.sliding_window == 1024
