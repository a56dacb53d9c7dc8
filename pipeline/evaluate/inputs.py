"""What an evaluation reads and checks before it computes anything, the same in one process and on each rank of a
distributed one: its arguments, the run and checkpoint (`open_run`), the held-out shards (of the run's tokenizer
and seq_len, a split with samples), the prompts, the device and whether the model fits it; and the model loaded
from the checkpoint (`load_model`)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch
import yaml

from pipeline.data.loader import ShardedDataset
from pipeline.data.manifest import TokenizerInfo, model_token_ids, read_shard_manifest
from pipeline.data.tokenizer import Tokenizer, check_tokenizer
from pipeline.errors import PipelineError
from pipeline.evaluate.config import EvalConfig
from pipeline.model import ModelShape, build_model
from pipeline.train.checkpoint import files as ckpt
from pipeline.train.checkpoint.consolidate import averaged_state, consolidated_state, materialize
from pipeline.train.runtime.dist import unusable_gpu
from pipeline.train.runtime.weights import parameter_shapes, weight_mismatch

log = logging.getLogger(__name__)

PROMPTS_FROM_DATA = 4
"""Prompts taken from the evaluated split when --prompts is not given."""


@dataclass
class RunFolder:
    run_dir: Path
    tag: str
    """The checkpoint; of an average, the newest averaged."""
    config: dict[str, Any]
    marker: ckpt.Marker
    shape: ModelShape
    averaged: tuple[str, ...] = ()
    """The checkpoints whose mean is the model (`--average`); empty for one checkpoint."""

    @property
    def name(self) -> str:
        """How results and messages name the model: TAG, or TAG-avgN for a mean of N checkpoints up to TAG."""
        return f"{self.tag}-avg{len(self.averaged)}" if self.averaged else self.tag

    def path(self, value: str) -> Path:
        """A file or folder the run's config names (data.path, ...): absolute in runs since 2026-12-06; a relative one
        of an older run is read from where it was launched (its config's relative run_dir says where that was), not
        from wherever this command runs."""
        p = Path(value)
        if p.is_absolute() or p.exists():
            return p
        given = Path(str(self.config.get("run_dir", "")))
        actual = self.run_dir.resolve().parts
        if given.parts and not given.is_absolute() and actual[-len(given.parts) :] == given.parts:
            launched = Path(*actual[: -len(given.parts)])
            if (launched / p).exists():
                return launched / p
        return p

    def weights(self) -> dict[str, Any]:
        """The full-precision weights by name, each read when `materialize`d: the checkpoint's, or the mean of the
        averaged ones."""
        tied = self.shape.tied_names()
        if self.averaged:
            return averaged_state(self.run_dir, list(self.averaged), tied)
        return consolidated_state(self.run_dir, self.tag, tied)


def open_run(checkpoint: str | Path, average: str | None = None) -> RunFolder:
    """The run and checkpoint (RUN_DIR for its latest, or RUN_DIR/TAG); with `average`, the run's checkpoints
    it names (ckpt.average_tags), whose mean is the model."""
    run_dir, tag = ckpt.resolve_checkpoint(checkpoint)
    averaged: tuple[str, ...] = ()
    if average:
        averaged = tuple(ckpt.average_tags(run_dir, average))
        tag = averaged[-1]
    cfg_path = run_dir / "config.yaml"
    if not cfg_path.exists():
        raise PipelineError(f"{run_dir}: no config.yaml; not a run folder of `pipeline pretrain`")
    marker = ckpt.read_marker(run_dir, tag)
    config = yaml.safe_load(ckpt.run_config_text(run_dir))
    return RunFolder(run_dir, tag, config, marker, ModelShape(**marker["model_shape"]), averaged)


def load_model(run: RunFolder, device: torch.device, tok: TokenizerInfo) -> torch.nn.Module:
    """The checkpoint's weights in the model's own class (the family's for a continued Hugging Face model), filled
    tensor by tensor: bf16 on a GPU (half the memory of fp32; the loss is still summed in fp32), fp32 on the CPU."""
    model = build_model(run.shape, skip_init=True, **model_token_ids(tok))
    if device.type == "cuda":
        model.to(torch.bfloat16)  # before filling: host RAM holds one bf16 copy, not an fp32 one
    state = run.weights()
    given = {name: tuple(value.shape) for name, value in state.items()}
    if problem := weight_mismatch(parameter_shapes(model), given, f"{run.run_dir}/{run.name}"):
        raise PipelineError(problem)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, value in state.items():
            params[name].copy_(materialize(value))
    return model.to(device).eval()  # type: ignore[arg-type]


def base_model_path(run: RunFolder) -> Path:
    """The model the run started from (`model.init_from`), for `--baseline`; one line where there is none."""
    init_from = (run.config.get("model") or {}).get("init_from")
    if not init_from:
        raise PipelineError(
            f"--baseline: {run.run_dir} has no model.init_from in its config: it trained from scratch, so there is no "
            "base model to compare with (compare checkpoints instead: evaluate each)"
        )
    path = run.path(str(init_from))
    if not path.exists():
        raise PipelineError(f"--baseline: the run's model.init_from {init_from} is not here; put it back to compare")
    return path


def load_base_model(run: RunFolder, device: torch.device, tok: TokenizerInfo) -> torch.nn.Module:
    """The run's base model (`model.init_from`) in the run's model class and shape, as the trainer loaded it at
    step 0 (a base whose names or shapes differ, another vocabulary among them, is refused in one line)."""
    from pipeline.train.runtime.weights import load_initial_weights

    path = base_model_path(run)
    model = build_model(run.shape, skip_init=True, **model_token_ids(tok))
    load_initial_weights(model, str(path), 0, False)
    if device.type == "cuda":
        model.to(torch.bfloat16)
    return model.to(device).eval()  # type: ignore[arg-type]


def device_for(name: str) -> torch.device:
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


def _dataset(run: RunFolder, data: str | None, split: str) -> ShardedDataset:
    path = Path(data) if data else run.path(run.config["data"]["path"])
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
    run: RunFolder
    dataset: ShardedDataset
    tokenizer: Tokenizer


def open_inputs(cfg: EvalConfig) -> Inputs:
    prompts = _check_arguments(cfg)
    r = open_run(cfg.checkpoint, cfg.average)
    if cfg.baseline:
        base_model_path(r)  # before any weight is read
    if cfg.needle:
        from pipeline.evaluate.needle import parse_lengths

        parse_lengths(cfg.needle, r.shape.max_seq_len)
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


def batch_for_card(
    shape: ModelShape,
    seq_len: int,
    requested: int,
    device: torch.device,
    free_bytes: int,
    total_bytes: int,
    dense_mask: bool = False,
) -> int:
    """The batch one process evaluates with on `device`: on a GPU the largest of --batch-size halved whose forward
    fits the free memory beside the whole model in bf16 (pipeline.plan.memory.inference_bytes, the dense mask of
    whole-document samples counted); refused in one line where even one sequence does not fit, naming the ZeRO-3
    path across GPUs. On the CPU (host RAM) the batch asked for."""
    if device.type != "cuda":
        return requested
    from pipeline.model import loss_chunk_tokens
    from pipeline.plan.memory import evaluation_batch

    batch, need = evaluation_batch(
        shape, seq_len, requested, 1, free_bytes, loss_chunk_tokens(shape.vocab_size), dense_mask
    )
    if batch == 0:
        mask = ", with the dense mask of whole-document samples" if dense_mask else ""
        raise PipelineError(
            f"the checkpoint's model needs {need / 2**30:.1f} GiB in bf16 to evaluate one {seq_len}-token sequence"
            f"{mask}, {device} has {free_bytes / 2**30:.1f} of {total_bytes / 2**30:.1f} GiB free; evaluate across "
            "GPUs with ZeRO-3: pipeline evaluate ... --num-gpus N (this node) or --hostfile HOSTFILE (the training "
            "cluster)"
        )
    if batch != requested:
        log.warning(
            "--batch-size %d does not fit %.1f GiB free on %s at seq %d; evaluating with batch %d",
            requested,
            free_bytes / 2**30,
            device,
            seq_len,
            batch,
        )
    return batch
