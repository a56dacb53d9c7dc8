"""Pretrain config: YAML -> typed, frozen dataclasses; every problem is reported at once, before any process
group starts. `--set section.key=value` overrides any field.

One job: the config's schema and its reading. Each section is a dataclass that checks its own fields (their
`pipeline.fields` markers and its `problems()`); most of the length is the fields' docstrings, the documentation
of every key a user can write."""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
import json
import os
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml

from pipeline.errors import ConfigError
from pipeline.fields import Range, field_problems


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelSection:
    preset: str | None = None
    """tiny | 125m | 350m | 1b | 7b | 13b | 70b, or null: explicit fields in `shape`, else the architecture of the
    Hugging Face folder in `init_from`, else tiny."""
    shape: dict[str, Any] = field(default_factory=dict)
    """Overrides of the preset's shape, e.g. {num_layers: 2} (see pipeline.model.ModelShape)."""
    rope: dict[str, Any] = field(default_factory=dict)
    """Context extension: RoPE's parameters as transformers names them, over the model's own, e.g. {rope_theta:
    1000000} or {rope_type: yarn, factor: 4.0, original_max_position_embeddings: 32768} (also linear, dynamic,
    llama3, longrope). Carried into the export's config.json."""
    max_position_embeddings: int | None = None
    """The context the model is meant for, written into the export's config.json (null: the model's own, or the
    training seq_len when that is longer)."""
    init_from: str | None = None
    """Continued pretraining: a Hugging Face model folder (config.json + safetensors, one file or sharded) whose
    architecture and weights the run starts from (Llama 1-3.1, Mistral, Qwen2/2.5, Qwen3: pipeline.model.families), or a
    safetensors file to load into `preset`."""
    architecture: str | None = None
    """From scratch in a Hugging Face family's architecture: a model folder or its config.json, built with fresh
    weights (the same families as init_from; the data's tokenizer must be that model's, as with init_from);
    `shape` overrides its fields, e.g. {num_layers: 4}. `pipeline probe` slices a continued model this way."""


