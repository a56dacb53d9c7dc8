"""`pipeline evaluate`'s, `export`'s and `harness`'s configs, light enough for the command line to read their fields
(pipeline.fields): each field is an option of its command."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Literal

from pipeline.errors import ConfigError
from pipeline.fields import FilePath, Flag, Hidden, Range, Size, field_problems


@dataclass(frozen=True, kw_only=True, slots=True)
class EvalConfig:
    checkpoint: Annotated[str, FilePath()]
    """RUN_DIR (its latest complete checkpoint) or RUN_DIR/TAG."""
    data: Annotated[str | None, FilePath()] = None
    """Shard folder (default: the run's own data.path)."""
    split: Literal["val", "test", "train"] = "val"
    """The split evaluated."""
    max_batches: Annotated[int | None, Range(1)] = None
    """Evaluate at most this many batches (default: all)."""
    batch_size: Annotated[int, Range(1)] = 8
    """Samples per forward (per rank)."""
    prompts: Annotated[str | None, FilePath()] = None
    """Text file, one prompt per line (\\n for a newline)."""
    output: Annotated[str | None, FilePath()] = None
    """JSON results (default RUN_DIR/eval/TAG-SPLIT.json, TAG-avgN-SPLIT.json for an average)."""
    average: str | None = None
    """The mean of several checkpoints of the run instead of one: last:N (the N newest) or a list of tags or steps
    (100,200,300); weights averaged in fp32, one tensor at a time."""
    max_new_tokens: Annotated[int, Range(0, 100_000)] = 48
    """Tokens per sample continuation (0: none, the metrics only)."""
    seed: int = 1234
    """Seeds the sampled continuations."""
    device: str = "auto"
    """cpu, cuda, cuda:1, or auto (cuda when torch sees a GPU)."""
    needle: str | None = None
    """Prompt lengths in tokens (e.g. 8192,32768) for a needle-in-a-haystack test on the split's own text: each
    length's share of prompts whose greedy answer is the needle's, and the answer's loss (beside the base's with
    --baseline)."""
    baseline: bool = False
    """Also evaluate the model the run started from (its model.init_from) on the same samples, and report the
    change in loss in total and by source, each with its standard error (paired over the samples)."""

    def __post_init__(self) -> None:
        if problems := field_problems(self):
            raise ConfigError(problems, "evaluate options")


@dataclass(frozen=True, kw_only=True, slots=True)
class ExportConfig:
    checkpoint: Annotated[str, FilePath()]
    """RUN_DIR (its latest complete checkpoint) or RUN_DIR/TAG."""
    output: Annotated[str, FilePath()]
    """Folder to write the Hugging Face model into."""
    dtype: Literal["bf16", "fp16", "fp32"] = "bf16"
    """The weights' precision in the export."""
    max_shard_bytes: Annotated[int, Flag("max-shard-size"), Size("2GB"), Range(1)] = 2 * 10**9
    """Largest safetensors file."""
    average: str | None = None
    """The mean of several checkpoints of the run instead of one: last:N (the N newest) or a list of tags or steps
    (100,200,300); weights averaged in fp32, one tensor at a time."""
    data: Annotated[str | None, FilePath()] = None
    """The run's shard folder, where its tokenizer is read from (default: the run's own data.path)."""
    gguf: tuple[Literal["f16", "q8_0"], ...] = ()
    """Also write OUTPUT/NAME-TYPE.gguf for llama.cpp and Ollama (repeatable; a sentencepiece tokenizer.model, or a
    byte-level BPE tokenizer.json as Llama 3's and Qwen2's; checked before the export starts)."""

    def __post_init__(self) -> None:
        if problems := field_problems(self):
            raise ConfigError(problems, "export options")


@dataclass(frozen=True, kw_only=True, slots=True)
class HarnessConfig:
    checkpoint: Annotated[str, FilePath()]
    """RUN_DIR (its latest complete checkpoint) or RUN_DIR/TAG."""
    tasks: str
    """lm-evaluation-harness tasks, comma-separated: the bundled offline pipeline_demo_ppl (configs/lm_eval/), or the
    harness's own such as hellaswag,arc_easy (downloaded)."""
    lm_eval: Annotated[str, FilePath()] = ".venv-lm-eval/bin/lm_eval"
    """The harness's lm_eval in its own environment (`make eval TASKS=...` installs it there)."""
    device: str = "auto"
    """cpu, cuda, cuda:1, or auto (cuda when torch sees a GPU)."""
    batch_size: str = "8"
    """The harness's --batch_size (a number or auto)."""
    limit: Annotated[float | None, Range(0.0, open_low=True)] = None
    """Documents per task (a fraction below 1); for smoke runs."""
    dtype: Annotated[Literal["bf16", "fp16", "fp32"], Hidden()] = "bf16"
    """The precision of the export the harness reads."""

    def __post_init__(self) -> None:
        if problems := field_problems(self):
            raise ConfigError(problems, "harness options")
