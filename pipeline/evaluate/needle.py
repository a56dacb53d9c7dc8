"""A needle in a haystack at the lengths a run trained for (`pipeline evaluate --needle 8192,32768`): does the model
still find a fact put anywhere in a long context of the user's own text? A seeded generator builds each prompt in
the model's own tokens, so none is cut short: the haystack is the evaluated split's text, a needle sentence
("The secret number is 48213.") goes in at a depth (10%, 50%, 90% of the haystack), and the question closes it
("... The secret number is"); every prompt is exactly the length asked. Each prompt is scored twice: the
answer's loss given the prompt (a continuous signal even where a small model never retrieves it) and whether the
greedy continuation is the answer."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Any

import torch

from pipeline.data.loader import ShardedDataset
from pipeline.data.tokenizer import Tokenizer
from pipeline.errors import PipelineError

DEPTHS = (0.1, 0.5, 0.9)
"""Where in the haystack the needle goes, as a fraction of its tokens."""
NEEDLE = " The secret number is {answer}. "
QUESTION = " What is the secret number? The secret number is"


@dataclass(frozen=True, slots=True)
class NeedlePrompt:
    length: int
    depth: float
    ids: list[int]
    answer: str
    answer_ids: list[int]


def parse_lengths(text: str, max_positions: int) -> list[int]:
    """`--needle 8192,32768` as lengths in tokens; one line where one is not a number or is longer than the
    model's positions."""
    try:
        lengths = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise PipelineError(f"--needle {text}: give prompt lengths in tokens, e.g. --needle 8192,32768") from None
    if not lengths or lengths[0] < 64:
        raise PipelineError(f"--needle {text}: each length must be at least 64 tokens")
    if lengths[-1] > max_positions:
        raise PipelineError(
            f"--needle {text}: {lengths[-1]} tokens is beyond the model's {max_positions} positions "
            "(max_position_embeddings): ask for lengths it was built for"
        )
    return lengths


def haystack(dataset: ShardedDataset, tokenizer: Tokenizer, tokens: int) -> list[int]:
    """At least `tokens` ids of the split's own text, its samples in order without their end-of-document ids
    (the model reads your text, not a filler it never saw)."""
    out: list[int] = []
    for i in range(len(dataset)):
        out += [int(t) for t in dataset[i] if int(t) not in (tokenizer.eos_id, tokenizer.bos_id)]
        if len(out) >= tokens:
            return out
    if not out:
        raise PipelineError(f"{dataset.path}: the {dataset.split} split holds no text for a haystack")
    return (out * math.ceil(tokens / len(out)))[:tokens]  # a small split, repeated


def needle_prompts(
    dataset: ShardedDataset, tokenizer: Tokenizer, lengths: list[int], seed: int, depths: tuple[float, ...] = DEPTHS
) -> list[NeedlePrompt]:
    """One prompt per (length, depth), each exactly `length` tokens of the model's tokenizer, each with its own
    seeded answer (a five-digit number)."""
    rng = random.Random(seed)
    hay = haystack(dataset, tokenizer, max(lengths))
    question = tokenizer.encode(QUESTION)
    prompts = []
    for length in lengths:
        for depth in depths:
            answer = str(rng.randrange(10_000, 100_000))
            needle = tokenizer.encode(NEEDLE.format(answer=answer))
            room = length - len(needle) - len(question)
            if room < 8:
                raise PipelineError(f"--needle {length}: too short for the needle and the question")
            at = round(room * depth)
            ids = hay[:at] + needle + hay[at:room] + question
            answer_ids = tokenizer.encode(" " + answer)
            prompts.append(NeedlePrompt(length, depth, ids, answer, answer_ids))
    return prompts


@torch.no_grad()
def score(model: torch.nn.Module, prompts: list[NeedlePrompt], device: torch.device) -> dict[str, Any]:
    """Each prompt's answer loss (mean nats per answer token, teacher-forced) and whether the greedy
    continuation of as many tokens is the answer; the mean of each by length."""
    rows = []
    for p in prompts:
        ids = torch.tensor([p.ids + p.answer_ids], device=device)
        logits = model(input_ids=ids).logits[0, len(p.ids) - 1 : -1].float()
        target = torch.tensor(p.answer_ids, device=device)
        loss = float(torch.nn.functional.cross_entropy(logits, target))
        greedy = _greedy(model, p.ids, len(p.answer_ids), device)
        rows.append({"length": p.length, "depth": p.depth, "answer_loss": loss, "found": greedy == p.answer_ids})
    by_length = []
    for length in sorted({r["length"] for r in rows}):
        mine = [r for r in rows if r["length"] == length]
        by_length.append(
            {
                "length": length,
                "found": sum(r["found"] for r in mine) / len(mine),
                "answer_loss": sum(r["answer_loss"] for r in mine) / len(mine),
                "prompts": len(mine),
            }
        )
    return {"by_length": by_length, "prompts": rows}


def _greedy(model: Any, ids: list[int], n: int, device: torch.device) -> list[int]:
    prompt = torch.tensor([ids], device=device)
    out = model.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False, max_new_tokens=n)
    return [int(t) for t in out[0, len(ids) :]]
