"""Planner: will a model fit a cluster, how fast will it really train, and the DeepSpeed config that gets there.
This module tries every configuration (ZeRO stage, offload, checkpointing, micro-batch, buckets, DeepSpeed 0.19's
offload features), prices each (pipeline.plan.estimate) and chooses; pipeline.plan.ds_json writes the choice.
Pure arithmetic: no CUDA calls. Every throughput is printed beside its physical ceiling (100% of peak) and as a
low-high range, with the rates it assumed and where each came from.

One job: the search (which layouts are tried, which is chosen and why); the prices are pipeline.plan.memory and
pipeline.plan.timing's, the words pipeline.plan.report's.

Memory (pipeline.plan.memory): model states follow DeepSpeed's own estimators; activations use coefficients
measured on a real transformers Llama layer (or a fused stack's); the GPU figure is given like with like
(`peak_allocated`, what torch.cuda.max_memory_allocated reports) and as what the card must hold (`reserved`, the
allocator's slack on transients), and a plan keeps a margin. Host RAM is counted buffer by buffer as DeepSpeed
pins it. Time (pipeline.plan.timing): compute at an efficiency that depends on the card and the micro-step, the
network, copies through host memory, parameter offload and CPU Adam at node-level rates, fitted to published
runs (tests/unit/plan/test_timing_published.py) and our own H200 anchors (tests/unit/plan/test_estimate.py).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

from pipeline.model import (
    PRESETS,
    ModelShape,
    families,
    loss_chunk_tokens,
    resolve_shape,
    sequence_parallel_problems,
    with_seq_len,
)
from pipeline.model.varlen import attention_facts, sequence_parallel_attention_problems
from pipeline.plan.cluster import (
    FEATURES,
    OPT_IN,
    Cluster,
    Layout,
    OffloadDevice,
    Stack,
    sequence_parallel_divides,
)
from pipeline.plan.estimate import HOST_RAM_LIMIT, MFU_CONVENTION, Estimate, estimate, estimate_dict
from pipeline.plan.memory import GiB, host_memory
from pipeline.plan.timing import Rates

# ZeRO-3 bucket sets the search tries (reduce, prefetch, max live). Their memory is counted (pipeline.plan.memory):
# DeepSpeed's defaults (5e8, 5e7, 1e9) are predicted not to fit a 2-layer 70B slice on 24 GiB, as measured.
BUCKETS_ZERO3 = [(1e8, 1e8, 3e8), (2e8, 2e8, 5e8)]
NEAR_TIE = 0.02  # throughputs within 2% are a tie, broken toward less memory


@dataclass(frozen=True, slots=True)
class OptimizerFit:
    """What the search needs of the run's optimizer (pipeline.train.setup.optimizers.OPTIMIZERS' entry): the ZeRO
    stages it runs under, whether its states may be offloaded, its state bytes per parameter. The default is
    DeepSpeed's AdamW."""

    zero_stages: tuple[int, ...] = (0, 1, 2, 3)
    offload: bool = True
    moment_bytes: float = 8.0
    name: str = "adamw"


