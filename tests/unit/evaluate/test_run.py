"""pipeline.evaluate.run: batched greedy continuations are each prompt's own; the loss by position bucket."""

from __future__ import annotations

from pathlib import Path

import pytest
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


def test_the_loss_by_position_adds_up_to_the_loss(shards: Path) -> None:
    """`pipeline evaluate` reports the loss by position bucket (0-8, 8-16, ... of a 64-token sample), the signal a
    context extension is judged by: the buckets cover every position once and their token-weighted mean is the
    loss; the table prints them."""
    from pipeline.data.loader import ShardedDataset
    from pipeline.data.tokenizer import Tokenizer
    from pipeline.evaluate.run import perplexity, position_buckets, table
    from pipeline.model import build_model, resolve_shape

    val = ShardedDataset(shards, "val")
    tok = Tokenizer(val.tokenizer_path)
    torch.manual_seed(0)
    model = build_model(resolve_shape("tiny", {}, tok.vocab_size)).eval()
    got = perplexity(model, val, tok, batch_size=4, max_batches=2)
    buckets = got["loss_by_position"]
    assert [(b["from"], b["to"]) for b in buckets] == list(zip(range(0, 64, 8), range(8, 72, 8), strict=True))
    assert sum(b["tokens"] for b in buckets) == got["tokens"]
    assert sum(b["loss"] * b["tokens"] for b in buckets) / got["tokens"] == pytest.approx(got["loss"], rel=1e-9)
    assert position_buckets(32768) == [4096 * k for k in range(9)] and position_buckets(3) == [0, 1, 2, 3]
    result = {**got, "checkpoint": "c", "step": 1, "consumed_tokens": 1, "split": "val", "samples_generated": []}
    assert "loss by position   0-8: " in table({**result, "output": "x.json"})
    # the mean of checkpoints is said in the table, not only in the JSON and the file name (newcomer trial 4, #73)
    assert "weights" not in table({**result, "output": "x.json"})
    mean = table({**result, "output": "x.json", "averaged": ["step00000010", "step00000012"]})
    assert "the mean of 2 checkpoints: step00000010, step00000012" in mean and "1 (the newest averaged)" in mean


def test_the_loss_by_source_adds_up_to_the_loss(two_sources: Path) -> None:
    """On a blend of two sources `pipeline evaluate` reports each source's loss, perplexity and bits per byte over
    its own samples: the sources' tokens and bytes are the total's, their token-weighted loss is the loss and
    their byte-weighted bits per byte the bits per byte (within 1e-9); the table names both."""
    from pipeline.data.loader import ShardedDataset
    from pipeline.data.tokenizer import Tokenizer
    from pipeline.evaluate.run import perplexity, table
    from pipeline.model import build_model, resolve_shape

    val = ShardedDataset(two_sources, "val")
    tok = Tokenizer(val.tokenizer_path)
    torch.manual_seed(0)
    model = build_model(resolve_shape("tiny", {}, tok.vocab_size)).eval()
    got = perplexity(model, val, tok, batch_size=3)
    sources = got["by_source"]
    assert [s["source"] for s in sources] == ["first", "second"] and all(s["tokens"] > 0 for s in sources)
    assert sum(s["tokens"] for s in sources) == got["tokens"] and sum(s["bytes"] for s in sources) == got["bytes"]
    assert sum(s["loss"] * s["tokens"] for s in sources) / got["tokens"] == pytest.approx(got["loss"], rel=1e-9)
    assert sum(s["bits_per_byte"] * s["bytes"] for s in sources) / got["bytes"] == pytest.approx(
        got["bits_per_byte"], rel=1e-9
    )
    assert sources[0]["loss"] != pytest.approx(sources[1]["loss"], rel=1e-6)  # two sources, two figures
    result = {**got, "checkpoint": "c", "step": 1, "consumed_tokens": 1, "split": "val", "samples_generated": []}
    shown = table({**result, "output": "x.json"})
    assert "by source" in shown and "first: " in shown and "second: " in shown
