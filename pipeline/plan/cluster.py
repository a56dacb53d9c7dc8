"""What the planner plans for: a cluster (nodes, their GPU, RAM, cores, network, disk) and one candidate
configuration (ZeRO stage, offload, checkpointing, batch, buckets). Plain data, shared by memory and search."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Literal

from pipeline.model import ModelShape
from pipeline.model.kernels import Switches, gpu_switches
from pipeline.plan.gpus import GPU

OffloadDevice = Literal["none", "cpu", "nvme"]


def fp32_grad_accumulation(stage: int, grad_accum: int, explicit: str | None = None) -> bool:
    """Whether a 16-bit run accumulates gradients in fp32: what `data_types.grad_accum_dtype` says, else whenever
    there is more than one micro-step to accumulate (summing 61-122 bf16 micro-step gradients in an 8-bit mantissa
    drops the small ones) and ZeRO is on (DeepSpeed refuses the mix without ZeRO)."""
    if explicit is not None:
        return explicit == "fp32"
    return stage >= 1 and grad_accum > 1


@dataclass(frozen=True, slots=True)
class Cluster:
    nodes: int
    gpus_per_node: int
    gpu: GPU
    cpu_mem_bytes: int
    nvme_bytes: int = 0
    network_gbps: float = 100.0
    nvme_gbs: float = 3.0  # per node, sequential read/write
    cpu_mem_bw_gbs: float = 80.0  # effective host memory bandwidth per node (CPU Adam; PCIe DMA shares it)
    cpu_cores: int = 32  # per node: DeepSpeed's CPU Adam runs on them
    disk_bytes: int = 0  # free space for checkpoints per node (0: not counted)
    cpu_adam_params_per_s: float | None = None  # fp32 CPU Adam per node, measured (`pipeline probe`); None: fitted
    measured: frozenset[str] = frozenset()
    """Which facts `pipeline probe` measured on a node (cpu_mem_bw, cpu_adam, pcie, gemm): their range is narrower."""
    packages: frozenset[str] | None = None
    """The kernel packages installed on the nodes (pipeline.plan.facts.KERNEL_PACKAGES), as `pipeline probe` found
    them or the facts say; None: not known, priced as none (transformers' modules, SDPA's mask)."""

    @property
    def world(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def installed(self) -> frozenset[str]:
        """The kernel packages a plan for these nodes prices as installed: those known to be (none if unknown)."""
        return self.packages or frozenset()


@dataclass(frozen=True, slots=True)
class Stack:
    """The training software, as far as its time and memory depend on it (the planner's defaults are this
    project's trainer; published runs of other stacks are planned with theirs)."""

    kernels: Literal["hf", "compiled", "liger", "fused"] = "hf"
    """The modules a decoder layer runs, for what they save for the backward (pipeline.plan.memory.SAVED_PER_H_F):
    hf, transformers' layers with SDPA (this trainer); compiled, the same under torch.compile; liger, Liger Kernel's
    norms and SwiGLU; fused, FlashAttention with fused norm, SwiGLU and cross-entropy kernels (TinyLlama,
    llm-foundry)."""
    attention: Literal["sdpa", "eager"] = "sdpa"
    """eager: attention scores materialised, seq^2 per head per layer (transformers' eager path; Falcon's 2023
    code)."""
    engine: Literal["deepspeed", "fsdp"] = "deepspeed"
    """fsdp: PyTorch's FSDP full shard (planned as ZeRO-3): it reduce-scatters one flat gradient per layer into its
    shard, without DeepSpeed's bucket temporaries."""
    bind_cores: bool = True
    """CPU Adam ranks bound to their share of the node's cores (`pipeline pretrain` does it with numactl); unbound,
    every rank starts threads on every core (DeepSpeed's default)."""
    compile: bool | None = False
    """This trainer's `train.compile` (None: auto); other stacks: False."""
    kernel_set: str = "torch"
    """This trainer's `train.kernels` (pipeline.model.kernels.KERNELS, or auto); other stacks: torch."""
    switches: Switches | None = None
    """compile and kernel_set resolved for one configuration (`resolved`), with their measured effect."""
    fused_loss: bool | None = None
    """lm_head and the loss in one kernel, no logits kept; None: as `kernels` (the fused stacks have it)."""
    fp8: bool = False
    """This trainer's `train.fp8`: the decoder layers' matmuls at the card's FP8 rate where it has one."""
    packages: frozenset[str] | None = None
    """The kernel packages installed where it runs, as `kernel_set` resolves against them (the cluster's facts);
    None: those installed on this machine (`deepspeed_config: auto` on the node that runs: what it priced is what
    runs)."""
    whole_documents: bool = False
    """Samples of whole documents (`pipeline shard --whole-documents`), kept apart by attention."""
    varlen: bool = False
    """FlashAttention-2's varlen kernel is installed (pipeline.model.varlen): whole documents and sliding windows
    need no mask, with sequence parallelism too. Without it whole documents go through SDPA with transformers'
    (seq x seq) boolean mask, alive through the micro-step, which SDPA turns into a bf16 additive bias each layer
    keeps for its backward (priced: `dense_mask`); sequence parallelism keeps neither (it is not offered)."""

    @property
    def dense_mask(self) -> bool:
        return self.whole_documents and not self.varlen

    @property
    def loss_fused(self) -> bool:
        return self.kernels in ("fused", "liger") if self.fused_loss is None else self.fused_loss

    @property
    def knee_factor(self) -> float:
        """What the resolved switches leave of the compute efficiency's knee (pipeline.plan.timing.efficiency)."""
        return self.switches.effect.knee_factor if self.switches else 1.0

    def resolved(self, shape: ModelShape, cand: Layout) -> Stack:
        """The stack one configuration of this trainer runs on a CUDA GPU: `compile` and `kernel_set` resolved as
        the trainer resolves them for its ZeRO stage and long-context parts (pipeline.model.kernels.gpu_switches),
        their measured effect in the fields the memory and time models read. Other stacks as they are."""
        if self.switches is not None or (self.compile is False and self.kernel_set == "torch" and not self.fp8):
            return self
        long_context = cand.sequence_parallel > 1 or cand.tiled_mlp > 1
        key = (self.compile, self.kernel_set, shape.family, cand.stage, long_context, self.packages)
        if (sw := _SWITCHES.get(key)) is None:  # the search resolves thousands of configurations, few kinds
            sw = _SWITCHES[key] = gpu_switches(
                self.compile, self.kernel_set, shape, cand.stage, long_context, self.packages
            )
        return replace(
            self,
            switches=sw,
            kernels=sw.effect.activations,
            fused_loss=sw.fused_loss,
        )

    def label(self) -> str:
        """The resolved switches in a few words (empty where none)."""
        if self.switches is None:
            return ""
        sw = self.switches
        return ", ".join(
            [*(["compiled"] if sw.compiled else []), *([f"{sw.kernels} kernels"] if sw.kernels != "torch" else [])]
        )


_SWITCHES: dict[tuple[Any, ...], Switches] = {}
"""gpu_switches by (compile, kernels, model family, ZeRO stage, long context, packages): all it reads."""
TRAINER = Stack(compile=None, kernel_set="auto", packages=frozenset())
"""This trainer as it runs unless told otherwise: `train.compile` and `train.kernels` auto, no kernel package known
installed (a plan for a cluster replaces `packages` with its nodes')."""


def trainer_stack(
    compile_setting: bool | None,
    kernels_setting: str,
    fp8: bool = False,
    whole_documents: bool = False,
    varlen: bool = False,
    packages: frozenset[str] | None = None,
) -> Stack:
    """This trainer with a config's `train.compile`, `train.kernels` and `train.fp8`, over its shards' documents,
    with or without the varlen attention kernel, with the kernel `packages` installed where it runs (None: as
    here)."""
    return Stack(
        compile=compile_setting,
        kernel_set=kernels_setting,
        fp8=fp8,
        whole_documents=whole_documents,
        varlen=varlen,
        packages=packages,
    )


def sequence_parallel_divides(size: int, world: int, seq_len: int | None = None) -> list[str]:
    """The sequence-parallel size's rules against the world and the sample, written once (the search offers, the
    trainer's batch arithmetic and a shrunk relaunch check these): a group of `size` ranks trains one sample, so it
    divides the ranks, and each rank holds seq_len / size of its tokens (None: the sample is not in question)."""
    found = []
    if world % size:
        fits = [n for n in range(size, 0, -1) if world % n == 0][0]
        found.append(
            f"train.sequence_parallel {size} does not divide the {world} ranks: a group of {size} ranks trains one "
            f"sample; use --set train.sequence_parallel={fits}, or a world of a multiple of {size} ranks"
        )
    if seq_len is not None and seq_len % size:
        found.append(
            f"train.sequence_parallel {size} does not divide seq_len {seq_len}: each rank of a group holds "
            f"seq_len / {size} tokens; shard with a --seq-len that is a multiple of {size}"
        )
    return found


@dataclass(frozen=True, slots=True)
class Layout:
    """One run's layout: ZeRO stage, offloads, checkpointing and its offload, micro-batch, accumulation, buckets and
    reuse distance, precision of master and states, ZenFlow, the optimizer's state bytes, the MLP's tiles and the
    ranks sharing a sample. The search proposes Layouts, the planner prices one (pipeline.plan.estimate), the
    trainer runs one (pipeline.train.setup.prepare.Prepared.layout) and a shrunk relaunch plans one for fewer hosts;
    the DeepSpeed JSON is its edge format (pipeline.plan.ds_json: `layout_from_ds` reads one, `ds_config` writes
    one)."""

    stage: int
    offload_optimizer: OffloadDevice
    offload_param: OffloadDevice
    activation_checkpointing: bool
    micro_batch_size: int
    grad_accum: int
    reduce_bucket: float = 5e8
    prefetch_bucket: float = 5e7
    max_live: float = 1e9
    sub_group: float = 1e9
    max_reuse: float | None = None  # stage3_max_reuse_distance; None: equal to max_live (what ds_config writes)
    grad_accum_dtype: str | None = None  # data_types.grad_accum_dtype; None: fp32_grad_accumulation's rule
    bf16_master: bool = False  # bf16.bf16_master_weights_and_grads: master weights and gradients kept in bf16
    bf16_optimizer_states: bool = False  # bf16.bf16_optimizer_states: Adam's moments in bf16 too
    pin_memory: bool = True  # offload_*.pin_memory (DeepSpeed's default since 0.19.5; false before)
    offload_activations: bool = False
    """activation_checkpointing.cpu_checkpointing: the checkpointed layer inputs kept in pinned host memory
    between the forward and the backward (DeepSpeed's CheckpointHiddenStatesOffload, 0.19.8)."""
    moment_bytes: float = 8.0
    """The optimizer's state bytes per parameter besides the fp32 master weights (Adam's m and v: 8; the
    optimizer table pipeline.train.setup.optimizers says each one's)."""
    tiled_mlp: int = 0
    """train.tiled_mlp: each layer's MLP in this many tiles along the sequence, recomputed in the backward (0: off):
    one tile's SwiGLU intermediates alive instead of the sequence's, for one more MLP forward."""
    sequence_parallel: int = 1
    """train.sequence_parallel: ranks that share each sample (DeepSpeed's Ulysses), each holding seq_len / N of
    its tokens' activations; the data-parallel replicas are world / N, so grad_accum counts the micro-steps of a
    world of world / N ranks, and every layer adds an all-to-all of its attention inputs and outputs."""
    zenflow_interval: int = 0
    """zero_optimization.zenflow.update_interval (0: no ZenFlow). ZenFlow updates the top-k gradient columns on
    the GPU at every step and the rest on the CPU every `zenflow_interval` steps, overlapped with the next steps:
    it takes the place of gradient accumulation (grad_accum is 1)."""

    @property
    def fp32_grad_accum(self) -> bool:
        return fp32_grad_accumulation(self.stage, self.grad_accum, self.grad_accum_dtype)

    def features(self) -> frozenset[str]:
        """The DeepSpeed 0.19 offload features this configuration uses (FEATURES' names)."""
        return frozenset(name for name, f in FEATURES.items() if f.used(self))

    def label(self) -> str:
        off = "" if self.offload_optimizer == "none" else f" + {self.offload_optimizer} offload (opt"
        if off:
            off += ", params)" if self.offload_param != "none" else ")"
        ck = " + ckpt" if self.activation_checkpointing else ""
        ck += " (offloaded)" if self.offload_activations else ""
        more = "".join(f.label(self) for f in FEATURES.values() if f.used(self) and f.label(self))
        sp = f" + tiled MLP {self.tiled_mlp}" if self.tiled_mlp > 1 else ""
        sp += f" + sequence parallel {self.sequence_parallel}" if self.sequence_parallel > 1 else ""
        return f"ZeRO-{self.stage}{off}{ck}{more}{sp}, micro {self.micro_batch_size} x GA {self.grad_accum}"


_BF16_MASTER_COST = (
    "changes the numerics: bf16 master weights drop updates below half a bf16 step, measured +0.008 nats at a "
    "continued run's lr 2e-5, none from scratch"
)


@dataclass(frozen=True, slots=True)
class Feature:
    """A DeepSpeed 0.19 offload feature the planner prices: whether a configuration uses it, what it adds to the
    configuration's label, and what it does to the numerics (`exact`: nothing; otherwise chosen only when the
    user opts in, `pipeline plan --opt-in NAME`, and shown beside the choice with its gain and `cost`)."""

    used: Callable[[Layout], bool]
    label: Callable[[Layout], str]
    exact: bool
    cost: str


FEATURES: dict[str, Feature] = {
    "activation-offload": Feature(
        lambda c: c.offload_activations,
        lambda c: "",  # said by " + ckpt (offloaded)"
        exact=True,
        cost="exact: the same numbers, moved to host memory and back",
    ),
    "bf16-master": Feature(
        lambda c: c.bf16_master and not c.bf16_optimizer_states,
        lambda c: " + bf16 master",
        exact=False,
        cost=_BF16_MASTER_COST + " (bench/offload_quality.py)",
    ),
    "bf16-states": Feature(
        lambda c: c.bf16_optimizer_states,
        lambda c: " + bf16 master/states",
        exact=False,
        cost=_BF16_MASTER_COST + "; bf16 moments add nothing to it",
    ),
    "zenflow": Feature(
        lambda c: c.zenflow_interval > 0,
        lambda c: f" + ZenFlow (CPU update every {c.zenflow_interval})",
        exact=False,
        cost="changes the numerics: most gradient columns applied up to update_interval steps late; measured "
        "+1.06 nats on the demo model (bench/offload_quality.py)",
    ),
}
"""Every offload feature the planner prices, one record each: the search, the report, the label and the CLI's
--opt-in choices read this table. A new feature is an entry here and its pricing in memory/timing."""
OPT_IN = frozenset(k for k, f in FEATURES.items() if not f.exact)
ZENFLOW_TOPK = 0.1
"""zenflow.topk_ratio the planner writes (DeepSpeed's default): the share of gradient columns updated on the GPU."""


@dataclass(frozen=True, slots=True)
class Offload:
    """Where a DeepSpeed JSON puts the optimizer states and the parameters."""

    optimizer: OffloadDevice = "none"
    param: OffloadDevice = "none"
    nvme_paths: tuple[str, ...] = ()
    """The `nvme_path` of each part offloaded to NVMe (optimizer first)."""

    @property
    def any(self) -> bool:
        return (self.optimizer, self.param) != ("none", "none")

    @property
    def nvme(self) -> bool:
        return "nvme" in (self.optimizer, self.param)


def offload_devices(ds: dict[str, Any]) -> Offload:
    """The offload devices of a DeepSpeed JSON (`zero_optimization.offload_optimizer/offload_param.device`); absent,
    null or "none" is no offload."""
    zero = ds.get("zero_optimization") or {}

    def device(key: str) -> OffloadDevice:
        d = (zero.get(key) or {}).get("device", "none")
        return d if d in ("cpu", "nvme") else "none"

    keys = ("offload_optimizer", "offload_param")
    paths = tuple(str(zero[k]["nvme_path"]) for k in keys if device(k) == "nvme" and zero[k].get("nvme_path"))
    return Offload(device("offload_optimizer"), device("offload_param"), paths)
