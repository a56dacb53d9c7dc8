"""pipeline.evaluate.needle: needle-in-a-haystack prompts built in the model's own tokens at the lengths asked
(none cut short), seeded, from the evaluated split's text; scored by the answer's loss and the greedy answer."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pipeline.data.loader import ShardedDataset
from pipeline.data.tokenizer import Tokenizer
from pipeline.errors import PipelineError
from pipeline.evaluate.needle import DEPTHS, NEEDLE, QUESTION, needle_prompts, parse_lengths, score


def test_every_prompt_is_the_length_asked_holds_its_needle_at_its_depth_and_is_seeded(shards: Path) -> None:
    val = ShardedDataset(shards, "val")
    tok = Tokenizer(val.tokenizer_path)
    lengths = [128, 900]  # 900: more than the split's text, which is then repeated
    prompts = needle_prompts(val, tok, lengths, seed=3)
    assert [(p.length, p.depth) for p in prompts] == [(n, d) for n in lengths for d in DEPTHS]
    for p in prompts:
        assert abs(len(p.ids) - p.length) <= 0.01 * p.length, (p.length, len(p.ids))
        text = tok.decode(p.ids)
        assert f"The secret number is {p.answer}." in text and text.rstrip().endswith("The secret number is")
        needle = tok.encode(NEEDLE.format(answer=p.answer))
        at = next(i for i in range(len(p.ids)) if p.ids[i : i + len(needle)] == needle)
        hay = p.length - len(needle) - len(tok.encode(QUESTION))  # the depth is the needle's place in the haystack
        assert abs(at / hay - p.depth) < 0.02, (at, hay, p.depth)
    assert len({p.answer for p in prompts}) == len(prompts)
    again = needle_prompts(val, tok, lengths, seed=3)
    assert [p.ids for p in again] == [p.ids for p in prompts]
    assert [p.answer for p in needle_prompts(val, tok, lengths, seed=4)] != [p.answer for p in prompts]


def test_a_model_that_was_shown_the_answer_scores_better_than_one_that_was_not(shards: Path) -> None:
    """The score tells models apart: a tiny model fitted for a few steps to one prompt's answer finds it and gives
    it a low loss; the fresh model does neither. Results by length."""
    from pipeline.model import build_model, resolve_shape

    val = ShardedDataset(shards, "val")
    tok = Tokenizer(val.tokenizer_path)
    prompts = needle_prompts(val, tok, [96], seed=1, depths=(0.5,))
    torch.manual_seed(0)
    model = build_model(resolve_shape("tiny", {}, tok.vocab_size), eos_id=tok.eos_id, pad_id=tok.pad_id).eval()
    cpu = torch.device("cpu")
    fresh = score(model, prompts, cpu)
    assert [b["length"] for b in fresh["by_length"]] == [96] and fresh["by_length"][0]["found"] == 0.0
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.tensor([prompts[0].ids + prompts[0].answer_ids])
    model.train()
    for _ in range(60):
        logits = model(input_ids=ids).logits[0, :-1]
        loss = torch.nn.functional.cross_entropy(logits, ids[0, 1:])
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    fitted = score(model, prompts, cpu)
    assert fitted["by_length"][0]["found"] == 1.0
    assert fitted["by_length"][0]["answer_loss"] < fresh["by_length"][0]["answer_loss"] / 4


def test_needle_lengths_are_checked_against_the_model() -> None:
    assert parse_lengths("8192, 2048,8192", 32768) == [2048, 8192]
    for bad, said in (("8k", "give prompt lengths in tokens"), ("32", "at least 64"), ("65536", "beyond the model's")):
        with pytest.raises(PipelineError, match=said):
            parse_lengths(bad, 32768)
