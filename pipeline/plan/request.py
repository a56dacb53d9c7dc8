"""What `pipeline plan` is asked (`PlanRequest`), light enough for the command line to read its fields: each field
but the node facts (pipeline.plan.facts.NODE_FACTS) and the opt-ins is an option of the command (pipeline.fields)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from pipeline.errors import ConfigError
from pipeline.fields import Default, FilePath, Flag, Hidden, Range, Tokens, field_problems
from pipeline.plan.facts import CLUSTER_DEFAULTS


@dataclass(frozen=True, kw_only=True, slots=True)
class PlanRequest:
    model: str = "7b"
    """Preset (tiny, 125m, 350m, 1b, 7b, 13b, 70b), or a Hugging Face model folder or its config.json (Llama,
    Mistral, Qwen2, Qwen3)."""
    config: Annotated[str | None, FilePath()] = None
    """Plan exactly this pretrain config (its model, batch, DeepSpeed JSON and checkpointing) instead of searching;
    says whether it fits and what the search would choose."""
    sets: Annotated[tuple[str, ...], Flag("set")] = ()
    """Override a config field: section.key=value (repeatable)."""
    from_run: Annotated[str | None, FilePath()] = None
    """A run folder: the plan for exactly that run beside what it measured (peak memory, step time, tokens/s), with
    the ratios and the rates it measured (compute efficiency, parameter fetch, CPU Adam). With --model or --config:
    plan that on the run's cluster at the run's measured rates."""
    layers: Annotated[int | None, Range(1)] = None
    """Override the preset's layer count."""
    vocab_size: Annotated[int, Range(1)] = 32000
    """Tokens in the vocabulary (a preset's; a Hugging Face config says its own)."""
    seq_len: Annotated[int | None, Tokens(1, 2**24), Default("4096; with --config, the shards' seq_len")] = None
    """Tokens per sample, e.g. 4096 or 32k."""
    hostfile: Annotated[str | None, FilePath()] = None
    """DeepSpeed hostfile (see hostfiles/): the hosts, reached by ssh, and their slots."""
    nodes: Annotated[int, Range(1)] = 1
    """Nodes of the cluster (without --hostfile)."""
    gpus_per_node: Annotated[int, Range(1)] = 1
    """GPUs per node (without --hostfile)."""
    flags: Annotated[dict[str, str | None], Hidden()] = field(default_factory=dict)
    """Each node's facts as given (keys of pipeline.plan.facts.CLUSTER_DEFAULTS; None: not given)."""
    global_batch_tokens: str = "4M"
    """Tokens per optimizer step."""
    micro_batch_size: Annotated[int | None, Range(1)] = None
    """Fix the micro-batch instead of searching it."""
    mfu: Annotated[float | None, Range(0.0, 1.0, open_low=True)] = None
    """Fix the compute efficiency (0 < mfu <= 1, of peak, PaLM count plus recompute) instead of the curve fitted to
    published runs (which depends on the card and the micro-step); e.g. what your own run measured."""
    tokens: str = "1B"
    """Token budget for the time estimate."""
    whole_documents: bool = False
    """Shards of whole documents (`pipeline shard --whole-documents`; with --config, read from the shards)."""
    document_attention: Literal["auto", "varlen", "dense"] = "auto"
    """How the cluster keeps documents apart (train.document_attention): varlen (flash_attn installed there, no
    mask), dense (SDPA's (seq x seq) mask, priced; no sequence parallelism); auto: varlen where flash_attn is
    installed on this machine."""
    write_ds_config: Annotated[str | None, FilePath()] = None
    """Write the chosen DeepSpeed JSON here."""
    opt_in: Annotated[frozenset[str], Hidden()] = frozenset()
    """DeepSpeed 0.19 offload features that change the numerics the choice may use (--opt-in, the keys of
    pipeline.plan.cluster.OPT_IN)."""
    as_json: Annotated[bool, Flag("json")] = False
    """Print the result as JSON."""
    fits_table: bool = False
    """Print the table of docs/planning.md: presets 1b-70b on each reference hostfile."""
    long_context_table: bool = False
    """Print the table of docs/long-context.md: the headline plans."""
    model_given: Annotated[bool, Hidden()] = False
    """--model was given (with --from-run: plan that model at the run's rates, not the run itself)."""
    cluster_given: Annotated[bool, Hidden()] = False
    """Any of --hostfile, --nodes, --gpus-per-node, --gpu, --gpu-mem, --cpu-mem was given."""

    def __post_init__(self) -> None:
        if problems := field_problems(self):
            raise ConfigError(problems, "plan options")

    @classmethod
    def from_options(cls, options: dict[str, Any], given: set[str]) -> PlanRequest:
        """The request of `pipeline plan`'s options (named as the fields; each node fact, a key of
        CLUSTER_DEFAULTS, goes to `flags`), `given` naming the options set on the command line."""
        o = {k: v for k, v in options.items() if v is not None}
        flags = {k: None if (v := o.pop(k, None)) is None else str(v) for k in CLUSTER_DEFAULTS}
        o["opt_in"] = frozenset(o.get("opt_in", ()))
        o["sets"] = tuple(o.get("sets", ()))
        return cls(
            **o,
            flags=flags,
            model_given="model" in given,
            cluster_given=bool(given & {"hostfile", "nodes", "gpus_per_node", "gpu", "gpu_mem", "cpu_mem"}),
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class ProbeRequest:
    """What `pipeline probe` is asked (pipeline.launch.probe): each field is an option of the command."""

    hostfile: Annotated[str | None, FilePath()] = None
    """DeepSpeed hostfile (see hostfiles/): the hosts, reached by ssh, and their slots."""
    out: Annotated[str | None, FilePath(), Default("HOSTFILE.probe.json beside --hostfile, else probe.json")] = None
    """Write the rates here."""
    model: str | None = None
    """With a GPU, also its bf16 GEMM rate at this model's shapes (a preset or a Hugging Face folder)."""
    seq_len: Annotated[int, Tokens(1, 2**24)] = 4096
    """Tokens per sample, e.g. 4096 or 32k."""
    micro_batch_size: Annotated[int, Range(1)] = 1
    """Samples per micro-step of the GEMM shape."""
    config: Annotated[str | None, FilePath()] = None
    """Also measure this pretrain config's own model at small depths on this node (--slice-layers), through the
    trainer with its DeepSpeed JSON, micro-batch and sequence length, extrapolated to its full depth; `pipeline plan
    --config` shows it beside the plan."""
    sets: Annotated[tuple[str, ...], Flag("set")] = ()
    """Override a config field: section.key=value (repeatable)."""
    num_gpus: Annotated[int | None, Range(1), Default("every GPU here, else 1 CPU rank")] = None
    """Ranks for the slices."""
    slice_layers: str = "2,4"
    """The depths of the slices, comma-separated (two or more)."""
    slice_steps: Annotated[int, Range(4, 1000)] = 8
    """Steps per slice (the later half is timed)."""
    slice_repeats: Annotated[int, Range(1, 10)] = 1
    """Run each slice this many times, in turn, and keep its fastest (on a shared or noisy node)."""
    quick: bool = False
    """Small sizes, about a second: checks that it runs, not the node."""
    as_json: Annotated[bool, Flag("json")] = False
    """Print the result as JSON."""

    def __post_init__(self) -> None:
        if problems := field_problems(self):
            raise ConfigError(problems, "probe options")
