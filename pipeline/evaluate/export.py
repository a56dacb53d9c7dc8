"""Export to a Hugging Face model folder: safetensors shards written tensor by tensor, config.json,
generation_config.json, and the tokenizer: a transformers tokenizer built from the run's sentencepiece model, or the
files of the Hugging Face tokenizer the data was tokenized with. A continued Hugging Face model keeps its own
architecture and config fields."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from pipeline.atomic import file_in_the_way, replacing_dir
from pipeline.data.loader import ShardedDataset
from pipeline.data.manifest import model_token_ids
from pipeline.errors import PipelineError, writing_into
from pipeline.evaluate.config import ExportConfig
from pipeline.evaluate.inputs import open_run
from pipeline.model import ModelShape, causal_lm_class, model_config
from pipeline.model.families import TOKENIZER_FILES
from pipeline.train.checkpoint.consolidate import materialize

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def hf_tokenizer(sp_model: Path) -> Any:
    """A transformers fast tokenizer that encodes exactly like our sentencepiece model (normaliser, byte fallback,
    split digits), with <unk> <s> </s> <pad> as special tokens. No BOS is added: training never saw one."""
    from tokenizers import pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import SpmConverter, import_protobuf

    proto = import_protobuf().ModelProto()
    proto.ParseFromString(sp_model.read_bytes())
    vocab = {p.piece: i for i, p in enumerate(proto.pieces)}
    tk = SpmConverter.build_tokenizer_from_spm_proto(proto, vocab, None)
    if tk is None:
        raise PipelineError(f"{sp_model}: unsupported sentencepiece model type for conversion")
    if proto.trainer_spec.split_digits:
        pre = [tk.pre_tokenizer] if tk.pre_tokenizer is not None else []
        tk.pre_tokenizer = pre_tokenizers.Sequence([*pre, pre_tokenizers.Digits(individual_digits=True)])
    return PreTrainedTokenizerFast(
        tokenizer_object=tk,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
        model_max_length=10**9,
        clean_up_tokenization_spaces=False,
    )


def check_export_target(output: Path) -> None:
    """The export replaces `output` whole: refuse a file, and a folder that is not an earlier export (never delete
    what the user did not make with this command)."""
    if output.is_file():
        raise PipelineError(f"--output {output}: is a file; give a folder to write the model into")
    if output.is_dir() and any(output.iterdir()) and not (output / "config.json").exists():
        raise PipelineError(
            f"--output {output}: a folder that holds other files and no config.json; it would be "
            "replaced whole: give a new or empty folder"
        )
    if blocker := file_in_the_way(output.parent):
        raise PipelineError(f"--output {output}: {blocker} is a file, not a folder")


def write_hf_model(
    tensors: Iterator[tuple[str, torch.Tensor]],
    shape: ModelShape,
    tokenizer: Path | None,
    output: Path,
    *,
    dtype: str = "bf16",
    tok_ids: dict[str, Any] | None = None,
    max_shard_bytes: int = 2 * 10**9,
    gguf: tuple[str, ...] = (),
) -> Path:
    """Stream `tensors` into safetensors shards in a temporary folder beside `output`, with the GGUF files of
    `gguf` (OUTPUT/NAME-KIND.gguf) converted from it there, then rename it into place: an earlier output is
    replaced whole (weights and GGUF files together), never half."""
    if dtype not in DTYPES:
        raise PipelineError(f"--dtype {dtype}: expected one of {', '.join(DTYPES)}")
    output = Path(output)
    check_export_target(output)
    with writing_into(output), replacing_dir(output, "another `pipeline export`") as work:
        _write_weights(tensors, work, DTYPES[dtype], max_shard_bytes)
        _write_config(shape, tok_ids or model_token_ids(None), dtype, work)
        if tokenizer is not None and tokenizer.is_dir():  # a Hugging Face tokenizer: its own files, as they are
            for name in TOKENIZER_FILES:
                if (tokenizer / name).is_file():
                    shutil.copyfile(tokenizer / name, work / name)
        elif tokenizer is not None:
            hf_tokenizer(tokenizer).save_pretrained(work)
            shutil.copyfile(tokenizer, work / "tokenizer.model")
        if gguf:
            from pipeline.evaluate.to_gguf import write_gguf

            for kind in gguf:
                write_gguf(work, work / gguf_name(output, kind), kind)
    return output


def gguf_name(output: Path, kind: str) -> str:
    """The GGUF file of `kind` in an export folder: NAME-KIND.gguf."""
    return f"{Path(output).name}-{kind}.gguf"


def _write_weights(tensors: Iterator[tuple[str, torch.Tensor]], work: Path, dtype: torch.dtype, max_bytes: int) -> None:
    """The tensors as safetensors shards of at most `max_bytes` (one tensor at a time in RAM), named as
    transformers names them, with the index when there is more than one."""
    from safetensors.torch import save_file

    shard: dict[str, torch.Tensor] = {}
    size = 0
    files: list[str] = []
    weight_map: dict[str, str] = {}
    for name, t in tensors:
        t = t.to(dtype).contiguous()
        if shard and size + t.numel() * t.element_size() > max_bytes:
            files.append(_flush(shard, work, len(files), save_file, weight_map))
            shard, size = {}, 0
        shard[name] = t
        size += t.numel() * t.element_size()
    files.append(_flush(shard, work, len(files), save_file, weight_map))
    total = len(files)
    final_names = {}
    for i, f in enumerate(files):
        new = "model.safetensors" if total == 1 else f"model-{i + 1:05d}-of-{total:05d}.safetensors"
        os.replace(work / f, work / new)
        final_names[f] = new
    if total > 1:
        index = {
            "metadata": {"total_size": sum((work / n).stat().st_size for n in final_names.values())},
            "weight_map": {k: final_names[v] for k, v in weight_map.items()},
        }
        (work / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def _write_config(shape: ModelShape, ids: dict[str, Any], dtype: str, work: Path) -> None:
    """config.json and generation_config.json: Llama's for our presets; for a continued Hugging Face model its
    own config (same model_type and fields) and, when its folder is still there, its own generation config."""
    from transformers import GenerationConfig

    cfg = model_config(shape, bos_id=ids["bos_id"], eos_id=ids["eos_id"], pad_id=ids.get("pad_id"))
    cfg.dtype = DTYPES[dtype]
    cfg.architectures = [causal_lm_class(cfg).__name__]
    cfg.use_cache = True
    cfg.save_pretrained(work)
    with_legacy_keys(work / "config.json")
    source = Path(str((shape.hf_config or {}).get("_name_or_path", "")), "generation_config.json")
    if shape.hf_config and source.is_file():
        shutil.copyfile(source, work / "generation_config.json")
    elif shape.hf_config:
        GenerationConfig.from_model_config(cfg).save_pretrained(work)
    else:
        GenerationConfig(
            bos_token_id=ids["bos_id"], eos_token_id=ids["eos_id"], pad_token_id=ids.get("pad_id"), do_sample=False
        ).save_pretrained(work)


def with_legacy_keys(path: Path) -> None:
    """config.json also in the keys transformers 4 reads: `torch_dtype`, `rope_theta` and, for a scaled RoPE,
    `rope_scaling`. transformers 5 writes only `dtype` and `rope_parameters`; a reader on transformers 4 (vLLM and
    most serving stacks of 2025, llama.cpp's converter) takes a missing rope_theta as 10000 and no scaling,
    silently: a Llama 3 (500000) or a YaRN-extended model then generates garbage. transformers 5 reads
    rope_parameters first, so both agree (tests/unit/evaluate/test_export_layout.py)."""
    doc = json.loads(path.read_text())
    rope = doc.get("rope_parameters")
    if isinstance(rope, dict) and "rope_theta" in rope:
        doc.setdefault("rope_theta", rope["rope_theta"])
        if rope.get("rope_type", "default") != "default":
            doc.setdefault("rope_scaling", {k: v for k, v in rope.items() if k != "rope_theta"})
    if "dtype" in doc:
        doc.setdefault("torch_dtype", doc["dtype"])
    path.write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")


def _flush(shard: dict[str, torch.Tensor], work: Path, k: int, save_file: Any, weight_map: dict[str, str]) -> str:
    name = f"part-{k:05d}.safetensors"
    save_file(shard, str(work / name), metadata={"format": "pt"})
    for key in shard:
        weight_map[key] = name
    return name


def export_command(cfg: ExportConfig) -> list[str]:
    """`pipeline export`: the export, and what it printed (where each file went, how to load it)."""
    out = export(
        cfg.checkpoint,
        cfg.output,
        dtype=cfg.dtype,
        max_shard_bytes=cfg.max_shard_bytes,
        average=cfg.average,
        data=cfg.data,
        gguf=cfg.gguf,
    )
    what = f"the mean of {cfg.average} of {cfg.checkpoint}" if cfg.average else cfg.checkpoint
    lines = [
        f"exported {what} to {out} ({cfg.dtype}); load it with "
        f"AutoModelForCausalLM.from_pretrained('{out}') and AutoTokenizer.from_pretrained('{out}')"
    ]
    for path in (out / gguf_name(out, kind) for kind in cfg.gguf):
        lines.append(f"wrote {path} ({path.stat().st_size / 1e6:,.1f} MB): llama-cli -m {path}")
    return lines


def export(
    checkpoint: str,
    output: str,
    dtype: str = "bf16",
    max_shard_bytes: int = 2 * 10**9,
    average: str | None = None,
    data: str | None = None,
    gguf: tuple[str, ...] = (),
) -> Path:
    """RUN_DIR[/TAG] -> a Hugging Face folder that AutoModelForCausalLM / AutoTokenizer load offline; with
    `average` (last:N or tags), the mean of those checkpoints' weights, streamed one tensor at a time. `data`: the
    run's shards where they are now (default: its data.path), for the tokenizer and its special tokens. `gguf`:
    the GGUF files (f16, q8_0) written into the folder too, their package and tokenizer checked before any
    weight is read."""
    check_export_target(Path(output))
    if gguf:
        from pipeline.evaluate.to_gguf import check_gguf

        check_gguf()
    r = open_run(checkpoint, average)
    data_dir = Path(data) if data else r.path(r.config["data"]["path"])
    tok_path: Path | None = None
    tok_ids = model_token_ids(None)
    if (data_dir / "manifest.json").exists():
        dataset = ShardedDataset(data_dir, "train")
        tok_path = dataset.tokenizer_path
        tok_ids = model_token_ids(dataset.manifest["tokenizer"])
    else:
        raise PipelineError(
            f"{data_dir}: the run's shards are not there (moved?), and the tokenizer and its special tokens are read "
            "from their manifest: pass --data DIR with the shards where they are now"
        )
    if gguf:
        from pipeline.evaluate.to_gguf import tokenizer_problem

        if problem := tokenizer_problem(tok_path):
            raise PipelineError(problem)
    return write_hf_model(
        ((name, materialize(value)) for name, value in r.weights().items()),
        r.shape,
        tok_path,
        Path(output),
        dtype=dtype,
        tok_ids=tok_ids,
        max_shard_bytes=max_shard_bytes,
        gguf=gguf,
    )