def candidates(
    c: Cluster,
    seq_len: int,
    global_batch_tokens: int,
    micro_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64),
    fixed_micro: int | None = None,
    sequence_sizes: tuple[int, ...] = (1,),
    optimizer: OptimizerFit | None = None,
) -> list[Layout]:
    """Every configuration tried: ZeRO stage and offload, checkpointing, micro-batch, buckets, DeepSpeed 0.19's
    offload features, and the sequence-parallel sizes given (`sequence_sizes`, pipeline.plan.search.search); only
    the stages and offloads `optimizer` runs under, its state bytes priced."""
    opt = optimizer or OptimizerFit()
    out = []
    global_seqs = max(1, round(global_batch_tokens / seq_len))
    offloads: list[tuple[int, OffloadDevice, OffloadDevice]] = [
        (0, "none", "none"),
        (1, "none", "none"),
        (2, "none", "none"),
        (2, "cpu", "none"),
        (3, "none", "none"),
        (3, "cpu", "none"),
        (3, "cpu", "cpu"),
    ]
    if c.nvme_bytes:
        offloads += [(3, "nvme", "cpu"), (3, "nvme", "nvme")]
    for stage, oo, op in offloads:
        if stage not in opt.zero_stages or (oo != "none" and not opt.offload):
            continue
        for ckpt in (False, True):
            for micro, sp in itertools.product((fixed_micro,) if fixed_micro else micro_sizes, sequence_sizes):
                per = micro * c.world // sp  # a sequence-parallel group is one data-parallel replica
                ga = max(1, round(global_seqs / per))
                buckets = BUCKETS_ZERO3 if stage == 3 else [(5e8, 5e7, 1e9)]
                for rb, pb, ml in buckets:
                    sub = 1e8 if oo != "none" else 1e9
                    base = Layout(
                        stage,
                        oo,
                        op,
                        ckpt,
                        micro,
                        ga,
                        rb,
                        pb,
                        ml,
                        sub,
                        sequence_parallel=sp,
                        moment_bytes=opt.moment_bytes,
                    )
                    out += [v for v in feature_variants(base) if not (v.zenflow_interval and sp > 1)]
    return out