@dataclass(frozen=True, kw_only=True, slots=True)
class DataSection:
    path: str = "data/shards"
    """Output folder of `pipeline shard`; its seq_len is the training sequence length."""
    stages: dict[str, Any] = field(default_factory=dict)
    """Data stages, {STEP: SHARD_FOLDER}: after update STEP the run trains on that folder's shards (the same
    seq_len and tokenizer), e.g. {900: data/curated-4096} for a decay on a curated mix. Positions in a stage count
    from its first update; validation stays on data.path's val split (pipeline.train.setup.stages)."""
    num_workers: Annotated[int, Range(0)] = 1
    verify: bool = True
    """Check shard checksums against the manifest at start (reads the data once)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class BatchSection:
    micro_batch_size: Annotated[int, Range(1)] = 1
    """Sequences per rank per forward pass."""
    global_batch_size: Annotated[int | None, Range(1)] = None
    """Sequences per optimizer step over all ranks; gradient accumulation = global / (micro x world)."""
    global_batch_tokens: Annotated[int | None, Range(1)] = None
    """Alternative to global_batch_size: tokens per optimizer step (must be a multiple of seq_len)."""

    def problems(self) -> list[str]:
        if (self.global_batch_size is None) == (self.global_batch_tokens is None):
            return ["batch: give exactly one of global_batch_size (sequences) or global_batch_tokens"]
        return []


@dataclass(frozen=True, kw_only=True, slots=True)
class OptimSection:
    name: Literal["adamw", "adamw8bit", "muon"] = "adamw"
    """adamw (DeepSpeed's: FusedAdam on GPU, CPUAdam when offloading) | adamw8bit (bitsandbytes, ZeRO 0-2, no
    offload) | muon (DeepSpeed's Muon for the hidden matrices at muon_lr, AdamW at lr for the rest; ZeRO 1-3, no
    offload; pipeline.train.setup.optimizers.OPTIMIZERS)."""
    lr: Annotated[float, Range(0.0, 1.0, open_low=True, open_high=True)] = 3e-4
    min_lr: Annotated[float, Range(0.0)] = 3e-5
    schedule: Literal["cosine", "wsd", "constant"] = "cosine"
    """The learning-rate schedule (pipeline.train.setup.schedule.SCHEDULES): cosine | wsd (warmup-stable-decay:
    extendable while stable, cooldowns branched from any stable checkpoint) | constant (after warmup)."""
    warmup_steps: Annotated[int, Range(0)] = 100
    warmup_from: Literal["auto", "zero", "min_lr"] = "auto"
    """Where warmup starts: zero, or min_lr (a rewarm, for continued pretraining). auto: min_lr when the run starts
    from a model's weights (model.init_from), zero otherwise."""
    decay_steps: Annotated[int | None, Range(1)] = None
    """cosine: the decay's length after warmup (default: until max_steps). wsd: the decay's length at the end of
    the run (or decay_ratio)."""
    decay_ratio: Annotated[float | None, Range(0.0, 1.0, open_low=True)] = None
    """wsd: the decay's share of the run's steps, in (0, 1] (default 0.2 when decay_steps is not given either)."""
    decay_shape: Literal["linear", "sqrt", "cosine"] = "linear"
    """wsd: the decay's shape (1 - p, 1 - sqrt(p), or half a cosine, p going 0 to 1)."""
    weight_decay: float = 0.1
    """Not applied to norms and biases."""
    beta1: Annotated[float, Range(0.0, 1.0, open_high=True)] = 0.9
    beta2: Annotated[float, Range(0.0, 1.0, open_high=True)] = 0.95
    eps: float = 1e-8
    grad_clip: Annotated[float, Range(0.0)] = 1.0
    """The gradient norm clipped to (0: off)."""
    muon_lr: Annotated[float, Range(0.0, 1.0, open_low=True, open_high=True)] = 0.02
    """optim.name muon: the peak learning rate of the hidden matrices (Muon's own scale; the schedule shapes it as
    it shapes lr, which the embeddings, norms and output layer train at)."""
    muon_momentum: Annotated[float, Range(0.0, 1.0, open_high=True)] = 0.95

    def problems(self) -> list[str]:
        """The rules between the optimizer's and the schedule's own fields."""
        p = []
        if self.min_lr > self.lr:
            p.append(f"optim.min_lr {self.min_lr}: expected 0 <= min_lr <= lr ({self.lr})")
        if self.schedule != "wsd" and self.decay_ratio is not None:
            p.append(
                f"optim.decay_ratio is for optim.schedule wsd (this run's is {self.schedule}); remove it or use wsd"
            )
        if self.schedule != "wsd" and self.decay_shape != "linear":
            p.append(
                f"optim.decay_shape is for optim.schedule wsd (this run's is {self.schedule}); remove it or use wsd"
            )
        if self.schedule == "wsd" and self.decay_steps is not None and self.decay_ratio is not None:
            p.append("optim: give one of decay_steps or decay_ratio for the wsd decay, not both")
        if self.schedule == "constant" and self.decay_steps is not None:
            p.append("optim.decay_steps: a constant schedule has no decay; remove it, or use schedule wsd")
        return p


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainSection:
    max_steps: Annotated[int | None, Range(1)] = None
    max_tokens: Annotated[int | None, Range(1)] = None
    """Alternative to max_steps: stop after this many training tokens."""
    seed: int = 1234
    precision: Literal["bf16", "fp16", "fp32"] = "bf16"
    """bf16 | fp16 (dynamic loss scaling) | fp32."""
    activation_checkpointing: bool = False
    deepspeed_config: str = "ds_configs/zero1.json"
    """A DeepSpeed JSON with "auto" batch/precision fields, or `auto` to let the planner choose for this machine:
    the JSON, activation_checkpointing and tiled_mlp are then the planner's (what it priced is what runs)."""
    gpu_memory_cap_gib: float | None = None
    """Cap this process's GPU memory (emulate a smaller card, e.g. 24 on an 80 GB GPU); null = the whole card. On
    the CPU (tests), the card `deepspeed_config: auto` plans for."""
    compile: bool | None = None
    """Compile each decoder layer with torch.compile (per layer, so ZeRO-2 still overlaps gradient reduction with
    the backward). null (auto): on a CUDA GPU with ZeRO 0-2, where it was measured to pay (1.21x on an H200), off
    elsewhere; true/false as said (true needs ZeRO 0-2). Equal to eager on the CPU (tested)."""
    attention: Literal["auto", "torch", "flash", "cudnn", "efficient", "math"] = "auto"
    """The SDPA backend (pipeline.model.kernels.ATTENTION). auto: on a CUDA GPU each backend is timed at the
    model's shape once at start and the fastest that agrees with FlashAttention is used; torch's choice elsewhere."""
    document_attention: Literal["auto", "varlen", "dense"] = "auto"
    """How attention keeps the documents of a whole-document sample apart and honours a sliding window shorter than
    the sample (pipeline.model.varlen). varlen: from the tokens' positions alone, no mask (FlashAttention-2's varlen
    kernel, pip install -e '.[flash]' on a CUDA GPU; a per-document reference on the CPU), with sequence
    parallelism too; dense: SDPA with transformers' (seq x seq) mask (1 GiB a sample at 32K, not under sequence
    parallelism); auto: varlen where it is available, dense elsewhere. Where no mask matters: plain causal SDPA."""
    kernels: Literal["auto", "torch", "liger"] = "auto"
    """What replaces transformers' modules and the chunked loss (pipeline.model.kernels.KERNELS). torch: nothing;
    liger: Liger Kernel's RMSNorm, RoPE, SwiGLU and fused linear cross-entropy (CUDA GPUs, Llama/Mistral/Qwen2/
    Qwen3, pip install -e '.[gpu]'; ZeRO-3 keeps the chunked loss). auto: on a GPU, liger where the layers are not
    compiled (ZeRO-3, compile off), torch where they are (measured equal there); torch on the CPU. A GPU-only
    choice on the CPU says what it used instead."""
    fp8: bool = False
    """Float8 matmuls in the decoder layers' linear projections (torchao's Float8 training, tensorwise scaling):
    on a GPU with FP8 tensor cores (RTX 4090, L40S, H100/H200) about twice the bf16 matmul rate, the rest of the
    step unchanged, so runs bound by offload gain little (the planner prices it). Embeddings, norms and the output
    layer stay bf16 (pipeline.model.kernels.fp8_keeps). Emulated on the CPU. Needs train.precision bf16, ZeRO
    0-2 and torchao (pip install -e '.[gpu]'). Checkpoints and exports are bf16 weights: a run resumes with or
    without it."""
    loss_chunk_tokens: Annotated[int | None, Range(1)] = None
    """Tokens per chunk of the training loss (the full fp32 logits are never built); null: 256 MiB of logits."""
    tiled_mlp: Annotated[int, Range(0)] = 0
    """Compute each layer's MLP in this many tiles along the sequence, each recomputed in the backward (DeepSpeed's
    TiledMLP, from Arctic Long Sequence Training): the SwiGLU intermediates (8 x ffn bytes a token) of one tile
    are alive at a time instead of the whole sequence's, for one more MLP forward. 0: off; `pipeline plan` says
    where it is needed (one tile per hidden_size tokens). Exact: the same numbers up to rounding."""
    sequence_parallel: Annotated[int, Range(1)] = 1
    """Ranks that train one sample together (DeepSpeed's Ulysses sequence parallelism for Hugging Face models,
    pipeline.train.runtime.sequence): each holds seq_len / N tokens of every layer's activations, and an
    all-to-all before and after attention gives each rank all tokens of N-th of the heads. Data parallel is then
    world / N; the token order, the batch and resuming are those of a world of world / N ranks. 1: off."""
    peak_tflops: Annotated[float | None, Range(0.0, open_low=True)] = None
    """The card's dense bf16 peak for MFU, for a GPU the table does not know (null: from the table by name)."""
    comm_timeout_minutes: Annotated[float, Range(0.0, open_low=True)] = 30.0
    """How long a rank may go without progress before the run fails instead of hanging: a progress is a
    micro-step, a validation batch, a checkpoint write, or (while rank 0 converts a checkpoint for another world
    size) its heartbeat. A step may take hours; a peer that hangs ends the launch within this time."""
    on_nonfinite: Literal["stop", "skip"] = "stop"
    """A non-finite loss or gradient norm. stop: halt at that step, name its samples, save nothing (the last good
    checkpoint stays the latest). skip: DeepSpeed drops that update; counted and logged."""
    max_nonfinite_in_a_row: Annotated[int, Range(1)] = 3
    """With on_nonfinite: skip, stop after this many skipped updates in a row."""

    def problems(self) -> list[str]:
        p = []
        if (self.max_steps is None) == (self.max_tokens is None):
            p.append("train: give exactly one of max_steps or max_tokens")
        if self.fp8 and self.precision != "bf16":
            p.append(
                f"train.fp8 needs train.precision bf16 (its master weights and the rest of the step), not "
                f"{self.precision}"
            )
        if self.fp8 and importlib.util.find_spec("torchao") is None:
            p.append("train.fp8 needs torchao: pip install torchao (or pip install -e '.[gpu]')")
        return p


