"""Hugging Face model families for continued pretraining: a model folder's config.json read into a `ModelShape`
(the planner's geometry, with the config itself kept for building). The model is built by transformers' own class
for the config's `model_type` (pipeline.model), so the next family is an entry in `FAMILIES` once a test shows it
trains, exports and reloads. The check that the data's tokenizer is the model's is
`pipeline.data.tokenizer.check_tokenizer`."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from pipeline.errors import ConfigError, PipelineError
from pipeline.model import ModelShape, resolve_shape, with_seq_len


@dataclass(frozen=True, slots=True)
class Family:
    names: str
    """What users call the models of this `model_type`."""
    qkv_bias: bool = False
    """q, k, v projections always carry biases (Qwen2); otherwise `attention_bias` in config.json says."""
    qk_norm: bool = False


FAMILIES: dict[str, Family] = {
    "llama": Family("Llama 1, 2, 3, 3.1 (rope_scaling llama3)"),
    "mistral": Family("Mistral"),
    "qwen2": Family("Qwen2, Qwen2.5", qkv_bias=True),
    "qwen3": Family("Qwen3", qk_norm=True),
}

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "chat_template.jinja",
)
"""The files of a Hugging Face tokenizer (copied into exports as they are)."""


def supported() -> str:
    return "; ".join(f"{k} ({f.names})" for k, f in FAMILIES.items())


def config_path(path: str | Path) -> Path | None:
    """The config.json of a Hugging Face model folder (or the file itself), None when `path` is not one."""
    p = Path(path)
    if p.is_dir() and (p / "config.json").is_file():
        return p / "config.json"
    if p.is_file() and p.name.endswith(".json"):
        return p
    return None


TOKENIZER_CORE = ("tokenizer.json", "tokenizer.model", "vocab.json")
"""One of these makes a folder's tokenizer, in any of its forms (fast, sentencepiece, byte-level BPE's vocab)."""


def model_folder_problems(folder: str | Path, field: str, *, weights: bool, tokenizer: bool) -> list[str]:
    """What a Hugging Face model folder lacks for a command that reads its `weights` and/or its `tokenizer`,
    checked against the folder's own safetensors index before anything is read or written: no weights at all,
    an index naming files that are not there, no tokenizer files. Each line names `field` (the option or config
    field that gave the folder) and what to do."""
    path = Path(folder)
    if not path.is_dir():
        return []  # a file (init_from's single safetensors) or a missing path: the caller's own check says it
    found = []
    if weights:
        index = path / "model.safetensors.index.json"
        if index.is_file():
            try:
                named = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            except (ValueError, KeyError, TypeError, AttributeError):
                named = []
                found.append(f"{field} {path}: {index.name} is not a safetensors index (no weight_map)")
            missing = [n for n in named if not (path / n).is_file()]
            if missing:
                found.append(
                    f"{field} {path}: its {index.name} names {len(missing)} file(s) not in the folder ("
                    f"{', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''}): the download is incomplete; "
                    "fetch the folder again"
                )
        elif not any(path.glob("*.safetensors")):
            found.append(f"{field} {path}: no .safetensors weights in the folder; give a downloaded Hugging Face model")
    if tokenizer and not any((path / f).is_file() for f in TOKENIZER_CORE):
        found.append(
            f"{field} {path}: no tokenizer files ({', '.join(TOKENIZER_CORE)}); copy the model's tokenizer into the "
            "folder, or download the model whole"
        )
    return found


def read_config(path: str | Path) -> dict[str, Any]:
    file = config_path(path)
    if file is None:
        raise PipelineError(f"{path}: not a Hugging Face model folder (no config.json) nor a config.json file")
    try:
        cfg = json.loads(file.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise PipelineError(f"{file}: cannot read it as JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise PipelineError(f"{file}: expected a JSON object")
    # Where its weights and tokenizer are (a folder), or the bare config.json planned from.
    cfg["_name_or_path"] = str((file.parent if file.name == "config.json" else file).resolve())
    return cfg


def shape_from_config(cfg: dict[str, Any], source: str | Path) -> ModelShape:
    """The geometry of a Hugging Face config (the planner's view), with the config kept for building the model."""
    model_type = cfg.get("model_type")
    if model_type not in FAMILIES:
        raise ConfigError([f"{source}: model_type {model_type!r} is not supported; supported: {supported()}"])
    family = FAMILIES[model_type]
    missing = [
        k
        for k in ("hidden_size", "num_hidden_layers", "intermediate_size", "num_attention_heads", "vocab_size")
        if not isinstance(cfg.get(k), int)
    ]
    if missing:
        raise ConfigError([f"{source}: field {k} missing or not an integer" for k in missing])
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim")
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    shape = ModelShape(
        hidden_size=cfg["hidden_size"],
        num_layers=cfg["num_hidden_layers"],
        ffn_hidden_size=cfg["intermediate_size"],
        num_heads=heads,
        num_kv_heads=cfg.get("num_key_value_heads") or heads,
        vocab_size=cfg["vocab_size"],
        max_seq_len=int(cfg.get("max_position_embeddings") or 4096),
        rope_theta=float(cfg.get("rope_theta") or rope.get("rope_theta") or 10000.0),
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        head_size=head_dim if head_dim and head_dim * heads != cfg["hidden_size"] else None,
        qkv_bias=family.qkv_bias or bool(cfg.get("attention_bias", False)),
        qk_norm=family.qk_norm,
        hf_config=cfg,
    )
    if problems := shape.check():
        raise ConfigError([f"{source}: {p}" for p in problems])
    return shape


def model_shape(
    preset: str | None,
    overrides: dict[str, Any],
    init_from: str | None,
    tokenizer_vocab: int | None,
    seq_len: int | None = None,
    rope: dict[str, Any] | None = None,
    max_position_embeddings: int | None = None,
    architecture: str | None = None,
) -> ModelShape:
    """The model a config asks for. `init_from` a Hugging Face folder without a preset: that model's architecture.
    `architecture` (a Hugging Face folder or config.json, fresh weights): its architecture, `overrides` changing
    some of its fields. Otherwise a preset (default tiny; `overrides` change some of its fields) or, without a
    preset, every shape field explicitly; with the tokenizer's vocabulary, and `max_seq_len` raised to `seq_len`
    (the shards') when that is longer; then RoPE's parameters `rope` and the context `max_position_embeddings`
    (`extend_context`)."""

    if architecture is not None:
        shape = _architecture_shape(architecture, overrides, preset, init_from)
    else:
        shape = _configured_shape(preset, overrides, init_from, tokenizer_vocab)
    shape = with_seq_len(shape, seq_len) if seq_len else shape
    if max_position_embeddings is not None and seq_len and max_position_embeddings < seq_len:
        raise ConfigError(
            [
                f"model.max_position_embeddings {max_position_embeddings} is below the shards' seq_len {seq_len}: "
                f"the model would be trained past the context it declares; use {seq_len} or more"
            ]
        )
    return extend_context(shape, rope or {}, max_position_embeddings)


ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "longrope", "llama3")
"""RoPE variants transformers 5 builds (its ROPE_INIT_FUNCTIONS), which `model.rope` may name."""