def mlp_tiles(local_seq_len: int, hidden_size: int) -> int:
    """The tiles the tiled MLP needs: one per hidden_size tokens of a rank's sequence (as ALST tiles), so a tile's
    SwiGLU intermediates are no larger than a few of the layer's own activations; 1: no tiling pays."""
    return -(-local_seq_len // hidden_size) if hidden_size else 1


_KEY_FIELDS = tuple(f.name for f in fields(Layout) if f.name not in ("micro_batch_size", "grad_accum"))


def _key(cand: Layout) -> tuple[Any, ...]:
    """A configuration but for its micro-batch (and the accumulation that follows from it). A tuple of the other
    fields: the search asks it of every estimate, and `replace` was a quarter of the planner's time."""
    return tuple(getattr(cand, name) for name in _KEY_FIELDS)


def too_long(ests: list[Estimate]) -> set[tuple[Any, ...]]:
    """The configurations (`_key`) whose smallest micro-batch does not fit the GPU: one sample is too long for
    them as they stand."""
    smallest: dict[tuple[Any, ...], Estimate] = {}
    for e in ests:
        k = _key(e.layout)
        if k not in smallest or e.layout.micro_batch_size < smallest[k].layout.micro_batch_size:
            smallest[k] = e
    return {k for k, e in smallest.items() if any(w.startswith("GPU memory") for w in e.why_not)}


def tiled_where_needed(ests: list[Estimate], seq_len: int, shape: ModelShape) -> list[Layout]:
    """The tiled MLP where it is needed: for every configuration whose smallest micro-batch does not fit the GPU
    untiled (a long sequence's SwiGLU intermediates), each of its micro-batches again with the MLP in tiles. Where
    one sample fits untiled the tiled MLP is not offered: it has not been measured on a GPU, and a larger
    micro-batch is better bought with what has. Under ZeRO-3 a tiled configuration keeps a layer's three MLP
    matrices gathered across its tiles (`stage3_max_reuse_distance` at least `mlp_reuse(shape)`), or each tile
    would gather them again."""
    short = too_long(ests)
    out = []
    for e in ests:
        cand = e.layout
        tiles = mlp_tiles(seq_len // cand.sequence_parallel, shape.hidden_size)
        if _key(cand) not in short or tiles < 2:
            continue
        reuse = cand.max_reuse or cand.max_live
        out.append(replace(cand, tiled_mlp=tiles, max_reuse=max(reuse, mlp_reuse(shape)) if cand.stage == 3 else None))
    return out


BUCKET_SMALL = 1e8
"""The ZeRO-1/2 reduce bucket tried where DeepSpeed's 5e8 leaves no room for one sample (4.5 bf16 copies of a
bucket: 4.19 GiB at 5e8, 0.84 at 1e8); without a collective's latency priced under ZeRO-1/2, it is not offered where
one sample fits, or every choice would take it for the memory."""


def smaller_buckets_where_needed(ests: list[Estimate]) -> list[Layout]:
    """ZeRO-1/2 configurations whose smallest micro-batch does not fit the GPU, each micro-batch again with
    BUCKET_SMALL reduce buckets."""
    short = too_long(ests)
    return [
        replace(e.layout, reduce_bucket=BUCKET_SMALL)
        for e in ests
        if e.layout.stage in (1, 2) and e.layout.reduce_bucket > BUCKET_SMALL and _key(e.layout) in short
    ]


def mlp_reuse(shape: ModelShape) -> float:
    """The reuse distance (parameters) under which ZeRO-3 keeps gate, up and down gathered from one tile to the next:
    between two uses of a matrix come the other two (DeepSpeed releases a module whose next use is further away)."""
    return float(shape.mlp_params())


def sequence_sizes(shape: ModelShape, seq_len: int, c: Cluster, stack: Stack | None = None) -> tuple[int, ...]:
    """The sequence-parallel sizes this trainer can run here: powers of two that divide the world and seq_len and
    split the model's heads (pipeline.model.sequence_parallel_problems); 1 only for another training stack (the
    published runs'), materialised attention or whole documents on SDPA's dense mask, which Ulysses does not take,
    and for a model whose attention it would change (pipeline.model.varlen: a dynamic RoPE, or a sliding window
    off the varlen path)."""
    stack = stack or Stack()
    if stack.engine != "deepspeed" or stack.attention == "eager":
        return (1,)
    if sequence_parallel_attention_problems(2, attention_facts(shape), seq_len, stack.whole_documents, stack.varlen):
        return (1,)  # the trainer's own rule (pipeline.train.setup.prepare refuses the same)
    sizes = (2**k for k in range(0, 11))
    return tuple(
        n
        for n in sizes
        if n <= c.world
        and not sequence_parallel_divides(n, c.world, seq_len)
        and not sequence_parallel_problems(shape, n)
    )


def feature_variants(base: Layout) -> list[Layout]:
    """`base` and what DeepSpeed 0.19's offload features make of it (pipeline.plan.cluster.FEATURES): activation
    offload where activations are checkpointed; under CPU optimizer offload bf16 master weights (and states), and
    ZenFlow on ZeRO-1/2 (ZeRO-3 with ZenFlow does not run in DeepSpeed 0.19.8: pipeline.train.setup.ds_config), whose
    CPU update every `grad_accum` steps replaces accumulation, so the same tokens reach each full update."""
    out = [base]
    if base.activation_checkpointing:
        out.append(replace(base, offload_activations=True))
    if base.offload_optimizer == "cpu":
        for c in list(out):
            out.append(replace(c, bf16_master=True))
            out.append(replace(c, bf16_master=True, bf16_optimizer_states=True))
            if base.stage in (1, 2) and base.grad_accum > 1:
                out.append(replace(c, grad_accum=1, zenflow_interval=base.grad_accum))
    return out


@dataclass
class Plan:
    shape: ModelShape
    seq_len: int
    cluster: Cluster
    best: Estimate | None
    ranked: list[Estimate]
    rejected: list[Estimate]
    advice: list[str]
    mfu_assumed: float | None = None
    """A fixed compute efficiency (--mfu); None: the fitted curve."""
    global_batch_tokens: int = 0
    """What was asked; the chosen configuration's own global batch may differ (rounded to whole micro-batches)."""
    opt_in: frozenset[str] = frozenset()
    """The features that change the numerics which the user allowed (`--opt-in`)."""
    by_feature: dict[str, tuple[Estimate | None, Estimate | None]] = field(default_factory=dict)
    """For each DeepSpeed 0.19 offload feature (pipeline.plan.cluster.FEATURES): the fastest fitting configuration
    that uses it (the other features as allowed), or None; and when none fits, the closest that does not."""
    stack: Stack | None = None
    """The training software planned for (None: the planner's default)."""

    def feature_notes(self) -> list[str]:
        """What each DeepSpeed 0.19 offload feature brings here, against the choice: the gain of the ones it uses
        (over the fastest fitting configuration without that one), what each one left out would give, and why a
        feature has no configuration that fits."""
        if self.best is None:
            return []
        best, notes = self.best, []
        for name, (e, unfit) in self.by_feature.items():
            how = FEATURES[name].cost
            if name in best.layout.features():
                without = [r for r in self.ranked if name not in r.layout.features()]
                gain = (
                    f"{best.tokens_per_s / without[0].tokens_per_s - 1:+.0%} over {without[0].layout.label()}"
                    if without
                    else "needed to fit"
                )
                notes.append(f"{name}: used, {gain} ({how})")
            elif e is None:
                why = f" (closest: {unfit.layout.label()}: {'; '.join(unfit.why_not)})" if unfit else ""
                notes.append(f"{name}: no configuration with it fits{why}")
            else:
                lo, hi = e.tokens_per_s_range
                ask = f"not chosen; --opt-in {name} allows it" if name in OPT_IN - self.opt_in else "not chosen"
                notes.append(
                    f"{name}: {ask}: {e.layout.label()} at {e.tokens_per_s:,.0f} tokens/s ({lo:,.0f}-{hi:,.0f}), "
                    f"{e.tokens_per_s / best.tokens_per_s - 1:+.0%}; GPU {e.gpu['reserved'] / GiB:.1f} GiB, host "
                    f"{e.host['total'] / 1e9:.0f} GB ({how})"
                )
        return notes

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.shape.as_dict(),
            "params": self.shape.num_params(),
            "seq_len": self.seq_len,
            "cluster": {
                **asdict(self.cluster),
                "gpu": asdict(self.cluster.gpu),
                "measured": sorted(self.cluster.measured),
                "packages": None if self.cluster.packages is None else sorted(self.cluster.packages),
            },
            "best": estimate_dict(self.best) if self.best else None,
            "runners_up": [estimate_dict(e) for e in self.ranked[1:6]],
            "advice": self.advice,
            "mfu_assumed": self.mfu_assumed,
            "mfu_convention": MFU_CONVENTION,
            "global_batch_tokens_requested": self.global_batch_tokens,
            "opt_in": sorted(self.opt_in),
            "features": self.feature_notes(),
            "by_feature": {k: estimate_dict(e) if e else None for k, (e, _) in self.by_feature.items()},
        }


def trainer_loss_chunk(shape: ModelShape) -> int:
    """The chunk our trainer computes its loss in by default (pipeline.model), so the plan counts its logits."""

    return loss_chunk_tokens(shape.vocab_size)


def choose(fitting: list[Estimate]) -> list[Estimate]:
    """Fastest first; throughputs within NEAR_TIE of the fastest count as a tie, broken toward less memory."""
    if not fitting:
        return []
    ranked = sorted(fitting, key=lambda e: (-e.tokens_per_s, e.gpu["reserved"]))
    best_tps = ranked[0].tokens_per_s
    ties = sorted((e for e in ranked if e.tokens_per_s >= (1 - NEAR_TIE) * best_tps), key=lambda e: e.gpu["reserved"])
    return [ties[0]] + [e for e in ranked if e is not ties[0]]


THIN_GIB, LONG_SEQ, ROOM_TRADE = 1.5, 16384, 0.85
"""At LONG_SEQ tokens and more a plan that leaves less than THIN_GIB free after the margin is thin (one activation
is a 0.25-1.75 GiB block there, and the long-context terms are counted on the CPU, not yet measured on a GPU): the
fastest configuration that leaves THIN_GIB is chosen instead where it keeps ROOM_TRADE of the fastest's
throughput."""


def free_gib(c: Cluster, e: Estimate) -> float:
    """What a configuration leaves of the card after the margin."""
    return c.gpu.memory_gib - (e.gpu["reserved"] + e.gpu["margin"]) / GiB


def roomy_first(ranked: list[Estimate], seq_len: int, c: Cluster) -> list[Estimate]:
    """`ranked` with, at a long sequence, a roomy configuration first in place of a thin one (THIN_GIB)."""
    if seq_len < LONG_SEQ or not ranked or free_gib(c, ranked[0]) >= THIN_GIB:
        return ranked
    floor = ROOM_TRADE * ranked[0].tokens_per_s
    roomy = next((e for e in ranked if free_gib(c, e) >= THIN_GIB and e.tokens_per_s >= floor), None)
    return ranked if roomy is None else [roomy, *(e for e in ranked if e is not roomy)]


def search(
    shape: ModelShape,
    seq_len: int,
    c: Cluster,
    global_batch_tokens: int = 4 * 2**20,
    mfu_assumed: float | None = None,
    fixed_micro: int | None = None,
    loss_chunk_tokens: int | None = -1,
    stack: Stack | None = None,
    rates: Rates | None = None,
    opt_in: frozenset[str] = frozenset(),
    fixed_sequence: int | None = None,
    optimizer: OptimizerFit | None = None,
    refused: Callable[[Layout], list[str]] | None = None,
) -> Plan:
    """All candidate configurations, fitting ones ranked. `loss_chunk_tokens` -1: the trainer's default chunk.
    `fixed_micro`, `fixed_sequence`: a config's own micro-batch and sequence-parallel size (else every one).
    `opt_in`: the features that change the numerics (pipeline.plan.cluster.OPT_IN) the choice may use; the others
    are priced too, and the fastest fitting configuration with each feature comes back in `by_feature`.
    `optimizer`: the run's, so that nothing it refuses is proposed (default AdamW). `refused`: what the trainer
    would refuse of a configuration for the run's config (pipeline.train.setup.prepare.trainer_refusals): such
    configurations are not tried."""
    chunk = trainer_loss_chunk(shape) if loss_chunk_tokens == -1 else loss_chunk_tokens

    def price(cands: list[Layout]) -> list[Estimate]:
        return [
            estimate(shape, seq_len, c, cand, mfu_assumed, chunk, stack=stack, rates=rates)
            for cand in cands
            if refused is None or not refused(cand)
        ]

    def tried(sizes: tuple[int, ...]) -> list[Layout]:
        return candidates(
            c, seq_len, global_batch_tokens, fixed_micro=fixed_micro, sequence_sizes=sizes, optimizer=optimizer
        )

    ests = price(tried((fixed_sequence or 1,)))
    # Sharing a sample costs an all-to-all a layer: tried where one sample does not fit a rank alone
    wider = () if fixed_sequence else tuple(n for n in sequence_sizes(shape, seq_len, c, stack) if n > 1)
    if wider and (short := too_long(ests)):
        ests += price([cand for cand in tried(wider) if _key(replace(cand, sequence_parallel=1)) in short])
    ests += price(smaller_buckets_where_needed(ests))
    ests += price(tiled_where_needed(ests, seq_len, shape))
    allowed = [e for e in ests if not (e.layout.features() & OPT_IN) - opt_in]
    fitting = roomy_first(choose([e for e in allowed if e.fits]), seq_len, c)
    rejected = sorted((e for e in allowed if not e.fits), key=lambda e: -e.tokens_per_s)
    by_feature: dict[str, tuple[Estimate | None, Estimate | None]] = {}
    for name in FEATURES:  # the fastest configuration with each feature, the others as allowed
        with_it = [e for e in ests if name in e.layout.features()]
        with_it = [e for e in with_it if not (e.layout.features() & OPT_IN) - opt_in - {name}]
        fit = choose([e for e in with_it if e.fits])
        closest = min((e for e in with_it if not e.fits), key=lambda e: e.gpu["reserved"], default=None)
        by_feature[name] = (fit[0] if fit else None, closest)
    advice = [] if fitting else _advice(shape, seq_len, c, global_batch_tokens, mfu_assumed)
    if not fitting and optimizer is not None and optimizer != OptimizerFit():
        adamw = search(shape, seq_len, c, global_batch_tokens, mfu_assumed, fixed_micro, fixed_sequence=fixed_sequence)
        if adamw.best is not None:
            advice.insert(
                0,
                f"optim.name {optimizer.name} runs under ZeRO {', '.join(map(str, optimizer.zero_stages))}"
                f"{'' if optimizer.offload else ' without offload'}, where nothing fits; optim.name adamw would: "
                f"{adamw.best.layout.label()}",
            )
    return Plan(
        shape,
        seq_len,
        c,
        fitting[0] if fitting else None,
        fitting,
        rejected,
        advice,
        mfu_assumed,
        global_batch_tokens,
        opt_in,
        by_feature,
        stack,
    )


def _advice(shape: ModelShape, seq_len: int, c: Cluster, gbt: int, mfu: float | None) -> list[str]:
    tips = []
    psi = shape.num_params()
    offload = estimate(shape, seq_len, c, Layout(3, "cpu", "cpu", True, 1, 1, *BUCKETS_ZERO3[0], 1e8), mfu)
    if offload.host["total"] > HOST_RAM_LIMIT * c.cpu_mem_bytes:
        per_node_limit = HOST_RAM_LIMIT * c.cpu_mem_bytes
        nodes_needed = next(
            (
                n
                for n in range(c.nodes + 1, 1025)
                if host_memory(shape, replace(c, nodes=n), offload.layout)["total"] <= per_node_limit
            ),
            1024,
        )
        tips.append(
            f"fp32 master weights, gradients and Adam moments alone are {16 * psi / 1e9:,.0f} GB; ZeRO-3 with "
            f"CPU offload needs {offload.host['total'] / 1e9:,.0f} GB of host RAM per node here (80% limit: "
            f"{per_node_limit / 1e9:,.0f} GB): about {nodes_needed} nodes of "
            f"{c.cpu_mem_bytes / 1e9:.0f} GB RAM (you have {c.nodes})"
        )
    if not c.nvme_bytes:
        nv = replace(c, nvme_bytes=10**15)
        if search(shape, seq_len, nv, gbt, mfu).best is not None:
            tips.append(
                f"NVMe offload (ZeRO-Infinity) would fit: about {18 * psi / c.nodes / 1e12:.1f} TB of NVMe "
                "per node (--nvme SIZE)"
            )

    for name, s in sorted(PRESETS.items(), key=lambda kv: -kv[1].num_params()):
        s = replace(s, vocab_size=shape.vocab_size)
        if s.num_params() < psi and search(s, seq_len, c, gbt, mfu).best is not None:
            tips.append(f"the largest preset that fits this cluster is {name} ({s.num_params() / 1e9:.1f}B)")
            break
    return tips or ["no configuration fits; try more nodes or GPUs with more memory"]


def planned_shape(model: str, layers: int | None, vocab_size: int, seq_len: int) -> tuple[ModelShape, str | None]:
    """`plan --model`: a preset, or a Hugging Face folder / config.json, with `layers` if given, raised to `seq_len`
    when that is longer; and a note when it was raised."""

    if families.config_path(model):
        shape = families.shape_from_config(families.read_config(model), model)
        shape = replace(shape, num_layers=layers) if layers else shape
    else:
        shape = resolve_shape(model, {"num_layers": layers} if layers else {}, vocab_size)
    note = None
    if seq_len > shape.max_seq_len:
        note = (
            f"note: --seq-len {seq_len} is above {model}'s max_seq_len {shape.max_seq_len}; planned "
            "as if its RoPE were extended (continued pretraining at a longer context)"
        )
    return with_seq_len(shape, seq_len), note
