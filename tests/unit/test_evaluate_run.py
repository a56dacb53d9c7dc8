"""pipeline.evaluate.run: batched greedy continuations are each prompt's own."""

from __future__ import annotations

from pathlib import Path

import torch


def test_batched_greedy_continuations_equal_one_prompt_at_a_time(tokenized: Path) -> None:
    """The prompts are generated in one left-padded batch (fewer ZeRO-3 gathers); each greedy continuation is the
    one the prompt gets alone."""
    from pipeline.data.tokenizer import Tokenizer
    from pipeline.evaluate.run import generate
    from pipeline.model import build_model, resolve_shape

    tok = Tokenizer(Path(f"{tokenized}.tokenizer.model"))
    torch.manual_seed(0)
    model = build_model(
        resolve_shape("tiny", {}, tok.vocab_size), bos_id=tok.bos_id, eos_id=tok.eos_id, pad_id=tok.pad_id
    ).eval()
    prompts = ["ROMEO:\n", "To be, or not to be, that is the question", "The king"]
    cpu = torch.device("cpu")
    batched = generate(model, tok, prompts, seed=1, max_new_tokens=12, device=cpu)
    alone = [generate(model, tok, [p], seed=1, max_new_tokens=12, device=cpu)[0] for p in prompts]
    assert [b["greedy"] for b in batched] == [a["greedy"] for a in alone]
    assert all(b["prompt"] == p for b, p in zip(batched, prompts, strict=True))