def extend_context(shape: ModelShape, rope: dict[str, Any], max_position_embeddings: int | None) -> ModelShape:
    """`shape` with RoPE's parameters `rope` over its own (a new rope_theta, a yarn or llama3 scaling) and the
    context it is meant for: a Hugging Face model's config.json gets them as transformers 5 writes them
    (rope_parameters), a preset keeps them for its LlamaConfig. Refuses what transformers would not build."""
    problems = []
    if (kind := rope.get("rope_type", "default")) not in ROPE_TYPES:
        problems.append(f"model.rope.rope_type {kind}: expected one of {', '.join(ROPE_TYPES)}")
    theta = rope.get("rope_theta", shape.rope_theta)
    if not isinstance(theta, (int, float)) or isinstance(theta, bool) or theta <= 0:
        problems.append(f"model.rope.rope_theta {theta}: expected a positive number, e.g. 1000000")
    if max_position_embeddings is not None and max_position_embeddings < 1:
        problems.append(f"model.max_position_embeddings {max_position_embeddings}: expected a positive length")
    if problems:
        raise ConfigError(problems)
    if not rope and max_position_embeddings is None:
        return shape
    context = max_position_embeddings or shape.max_seq_len
    if shape.hf_config is None:
        extra = {k: v for k, v in rope.items() if k != "rope_theta"}
        return replace(
            shape, rope_theta=float(theta), rope={**(shape.rope or {}), **extra} or None, max_seq_len=context
        )
    cfg = dict(shape.hf_config)
    own = cfg.pop("rope_parameters", None) or {**(cfg.pop("rope_scaling", None) or {}), "rope_theta": shape.rope_theta}
    cfg.pop("rope_scaling", None)
    cfg.pop("rope_theta", None)
    cfg["rope_parameters"] = {**own, **rope}
    cfg["max_position_embeddings"] = context
    return replace(shape, rope_theta=float(theta), max_seq_len=context, hf_config=cfg)


