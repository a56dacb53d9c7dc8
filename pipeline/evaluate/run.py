"""Stage 4: evaluate a saved checkpoint (held-out loss, perplexity, bits per byte, samples, loss plot) in one
process, CPU or GPU, on a checkpoint of any ZeRO stage; its inputs are pipeline.evaluate.inputs', the export to
a Hugging Face folder pipeline.evaluate.export's."""

from __future__ import annotations

import itertools
import json
import math
import time
from pathlib import Path
from typing import Any

import torch

from pipeline.atomic import tmp_path_for, write_json
from pipeline.data.loader import ShardedDataset, collate_samples
from pipeline.data.tokenizer import Tokenizer
from pipeline.evaluate.inputs import (
    EvalConfig,
    Inputs,
    RunFolder,
    base_model_path,
    batch_for_card,
    device_for,
    load_base_model,
    load_model,
    open_inputs,
)
from pipeline.progress import Progress


@torch.no_grad()
def perplexity(
    model: torch.nn.Module,
    dataset: ShardedDataset,
    tokenizer: Tokenizer,
    *,
    batch_size: int = 8,
    max_batches: int | None = None,
    device: torch.device | None = None,
    rank: int = 0,
    world_size: int = 1,
    rows: list[tuple[int, float, int]] | None = None,
    desc: str = "evaluate",
) -> dict[str, Any]:
    """Loss (nats/token), perplexity and bits per byte over the split's samples in order, in total and by source
    (each `pipeline shard` input: a blend's component, a domain); bytes are those of the decoded label tokens, so
    the figure is comparable across tokenizers. The loss comes from the model's
    chunked per-token path, so no full (B, T, V) fp32 logits are built.

    Across ranks (ZeRO-3, `world_size` > 1) rank r takes batches r, r + W, ...; every rank runs the same number
    of forwards (a rank without a batch in the last round repeats batch 0 and discards it), since each forward
    gathers parameters collectively; the sums are all-reduced in fp64. `rows` (one process): each evaluated
    sample's (source, nats, tokens) appended, in order, for a paired comparison of two models."""
    device = device or torch.device("cpu")
    n = len(dataset)
    batches = math.ceil(n / batch_size) if max_batches is None else min(max_batches, math.ceil(n / batch_size))
    seq_len = int(dataset.manifest["seq_len"])
    edges = position_buckets(seq_len)
    names = dataset.source_names if n and dataset.sources_of([0]) is not None else []
    by_source = 3 + 2 * (len(edges) - 1)  # where the nats, tokens and bytes of each source start
    # nats, tokens, bytes; nats and tokens per bucket; nats, tokens and bytes per source
    sums = [0.0, 0.0, 0.0] + [0.0] * (2 * (len(edges) - 1)) + [0.0] * (3 * len(names))
    # rate and ETA on a terminal (rank 0's), silent in a log
    progress = Progress(min(n, batches * batch_size) * seq_len, desc, None if rank == 0 else False, unit="tok")
    for round_start in range(0, batches, world_size):
        b = round_start + rank
        mine = b < batches
        ids = list(range((b if mine else 0) * batch_size, min(n, ((b if mine else 0) + 1) * batch_size)))
        batch = collate_samples(dataset, ids)
        labels = batch["labels"]
        extra = {"position_ids": batch["position_ids"].to(device)} if "position_ids" in batch else {}
        losses = model(input_ids=batch["input_ids"].to(device), loss_labels=labels.to(device), **extra)
        if not mine:
            continue
        progress.update(len(ids) * seq_len * world_size)
        sums[0] += float(losses.double().sum())
        sums[1] += int((labels != -100).sum())
        _add_positions(sums, 3, edges, batch, losses)
        row_bytes = [len(tokenizer.decode([t for t in row if t >= 0]).encode("utf-8")) for row in labels.tolist()]
        sums[2] += sum(row_bytes)
        if names or rows is not None:
            sources = dataset.sources_of(ids) if names else None
            _add_rows(sums, by_source if names else None, rows, losses, labels, row_bytes, sources)
    progress.close()
    if world_size > 1:
        import torch.distributed as dist

        total = torch.tensor(sums, dtype=torch.float64, device=device)
        dist.all_reduce(total)
        sums = total.tolist()
    nats, tokens, nbytes = sums[0], int(sums[1]), int(sums[2])
    loss = nats / max(tokens, 1)
    return {
        "loss": loss,
        "perplexity": math.exp(min(loss, 50.0)),
        "bits_per_byte": nats / math.log(2) / max(nbytes, 1),
        "tokens": tokens,
        "bytes": nbytes,
        "samples": min(n, batches * batch_size),
        "loss_by_position": [
            {"from": lo, "to": hi, "loss": sums[3 + 2 * k] / max(sums[4 + 2 * k], 1), "tokens": int(sums[4 + 2 * k])}
            for k, (lo, hi) in enumerate(itertools.pairwise(edges))
        ],
        "by_source": [_figures(name, *sums[by_source + 3 * k : by_source + 3 * k + 3]) for k, name in enumerate(names)],
    }


