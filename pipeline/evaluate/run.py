"""Stage 4: evaluate a saved checkpoint (held-out loss, perplexity, bits per byte, samples, loss plot) and export
it to a Hugging Face model folder. Runs in one process, CPU or GPU, on a checkpoint of any ZeRO stage."""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch
import yaml

from pipeline.atomic import tmp_path_for, write_json
from pipeline.data.loader import ShardedDataset, collate_samples
from pipeline.data.manifest import TokenizerInfo, model_token_ids, read_shard_manifest
from pipeline.data.tokenizer import Tokenizer, check_tokenizer
from pipeline.errors import PipelineError
from pipeline.model import ModelShape, build_model
from pipeline.train.checkpoint import files as ckpt
from pipeline.train.checkpoint.consolidate import consolidated_state, consolidated_tensors, materialize
from pipeline.train.runtime.dist import unusable_gpu
from pipeline.train.runtime.weights import parameter_shapes, weight_mismatch

PROMPTS_FROM_DATA = 4
"""Prompts taken from the evaluated split when --prompts is not given."""


@dataclass(frozen=True, kw_only=True, slots=True)
class EvalConfig:
    checkpoint: str
    """RUN_DIR (latest complete tag) or RUN_DIR/TAG."""
    data: str | None = None
    """Shard folder; default: the run's own data.path."""
    split: str = "val"
    max_batches: int | None = None
    batch_size: int = 8
    prompts: str | None = None
    """A text file, one prompt per line."""
    output: str | None = None
    """JSON results; default RUN_DIR/eval/TAG-SPLIT.json."""
    max_new_tokens: int = 48
    seed: int = 1234
    device: str = "auto"


@dataclass
class Run:
    run_dir: Path
    tag: str
    config: dict[str, Any]
    marker: ckpt.Marker
    shape: ModelShape


def open_run(checkpoint: str | Path) -> Run:
    run_dir, tag = ckpt.resolve_checkpoint(checkpoint)
    cfg_path = run_dir / "config.yaml"
    if not cfg_path.exists():
        raise PipelineError(f"{run_dir}: no config.yaml; not a run folder of `pipeline pretrain`")
    marker = ckpt.read_marker(run_dir, tag)
    return Run(run_dir, tag, yaml.safe_load(cfg_path.read_text()), marker, ModelShape(**marker["model_shape"]))


def load_model(run: Run, device: torch.device, tok: TokenizerInfo) -> torch.nn.Module:
    """The checkpoint's weights in the model's own class (the family's for a continued Hugging Face model), filled
    tensor by tensor: bf16 on a GPU (half the memory of fp32; the loss is still summed in fp32), fp32 on the CPU."""
    model = build_model(run.shape, skip_init=True, **model_token_ids(tok))
    if device.type == "cuda":
        model.to(torch.bfloat16)  # before filling: host RAM holds one bf16 copy, not an fp32 one
    state = consolidated_state(run.run_dir, run.tag, run.shape.tied_names())
    given = {name: tuple(value.shape) for name, value in state.items()}
    if problem := weight_mismatch(parameter_shapes(model), given, f"{run.run_dir}/{run.tag}"):
        raise PipelineError(problem)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, value in state.items():
            params[name].copy_(materialize(value))
    return model.to(device).eval()  # type: ignore[arg-type]


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
) -> dict[str, float]:
    """Loss (nats/token), perplexity and bits per byte over the split's samples in order; bytes are those of
    the decoded label tokens, so the figure is comparable across tokenizers. The loss comes from the model's
    chunked per-token path, so no full (B, T, V) fp32 logits are built.

    Across ranks (ZeRO-3, `world_size` > 1) rank r takes batches r, r + W, ...; every rank runs the same number
    of forwards (a rank without a batch in the last round repeats batch 0 and discards it), since each forward
    gathers parameters collectively; the sums are all-reduced in fp64."""
    device = device or torch.device("cpu")
    n = len(dataset)
    batches = math.ceil(n / batch_size) if max_batches is None else min(max_batches, math.ceil(n / batch_size))
    sums = [0.0, 0.0, 0.0]  # nats, tokens, bytes
    for round_start in range(0, batches, world_size):
        b = round_start + rank
        mine = b < batches
        ids = list(range((b if mine else 0) * batch_size, min(n, ((b if mine else 0) + 1) * batch_size)))
        batch = collate_samples(dataset, ids)
        labels = batch["labels"]
        losses = model(input_ids=batch["input_ids"].to(device), loss_labels=labels.to(device))
        if not mine:
            continue
        sums[0] += float(losses.double().sum())
        sums[1] += int((labels != -100).sum())
        for row in labels.tolist():
            sums[2] += len(tokenizer.decode([t for t in row if t >= 0]).encode("utf-8"))
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
    }


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
    prompts with the same seed, and transformers keeps the ranks' forwards in step until all are done."""
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