HF_KEYS = {
    "hidden_size": "hidden_size",
    "num_layers": "num_hidden_layers",
    "ffn_hidden_size": "intermediate_size",
    "num_heads": "num_attention_heads",
    "num_kv_heads": "num_key_value_heads",
    "vocab_size": "vocab_size",
    "max_seq_len": "max_position_embeddings",
    "head_size": "head_dim",
    "tie_embeddings": "tie_word_embeddings",
    "norm_eps": "rms_norm_eps",
}
"""`model.shape`'s fields -> the config.json keys they change in a `model.architecture`."""


def _architecture_shape(
    architecture: str, overrides: dict[str, Any], preset: str | None, init_from: str | None
) -> ModelShape:
    """`model.architecture`: a Hugging Face config's model with fresh weights, `overrides` (model.shape) written
    into the config under transformers' names, e.g. {num_layers: 4} for a slice of the model's depth."""
    file = config_path(architecture)
    problems = []
    if init_from:
        problems.append(
            f"model.architecture {architecture} and model.init_from {init_from}: give one (init_from brings its "
            "architecture with its weights; architecture builds one with fresh weights)"
        )
    if preset is not None:
        problems.append(f"model.architecture {architecture} and model.preset {preset}: give one")
    if unknown := sorted(set(overrides) - set(HF_KEYS)):
        problems += [
            f"model.shape.{k}: not a field that model.architecture takes (it takes {', '.join(HF_KEYS)}); "
            + ("give it as model.rope" if k in ("rope_theta", "rope") else "edit the config.json instead")
            for k in unknown
        ]
    if file is None:
        problems.append(
            f"model.architecture {architecture}: no config.json there; give a Hugging Face model "
            "folder or its config.json"
        )
    if problems:
        raise ConfigError(problems)
    cfg = read_config(architecture)
    for field, value in overrides.items():
        cfg[HF_KEYS[field]] = value
    layers = overrides.get("num_layers")
    if isinstance(layers, int) and isinstance(cfg.get("layer_types"), list):
        # per-layer attention kinds (Qwen's sliding windows): the first `layers`, or derived again when deeper
        cfg["layer_types"] = cfg["layer_types"][:layers] if layers <= len(cfg["layer_types"]) else None
    source = file or architecture
    return shape_from_config(cfg, f"{source} with model.shape {overrides}" if overrides else source)


def _configured_shape(
    preset: str | None, overrides: dict[str, Any], init_from: str | None, tokenizer_vocab: int | None
) -> ModelShape:

    if preset is None and not overrides and init_from and config_path(init_from) is None:
        raise ConfigError(
            [
                f"model.init_from {init_from}: no config.json there; give a Hugging Face model folder "
                "(its architecture is read from config.json), or model.preset (or model.shape) to load a "
                "bare safetensors file into"
            ]
        )
    if preset is None and init_from and config_path(init_from) is not None:
        if overrides:
            raise ConfigError(
                [
                    f"model.shape {sorted(overrides)}: a pretrained model's shape comes from "
                    f"{config_path(init_from)}; remove model.shape (or give model.preset to load the "
                    "weights into one of ours)"
                ]
            )
        return shape_from_config(read_config(init_from), config_path(init_from) or init_from)
    explicit = {"hidden_size", "num_layers", "ffn_hidden_size", "num_heads", "num_kv_heads"} <= set(overrides)
    return resolve_shape(preset or (None if explicit else "tiny"), overrides, tokenizer_vocab)