def _add_positions(sums: list[float], at: int, edges: list[int], batch: dict[str, Any], losses: torch.Tensor) -> None:
    """Nats and counted tokens by position bucket into `sums[at:]` (pairs): at each token's position in its
    document where samples hold whole documents."""
    labels = batch["labels"]
    where = batch.get("position_ids", torch.arange(labels.size(1)).expand_as(labels)).reshape(-1)
    per_position = torch.zeros(labels.size(1), dtype=torch.float64).index_add_(
        0, where, losses.detach().double().cpu().reshape(-1)
    )
    counted = torch.zeros(labels.size(1), dtype=torch.long).index_add_(0, where, (labels != -100).reshape(-1).long())
    for k, (lo, hi) in enumerate(itertools.pairwise(edges)):
        sums[at + 2 * k] += float(per_position[lo:hi].sum())
        sums[at + 1 + 2 * k] += int(counted[lo:hi].sum())


def _add_rows(
    sums: list[float],
    at: int | None,
    rows: list[tuple[int, float, int]] | None,
    losses: torch.Tensor,
    labels: torch.Tensor,
    row_bytes: list[int],
    sources: Any,
) -> None:
    """Each sample's nats, tokens and bytes: into its source's triple at `sums[at + 3 * source]` (with `at`), and
    appended to `rows` as (source, nats, tokens) (with `rows`)."""
    row_nats = losses.detach().double().cpu().reshape(labels.shape).sum(dim=1).tolist()
    row_tokens = (labels != -100).sum(dim=1).tolist()
    of = sources.tolist() if sources is not None else [0] * len(row_nats)
    for src, nats, count, nbytes in zip(of, row_nats, row_tokens, row_bytes, strict=True):
        if rows is not None:
            rows.append((src, nats, count))
        if at is not None:
            sums[at + 3 * src] += nats
            sums[at + 3 * src + 1] += count
            sums[at + 3 * src + 2] += nbytes


def _figures(source: str, nats: float, tokens: float, nbytes: float) -> dict[str, Any]:
    """One source's loss, perplexity and bits per byte, with the tokens and bytes they are over."""
    loss = nats / max(tokens, 1)
    return {
        "source": source,
        "loss": loss,
        "perplexity": math.exp(min(loss, 50.0)),
        "bits_per_byte": nats / math.log(2) / max(nbytes, 1),
        "tokens": int(tokens),
        "bytes": int(nbytes),
    }


def position_buckets(seq_len: int, buckets: int = 8) -> list[int]:
    """Edges of `buckets` equal spans of a sample's positions (fewer for a short sample): the loss by position is
    what tells a context extension worked (the late positions' loss falls as the model learns to use them)."""
    count = max(1, min(buckets, seq_len))
    return [round(seq_len * k / count) for k in range(count + 1)]


@torch.no_grad()
def generate(
    model: Any,
    tokenizer: Tokenizer,
    prompts: list[str],
    *,
    seed: int,
    max_new_tokens: int,
    device: torch.device,
    synced: bool = False,
) -> list[dict[str, str]]:
    """Greedy and sampled continuations of every prompt. The prompts go in one batch (left-padded, masked), one
    greedy and one sampled call: under ZeRO-3 each forward gathers the whole model, so this is 2 x max_new_tokens
    gathers, not 2 x prompts x max_new_tokens. `synced`: under ZeRO-3 across ranks, every rank generates the same
    prompts with the same seed, and transformers keeps the ranks' forwards in step until all are done. No
    continuation at all with `max_new_tokens` 0 (--max-new-tokens 0: the metrics only)."""
    if max_new_tokens == 0 or not prompts:
        return []
    encoded = [tokenizer.encode(p) or [tokenizer.eos_id] for p in prompts]
    width = max(len(e) for e in encoded)
    pad = tokenizer.pad_id if tokenizer.pad_id >= 0 else tokenizer.eos_id
    ids = torch.tensor([[pad] * (width - len(e)) + e for e in encoded], device=device)
    mask = torch.tensor([[0] * (width - len(e)) + [1] * len(e) for e in encoded], device=device)
    common = {"attention_mask": mask, "max_new_tokens": max_new_tokens, "pad_token_id": pad, "synced_gpus": synced}
    greedy = model.generate(ids, do_sample=False, **common)
    torch.manual_seed(seed)
    sampled = model.generate(ids, do_sample=True, temperature=0.8, top_k=50, **common)

    def text(row: torch.Tensor) -> str:
        new = row[width:].tolist()
        if tokenizer.eos_id in new:  # a finished row is padded after its end of sequence
            new = new[: new.index(tokenizer.eos_id) + 1]
        return tokenizer.decode(new)

    return [{"prompt": p, "greedy": text(greedy[i]), "sampled": text(sampled[i])} for i, p in enumerate(prompts)]