def _device(name: str) -> torch.device:
    if name == "auto":
        if problem := unusable_gpu():  # evaluating on the CPU by accident: say why; --device cpu means it
            raise PipelineError(problem.replace("set DS_ACCELERATOR=cpu", "pass --device cpu"))
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise PipelineError(f"--device {name}: expected cpu, cuda, cuda:N or auto") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise PipelineError(f"--device {name}: torch sees no CUDA device here; use --device cpu")
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise PipelineError(f"--device {name}: there are {torch.cuda.device_count()} CUDA devices")
    return device


def _check_arguments(cfg: EvalConfig) -> list[str]:
    """The evaluation's own arguments, checked before a checkpoint is read. No --prompts: [] (the evaluated split's
    own text gives them, `prompts_from`)."""
    prompts: list[str] = []
    if cfg.prompts:
        p = Path(cfg.prompts)
        if not p.is_file():
            raise PipelineError(f"--prompts {p}: no such file (one prompt per line, \\n for a newline)")
        prompts = [line.replace("\\n", "\n") for line in p.read_text().splitlines() if line.strip()]
        if not prompts:
            raise PipelineError(f"--prompts {p}: the file holds no prompt")
    if cfg.output and Path(cfg.output).is_dir():
        raise PipelineError(f"--output {cfg.output}: is a folder; give a file name such as {cfg.output}/eval.json")
    return prompts


def _dataset(run: Run, data: str | None, split: str) -> ShardedDataset:
    path = Path(data or run.config["data"]["path"])
    if not (path / "manifest.json").exists():
        raise PipelineError(f"{path}: no shards there (the run's data folder moved?); pass --data DIR")
    theirs = read_shard_manifest(path)
    if data:
        ours_path = Path(run.config["data"]["path"])
        if (ours_path / "manifest.json").exists():
            ours = read_shard_manifest(ours_path)
            if ours["tokenizer"]["sha256"] != theirs["tokenizer"]["sha256"]:
                raise PipelineError(
                    f"--data {path}: tokenized with another tokenizer than the run's "
                    f"({theirs['tokenizer']['path']} vs {ours['tokenizer']['path']})"
                )
    if "tokenizer_sha256" in run.marker and theirs["tokenizer"]["sha256"] != run.marker["tokenizer_sha256"]:
        raise PipelineError(
            f"--data {path}: tokenized with another tokenizer than the run "
            f"({theirs['tokenizer']['path']}); evaluate on shards of the run's tokenizer"
        )
    if "seq_len" in run.marker and theirs["seq_len"] != run.marker["seq_len"]:
        raise PipelineError(
            f"--data {path}: seq_len {theirs['seq_len']} differs from the run's "
            f"{run.marker['seq_len']}; shard the held-out data with --seq-len {run.marker['seq_len']}"
        )
    if run.shape.hf_config is not None:
        check_tokenizer(run.shape, theirs["tokenizer"], f"--data {path}")
    elif theirs["tokenizer"]["vocab_size"] != run.shape.vocab_size:
        raise PipelineError(
            f"--data {path}: vocabulary {theirs['tokenizer']['vocab_size']} differs from the "
            f"model's {run.shape.vocab_size}; shards of another tokenizer"
        )
    samples = theirs["splits"].get(split, {}).get("samples", 0)
    if not samples:
        others = [
            f"{k} ({v['samples']:,} samples)" for k, v in theirs["splits"].items() if v.get("samples") and k != split
        ]
        ratios = ",".join(f"{x:g}" for x in theirs.get("split_ratios", []))
        raise PipelineError(
            f"{path}: the {split} split has no samples (the shards were made with --split {ratios}), so there is "
            f"nothing to evaluate and no score would mean anything; evaluate another split "
            f"({', '.join(others) or 'none has samples'}: --split NAME), or re-shard with a share for it"
        )
    return ShardedDataset(path, split)


class Inputs(NamedTuple):
    """What an evaluation reads before it loads weights, checked the same way in one process and on each rank."""

    prompts: list[str]
    run: Run
    dataset: ShardedDataset
    tokenizer: Tokenizer


def open_inputs(cfg: EvalConfig) -> Inputs:
    prompts = _check_arguments(cfg)
    r = open_run(cfg.checkpoint)
    dataset = _dataset(r, cfg.data, cfg.split)
    tok_path = dataset.tokenizer_path
    if tok_path is None:
        raise PipelineError(
            f"{dataset.path}: the tokenizer {dataset.manifest['tokenizer']['path']} is gone; re-run shard"
        )
    tokenizer = Tokenizer(tok_path)
    return Inputs(prompts or prompts_from(dataset, tokenizer), r, dataset, tokenizer)