@dataclass(frozen=True, kw_only=True, slots=True)
class EvalSection:
    interval: Annotated[int, Range(1)] = 100
    """Validate every this many optimizer steps."""
    batches: Annotated[int, Range(0)] = 10
    """Validation batches each time (0: validation off)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class CheckpointSection:
    branch_from: str | None = None
    """A checkpoint of another run (RUN_DIR/stepNNNNNNNN, or RUN_DIR for its latest) this run starts from when its
    own run_dir holds none: weights, optimizer, step and data position, exactly as a resume, with its own schedule
    (a cooldown branched from a stable phase) and data stages. The source run is only read."""
    enabled: bool = True
    """false: write no checkpoint at all, not even at the end or on SIGTERM (benchmarks, smoke runs)."""
    interval: Annotated[int, Range(1)] = 500
    keep_last: Annotated[int, Range(1)] = 3
    resume: str = "auto"
    """auto: continue from the latest complete checkpoint in run_dir; never: start fresh (refuses a run_dir
    that holds checkpoints); or a tag such as step00000100."""
    verify: bool = False
    """Record each checkpoint file's sha256 when saving and check it on resume (sizes are always checked). Costs a
    read of every file at each save."""


@dataclass(frozen=True, kw_only=True, slots=True)
class LogSection:
    interval: Annotated[int, Range(1)] = 10
    tensorboard: bool = True
    wandb_project: str | None = None
    """Weights & Biases project: every metrics.jsonl record goes there too, the config as its parameters. W&B's
    own settings apply (WANDB_API_KEY, WANDB_MODE=offline). None: off."""
    wandb_entity: str | None = None
    mlflow_tracking_uri: str | None = None
    """MLflow tracking server (http://host:5000) or store: the same records and parameters. None: off."""
    mlflow_experiment: str = "pipeline"
    tracking_name: str | None = None
    """The tracked run's name (default: the run folder's name); resumes continue the same tracked run."""


@dataclass(frozen=True, kw_only=True, slots=True)
class PretrainConfig:
    run_dir: str = "runs/default"
    """Checkpoints, metrics.jsonl, TensorBoard events and the resolved config go here."""
    model: ModelSection = field(default_factory=ModelSection)
    data: DataSection = field(default_factory=DataSection)
    batch: BatchSection = field(default_factory=BatchSection)
    optim: OptimSection = field(default_factory=OptimSection)
    train: TrainSection = field(default_factory=TrainSection)
    eval: EvalSection = field(default_factory=EvalSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    log: LogSection = field(default_factory=LogSection)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


_SECTION_CLASSES: dict[str, Any] = {k: v for k, v in typing.get_type_hints(PretrainConfig).items() if k != "run_dir"}
_SECTIONS = ["run_dir", *_SECTION_CLASSES]


def _section_class(name: str) -> Any:
    return _SECTION_CLASSES[name]


def apply_overrides(raw: dict[str, Any], sets: list[str]) -> dict[str, Any]:
    """`section.key=value` (value parsed as YAML) into the raw mapping."""
    raw = json.loads(json.dumps(raw))
    for s in sets:
        key, sep, value = s.partition("=")
        if not sep or not key:
            raise ConfigError([f"--set {s}: expected section.key=value, e.g. optim.lr=1e-3"])
        node = raw
        parts = key.split(".")
        for p in parts[:-1]:
            node = node.setdefault(p, {})
        node[parts[-1]] = yaml.safe_load(value)
    return raw


PATH_FIELDS = {
    ("data", "path"),
    ("data", "stages"),
    ("model", "init_from"),
    ("model", "architecture"),
    ("checkpoint", "branch_from"),
    ("train", "deepspeed_config"),
}
"""The fields (besides run_dir) that name files or folders: a leading ~ is the user's home, as in a shell."""


def from_dict(raw: dict[str, Any], source: str = "config") -> PretrainConfig:
    """Build the config, reporting every problem at once: unknown sections and fields, values of the wrong type,
    and the range checks of `check` on every section that could be built."""
    problems: list[str] = []
    kwargs: dict[str, Any] = {}
    if not isinstance(raw or {}, dict):
        raise ConfigError(["expected a mapping of sections (run_dir, model, data, ...)"], source)
    for key, value in (raw or {}).items():
        if key == "run_dir":
            kwargs[key] = os.path.expanduser(str(value))
            continue
        if key not in _SECTIONS:
            problems.append(
                f"{key}: unknown section (known: run_dir, {', '.join(s for s in _SECTIONS if s != 'run_dir')})"
            )
            continue
        cls = _section_class(key)
        if not isinstance(value, dict):
            problems.append(f"{key}: expected a mapping of fields")
            continue
        known = {f.name: f for f in dataclasses.fields(cls)}
        fields = {}
        for k, v in value.items():
            if k not in known:
                problems.append(f"{key}.{k}: unknown field (known: {', '.join(known)})")
                continue
            try:
                fields[k] = coerce(v, unannotated(str(known[k].type)))
            except ValueError as e:
                problems.append(f"{key}.{k}: {e}")
                continue
            if (key, k) in PATH_FIELDS:  # "~/data" in YAML is no shell's: expanded as the user meant
                v = fields[k]
                fields[k] = (
                    {s: os.path.expanduser(str(p)) for s, p in v.items()}
                    if isinstance(v, dict)
                    else (os.path.expanduser(v) if isinstance(v, str) else v)
                )
        try:
            kwargs[key] = cls(**fields)
        except (TypeError, ValueError) as e:
            problems.append(f"{key}: {e}")
    problems += check(PretrainConfig(**kwargs))
    if problems:
        raise ConfigError(problems, source)
    return PretrainConfig(**kwargs)


_TYPE_WORDS = {"int": "an integer", "float": "a number", "bool": "true or false", "str": "a string", "None": "null"}


def coerce(value: Any, annotation: str) -> Any:
    """A YAML value as the field's declared type (`int | None`, `float`, `dict[str, Any]`, ...), or ValueError.
    YAML 1.1 reads `1e9` and `3e-4` as strings and `'5'` is a string too: numbers written so are numbers. A float
    with no fraction is an integer (max_tokens: 1e9); true/false are not numbers."""
    kinds = [k.strip() for k in annotation.split("|")]
    choices = _choices(annotation)
    if choices:  # a closed set of strings; which ones, `check` says, naming them
        if isinstance(value, str):
            return value
        raise ValueError(f"expected a string, got {value!r}")
    if value is None:
        if "None" in kinds:
            return None
    elif any(k.startswith("dict") for k in kinds):
        if isinstance(value, dict):
            return value
    elif isinstance(value, bool):
        if "bool" in kinds:
            return value
    elif "int" in kinds:
        number = _number(value)
        if number is not None and float(number).is_integer():
            return int(number)
    elif "float" in kinds:
        number = _number(value)
        if number is not None:
            return float(number)
    elif "str" in kinds:
        if isinstance(value, str):
            return value
    elif "bool" not in kinds:
        return value
    wanted = " or ".join(
        f"one of {', '.join(map(str, choices))}"
        if k.startswith("Literal[")
        else _TYPE_WORDS.get(k, "a mapping" if k.startswith("dict") else k)
        for k in kinds
    )
    raise ValueError(f"expected {wanted}, got {value!r}")


def unannotated(annotation: str) -> str:
    """`Annotated[int | None, Range(1)]` as `int | None`: the type a YAML value is read as (the markers are the
    checks of pipeline.fields)."""
    if not annotation.startswith("Annotated["):
        return annotation
    depth = 0
    for i, ch in enumerate(annotation[len("Annotated[") :], start=len("Annotated[")):
        depth += ch in "[("
        depth -= ch in "])"
        if ch == "," and depth == 0:
            return annotation[len("Annotated[") : i].strip()
    return annotation


def _choices(annotation: str) -> list[Any]:
    """The values of a `Literal[...]` annotation (empty for any other)."""
    kinds = [k.strip() for k in annotation.split("|")]
    return [c for k in kinds if k.startswith("Literal[") for c in ast.literal_eval(k[len("Literal") :])]


def _number(value: Any) -> int | float | None:
    if isinstance(value, (int, float)):
        return value
    if isinstance(value, str):
        try:
            return float(value.strip().replace("_", ""))
        except ValueError:
            return None
    return None


def check(cfg: PretrainConfig) -> list[str]:
    """Field-level checks that need no files, each section's own: its fields' ranges and choices (the markers of
    pipeline.fields) and its rules between its own fields (`problems`). Batch arithmetic against the world size is
    in `batch_plan`; the rules between a config and its layout are the layout's."""
    p = []
    for name in _SECTION_CLASSES:
        section = getattr(cfg, name)
        p += field_problems(section, prefix=name)
        p += section.problems() if hasattr(section, "problems") else []
    return p


class _OneKeyEach(yaml.SafeLoader):
    """YAML that refuses a key given twice in one mapping: PyYAML would keep the last one without a word."""

    twice: list[str]

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)  # type: ignore[no-untyped-call]
            line = key_node.start_mark.line + 1
            if key in seen:
                self.twice.append(
                    f"line {line}: '{key}' is given twice in one section (first on line {seen[key]}); "
                    "YAML would keep the last silently: keep one"
                )
            seen.setdefault(key, line)
        return super().construct_mapping(node, deep=deep)


def load(path: str | Path, sets: list[str] | None = None) -> PretrainConfig:
    path = Path(path)
    if not path.exists():
        raise ConfigError([f"{path}: no such config file (see configs/ for examples)"], str(path))
    loader = _OneKeyEach(path.read_text())
    loader.twice = []
    try:
        raw = loader.get_single_data() or {}
    except yaml.YAMLError as e:
        raise ConfigError([f"not valid YAML: {e}"], str(path)) from None
    finally:
        loader.dispose()
    if loader.twice:
        raise ConfigError(loader.twice, str(path))
    return from_dict(apply_overrides(raw, sets or []), str(path))


def dump(cfg: PretrainConfig) -> str:
    return yaml.safe_dump(cfg.to_dict(), sort_keys=False)


def dump_for_the_run(cfg: PretrainConfig, launched_from: Path) -> str:
    """The config as RUN_DIR/config.yaml keeps it: its file and folder fields (PATH_FIELDS) absolute, resolved
    against the folder the run was launched from. `evaluate`, `export`, `harness` and `plan --from-run` read it from
    wherever they are run; a relative data.path there would name another folder, or none (and an export without
    its tokenizer)."""
    raw = cfg.to_dict()

    def absolute(value: Any) -> Any:
        if isinstance(value, dict):
            return {k: absolute(v) for k, v in value.items()}
        if not isinstance(value, str) or value == "auto" or os.path.isabs(value):
            return value
        return str((launched_from / value).resolve())

    for section, key in PATH_FIELDS:
        if raw.get(section, {}).get(key) is not None:
            raw[section][key] = absolute(raw[section][key])
    return yaml.safe_dump(raw, sort_keys=False)