def plot_losses(run_dir: Path) -> Path | None:
    """RUN_DIR/loss.png: train and validation loss against step, from metrics.jsonl."""
    metrics = run_dir / "metrics.jsonl"
    if not metrics.exists():
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    train = [(r["step"], r["loss"]) for r in rows if "loss" in r]
    val = [(r["step"], r["val_loss"]) for r in rows if "val_loss" in r]
    fig, ax = plt.subplots(figsize=(7, 4))
    if train:
        ax.plot(*zip(*train, strict=True), label="train")
    if val:
        ax.plot(*zip(*val, strict=True), "o-", label="validation")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title(run_dir.name)
    ax.grid(alpha=0.3)
    ax.legend()
    target = run_dir / "loss.png"
    tmp = tmp_path_for(target)
    fig.savefig(tmp, format="png", dpi=100, bbox_inches="tight")
    plt.close(fig)
    tmp.replace(target)
    return target


def run(cfg: EvalConfig) -> dict[str, Any]:
    t0 = time.perf_counter()
    device = device_for(cfg.device)
    inputs = open_inputs(cfg)
    free, total = torch.cuda.mem_get_info(device) if device.type == "cuda" else (0, 0)
    dataset = inputs.dataset
    batch = batch_for_card(
        inputs.run.shape, dataset.seq_len, cfg.batch_size, device, free, total, dataset.document_masks
    )
    model = load_model(inputs.run, device, dataset.manifest["tokenizer"])
    rows: list[tuple[int, float, int]] = []
    kw: dict[str, Any] = {"batch_size": batch, "max_batches": cfg.max_batches, "device": device}
    metrics = perplexity(model, dataset, inputs.tokenizer, rows=rows, **kw)
    samples = generate(
        model, inputs.tokenizer, inputs.prompts, seed=cfg.seed, max_new_tokens=cfg.max_new_tokens, device=device
    )
    prompts = []
    if cfg.needle:
        from pipeline.evaluate.needle import needle_prompts, parse_lengths, score

        lengths = parse_lengths(cfg.needle, inputs.run.shape.max_seq_len)
        prompts = needle_prompts(dataset, inputs.tokenizer, lengths, seed=cfg.seed)
        metrics["needle"] = score(model, prompts, device)
    if cfg.baseline:
        del model
        base_rows: list[tuple[int, float, int]] = []
        base = load_base_model(inputs.run, device, dataset.manifest["tokenizer"])
        against = perplexity(base, dataset, inputs.tokenizer, rows=base_rows, desc="evaluate the base", **kw)
        names = [b["source"] for b in metrics["by_source"]]
        metrics["baseline"] = {
            "model": str(base_model_path(inputs.run)),
            **{k: against[k] for k in ("loss", "perplexity", "bits_per_byte", "by_source", "loss_by_position")},
        }
        metrics["change"] = paired_change(rows, base_rows, names)
        if prompts:
            metrics["baseline"]["needle"] = score(base, prompts, device)
    return write_result(cfg, inputs, metrics, samples, t0)


def paired_change(
    rows: list[tuple[int, float, int]], base_rows: list[tuple[int, float, int]], names: list[str]
) -> list[dict[str, Any]]:
    """The change in loss (nats/token) from the base model to this one over the same samples, in total and by
    source, each with its standard error: the samples are paired (both models on each), so the noise is that of
    the per-sample differences, as a ratio estimate (sum of nats over sum of tokens). A change within about two
    standard errors of 0 is not told from noise."""
    assert [(s, t) for s, _, t in rows] == [(s, t) for s, _, t in base_rows], "the two models saw other samples"
    groups = [("total", None)] + [(name, k) for k, name in enumerate(names)]
    out = []
    for name, src in groups:
        pairs = [(n - b, t) for (s, n, t), (_, b, _) in zip(rows, base_rows, strict=True) if src is None or s == src]
        tokens = sum(t for _, t in pairs)
        change = sum(d for d, _ in pairs) / max(tokens, 1)
        count = len(pairs)
        spread = sum((d - change * t) ** 2 for d, t in pairs)
        stderr = math.sqrt(count / max(count - 1, 1) * spread) / max(tokens, 1) if count > 1 else float("nan")
        out.append({"source": name, "loss_change": change, "stderr": stderr, "samples": count, "tokens": tokens})
    return out