def prompts_from(
    dataset: ShardedDataset, tokenizer: Tokenizer, n: int = PROMPTS_FROM_DATA, tokens: int = 12
) -> list[str]:
    """Prompts when none are given: the first `tokens` tokens of `n` samples spread over the evaluated split, so a
    model trained on your text is prompted with your text (not the demo's Shakespeare)."""
    count = len(dataset)
    picks = sorted({i * count // n for i in range(n)}) if count else []
    out = []
    for i in picks:
        ids = [int(t) for t in dataset[i][:tokens] if int(t) != tokenizer.eos_id]
        if text := tokenizer.decode(ids).strip():
            out.append(text)
    return out or ["The"]


def check_fits_device(shape: ModelShape, device: torch.device, free_bytes: int, total_bytes: int) -> None:
    """One process holds the whole model in bf16 on a GPU (2 bytes per parameter) plus room for activations; a
    checkpoint larger than that is evaluated across ranks with ZeRO-3 instead."""
    need = shape.num_params() * 2 + 2 * 2**30
    if device.type == "cuda" and need > free_bytes:
        raise PipelineError(
            f"the checkpoint's model needs {need / 2**30:.1f} GiB in bf16 (with 2 GiB for activations), {device} has "
            f"{free_bytes / 2**30:.1f} of {total_bytes / 2**30:.1f} GiB free; evaluate across GPUs with ZeRO-3: "
            "pipeline evaluate ... --num-gpus N (this node) or --hostfile HOSTFILE (the training cluster)"
        )


def run(cfg: EvalConfig) -> dict[str, Any]:
    t0 = time.perf_counter()
    device = _device(cfg.device)
    inputs = open_inputs(cfg)
    if device.type == "cuda":
        check_fits_device(inputs.run.shape, device, *torch.cuda.mem_get_info(device))
    model = load_model(inputs.run, device, inputs.dataset.manifest["tokenizer"])
    metrics = perplexity(
        model, inputs.dataset, inputs.tokenizer, batch_size=cfg.batch_size, max_batches=cfg.max_batches, device=device
    )
    samples = generate(
        model, inputs.tokenizer, inputs.prompts, seed=cfg.seed, max_new_tokens=cfg.max_new_tokens, device=device
    )
    return write_result(cfg, inputs, metrics, samples, t0)


def write_result(
    cfg: EvalConfig, inputs: Inputs, metrics: dict[str, float], samples: list[dict[str, str]], t0: float, **extra: Any
) -> dict[str, Any]:
    """The results file (RUN_DIR/eval/TAG-SPLIT.json unless --output) and the loss plot."""
    r, dataset = inputs.run, inputs.dataset
    plot = plot_losses(r.run_dir)
    result = {
        "checkpoint": str(r.run_dir / r.tag),
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


def result_path(cfg: EvalConfig, r: Run) -> Path:
    return Path(cfg.output) if cfg.output else r.run_dir / "eval" / f"{r.tag}-{cfg.split}.json"


def table(result: dict[str, Any]) -> str:
    rows = [
        ("checkpoint", result["checkpoint"]),
        ("step", f"{result['step']:,}"),
        ("consumed tokens", f"{result['consumed_tokens']:,}"),
        ("split", result["split"]),
        ("tokens evaluated", f"{result['tokens']:,}"),
        ("loss (nats/token)", f"{result['loss']:.4f}"),
        ("perplexity", f"{result['perplexity']:.2f}"),
        ("bits per byte", f"{result['bits_per_byte']:.4f}"),
    ]
    width = max(len(k) for k, _ in rows)
    lines = [f"{k:<{width}}  {v}" for k, v in rows]
    for s in result["samples_generated"]:
        lines.append(f"\n--- prompt {s['prompt']!r}\n[greedy]  {s['greedy']!r}\n[sampled] {s['sampled']!r}")
    if result.get("loss_plot"):
        lines.append(f"\nloss plot: {result['loss_plot']}")
    lines.append(f"results: {result['output']}")
    return "\n".join(lines)


def export(checkpoint: str, output: str, dtype: str = "bf16", max_shard_bytes: int = 2 * 10**9) -> Path:
    """RUN_DIR[/TAG] -> a Hugging Face folder that AutoModelForCausalLM / AutoTokenizer load offline."""
    from pipeline.evaluate.export import check_export_target, write_hf_model

    check_export_target(Path(output))
    r = open_run(checkpoint)
    data = Path(r.config["data"]["path"])
    tok_path: Path | None = None
    tok_ids = model_token_ids(None)
    if (data / "manifest.json").exists():
        dataset = ShardedDataset(data, "train")
        tok_path = dataset.tokenizer_path
        tok_ids = model_token_ids(dataset.manifest["tokenizer"])
    return write_hf_model(
        consolidated_tensors(r.run_dir, r.tag, r.shape.tied_names()),
        r.shape,
        tok_path,
        Path(output),
        dtype=dtype,
        tok_ids=tok_ids,
        max_shard_bytes=max_shard_bytes,
    )