def write_result(
    cfg: EvalConfig, inputs: Inputs, metrics: dict[str, Any], samples: list[dict[str, str]], t0: float, **extra: Any
) -> dict[str, Any]:
    """The results file (RUN_DIR/eval/TAG-SPLIT.json unless --output) and the loss plot."""
    r, dataset = inputs.run, inputs.dataset
    plot = plot_losses(r.run_dir)
    result = {
        "checkpoint": str(r.run_dir / r.tag),
        **({"averaged": list(r.averaged)} if r.averaged else {}),
        "step": r.marker["step"],
        "consumed_tokens": r.marker["consumed_samples"] * dataset.seq_len,
        "split": cfg.split,
        "data": str(dataset.path),
        **metrics,
        "samples_generated": samples,
        **extra,
        "loss_plot": str(plot) if plot else None,
        "wall_time_s": round(time.perf_counter() - t0, 2),
    }
    out = result_path(cfg, r)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_json(out, result)
    result["output"] = str(out)
    return result


def result_path(cfg: EvalConfig, r: RunFolder) -> Path:
    return Path(cfg.output) if cfg.output else r.run_dir / "eval" / f"{r.name}-{cfg.split}.json"


def _tokens(n: int) -> str:
    return f"{n // 1024}K" if n >= 1024 and n % 1024 == 0 else str(n)


def table(result: dict[str, Any]) -> str:
    averaged = result.get("averaged") or []
    rows = [
        ("checkpoint", result["checkpoint"]),
        *([("weights", f"the mean of {len(averaged)} checkpoints: {', '.join(averaged)}")] if averaged else []),
        ("step", f"{result['step']:,}" + (" (the newest averaged)" if averaged else "")),
        ("consumed tokens", f"{result['consumed_tokens']:,}"),
        ("split", result["split"]),
        ("tokens evaluated", f"{result['tokens']:,}"),
        ("loss (nats/token)", f"{result['loss']:.4f}"),
        ("perplexity", f"{result['perplexity']:.2f}"),
        ("bits per byte", f"{result['bits_per_byte']:.4f}"),
    ]
    if buckets := result.get("loss_by_position"):
        rows.append(
            (
                "loss by position",
                "  ".join(f"{_tokens(b['from'])}-{_tokens(b['to'])}: {b['loss']:.3f}" for b in buckets),
            )
        )
    sources = result.get("by_source") or []
    if len(sources) > 1:
        rows.append(
            (
                "by source",
                "  ".join(
                    f"{b['source']}: {b['loss']:.4f} ({b['bits_per_byte']:.3f} bpb, {b['tokens']:,} tok)"
                    for b in sources
                ),
            )
        )
    base = result.get("baseline")
    if base:
        rows.append(
            ("base model", f"{base['model']}: loss {base['loss']:.4f}, bits per byte {base['bits_per_byte']:.4f}")
        )
        rows.append(
            (
                "change from base",
                "  ".join(
                    f"{c['source']}: {c['loss_change']:+.4f} ± {c['stderr']:.4f}" for c in result.get("change", [])
                )
                + "  (nats/token, ± one standard error over the samples)",
            )
        )
    for who, found in (("needle", result.get("needle")), ("base's needle", (base or {}).get("needle"))):
        if found:
            rows.append(
                (
                    who,
                    "  ".join(
                        f"{_tokens(b['length'])}: found {b['found']:.0%}, answer loss {b['answer_loss']:.3f}"
                        for b in found["by_length"]
                    ),
                )
            )
    width = max(len(k) for k, _ in rows)
    lines = [f"{k:<{width}}  {v}" for k, v in rows]
    for s in result["samples_generated"]:
        lines.append(f"\n--- prompt {s['prompt']!r}\n[greedy]  {s['greedy']!r}\n[sampled] {s['sampled']!r}")
    if result.get("loss_plot"):
        lines.append(f"\nloss plot: {result['loss_plot']}")
    lines.append(f"results: {result['output']}")
    return "\n".join(lines)
