"""One configuration priced: its GPU memory, host RAM and NVMe, its step time (a point and a low-high range) and
throughput beside the physical ceiling, whether it fits and why not, and the rates it assumed with where each came
from. The search over configurations is pipeline.plan.search; the formulas are pipeline.plan.memory and
pipeline.plan.timing."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Any

from pipeline.model import ModelShape
from pipeline.model.kernels import FP8_PUBLISHED
from pipeline.plan.cluster import (
    Cluster,
    Layout,
    Stack,
)
from pipeline.plan.memory import GiB, checkpoint_bytes, gpu_memory, host_memory
from pipeline.plan.timing import Rates, cpu_adam_rate, fp8_pays, offload_rate, step_time_range

HOST_RAM_LIMIT = 0.80  # refuse plans above 80% of a node's RAM (host OOM kills are silent)


@dataclass
class Estimate:
    layout: Layout
    gpu: dict[str, float]
    host: dict[str, float]
    nvme_bytes: float
    time: dict[str, float]
    step_time_s: float
    tokens_per_s: float
    ceiling_tokens_per_s: float
    mfu: float
    fits: bool
    why_not: list[str] = field(default_factory=list)
    step_time_range_s: tuple[float, float] = (0.0, 0.0)
    tokens_per_s_range: tuple[float, float] = (0.0, 0.0)
    warnings: list[str] = field(default_factory=list)
    checkpoint: dict[str, float] = field(default_factory=dict)
    assumed: list[tuple[str, str, str]] = field(default_factory=list)
    """(figure, value, where it came from): the rates the time ran at."""


def _limits(
    gpu: dict[str, float],
    host: dict[str, float],
    nvme: float,
    ckpt: dict[str, float],
    c: Cluster,
    cand: Layout,
    keep_last: int,
) -> tuple[list[str], list[str]]:
    """(why the configuration does not fit: GPU memory, host RAM, NVMe, the checkpoint disk; what to know although
    it fits: a disk that holds one checkpoint but not a safe save, an NVMe optimizer that cannot resume)."""
    why: list[str] = []
    warnings: list[str] = []
    limit = c.gpu.memory_gib * GiB
    if gpu["reserved"] + gpu["margin"] > limit:
        why.append(
            f"GPU memory {gpu['reserved'] / GiB:.1f} GiB + {gpu['margin'] / GiB:.1f} GiB margin > "
            f"{c.gpu.memory_gib:.1f} GiB"
        )
    if host["total"] > HOST_RAM_LIMIT * c.cpu_mem_bytes:
        why.append(f"host RAM {host['total'] / 1e9:.0f} GB per node > 80% of {c.cpu_mem_bytes / 1e9:.0f} GB")
    if nvme > c.nvme_bytes:
        why.append(f"NVMe {nvme / 1e12:.2f} TB per node needed, {c.nvme_bytes / 1e12:.2f} TB given")
    if c.disk_bytes:
        safe = (keep_last + 1) * ckpt["per_node"]
        ways_out = "put run_dir on a larger disk or a shared mount, train a smaller model, or spread it over more nodes"
        if ckpt["per_node"] > c.disk_bytes:
            why.append(
                f"checkpoint {ckpt['per_node'] / 1e9:.0f} GB per node (model and optimizer shards) > disk "
                f"{c.disk_bytes / 1e9:.0f} GB: no checkpoint can be saved; {ways_out}"
            )
        elif safe > c.disk_bytes:
            warnings.append(
                f"checkpoint disk: a safe save keeps {keep_last} checkpoint(s) while writing the next: "
                f"{safe / 1e9:.0f} GB per node > disk {c.disk_bytes / 1e9:.0f} GB; the first save that "
                f"does not fit fails the run; {ways_out}"
            )
    if cand.offload_optimizer == "nvme":
        warnings.append(
            "NVMe optimizer offload: DeepSpeed 0.19 resumes such checkpoints with fresh weights, so `pipeline "
            "pretrain` refuses to resume them; this run cannot continue after a stop or a crash (plan more host "
            "RAM or nodes for CPU offload if it must)"
        )
    return why, warnings


def estimate(
    shape: ModelShape,
    seq_len: int,
    c: Cluster,
    cand: Layout,
    mfu_assumed: float | None = None,
    loss_chunk_tokens: int | None = None,
    keep_last: int = 1,
    stack: Stack | None = None,
    rates: Rates | None = None,
) -> Estimate:
    """One configuration: memory, time (point and range), fit. `mfu_assumed`: a fixed compute efficiency instead
    of the fitted curve. `loss_chunk_tokens`: the trainer's chunked loss (pipeline.model.loss_chunk_tokens); None
    models a plain loss over full logits. `keep_last`: checkpoints kept (checkpoint.keep_last); a safe save writes
    one more before the oldest goes. `stack`: the training software (default: this trainer). `rates`: measured
    ones (`plan --from-run`)."""
    stack = (stack or Stack()).resolved(shape, cand)
    rates = rates or Rates()
    if mfu_assumed is not None:
        rates = replace(rates, efficiency=mfu_assumed, sources=(*rates.sources, ("compute efficiency", "given: --mfu")))
    gpu = gpu_memory(shape, seq_len, c, cand, loss_chunk_tokens, stack)
    host = host_memory(shape, c, cand, seq_len)
    psi = shape.num_params()
    nvme = 0.0
    if cand.offload_optimizer == "nvme":
        nvme += 16 * psi / c.nodes
    if cand.offload_param == "nvme":
        nvme += 2 * psi / c.nodes
    t, fast, slow = step_time_range(shape, seq_len, c, cand, stack, rates)
    g = c.world
    tokens_step = cand.micro_batch_size * seq_len * cand.grad_accum * g // cand.sequence_parallel
    fpt = shape.flops_per_token(seq_len)
    peak = c.gpu.bf16_tflops * 1e12
    tps = tokens_step / t["total"]
    ckpt = checkpoint_bytes(shape, cand.stage, c.world, c.gpus_per_node, state_bytes=4 + cand.moment_bytes)
    why, warnings = _limits(gpu, host, nvme, ckpt, c, cand, keep_last)
    # No clamp to the ceiling: with 0 < MFU <= 1 the compute time alone keeps tokens/s below it, and a figure
    # above it would be a planner bug to see, not to hide.
    return Estimate(
        cand,
        gpu,
        host,
        nvme,
        {k: v for k, v in t.items() if k != "total"},
        t["total"],
        tps,
        g * peak / fpt,
        tps * fpt / (g * peak),
        not why,
        why,
        step_time_range_s=(fast, slow),
        tokens_per_s_range=(tokens_step / slow, tokens_step / fast),
        warnings=warnings,
        checkpoint=ckpt,
        assumed=assumptions(shape, seq_len, c, cand, stack, rates, t["efficiency"]),
    )


FITTED = "fitted to published runs (tests/unit/plan/test_timing_published.py)"
PROBED = "measured on a node by `pipeline probe`"


def assumptions(
    shape: ModelShape, seq_len: int, c: Cluster, cand: Layout, stack: Stack, rates: Rates, eff: float
) -> list[tuple[str, str, str]]:
    """What an estimate assumed, each with its source: given (--mfu), measured (--from-run) or fitted."""
    given = dict(rates.sources)
    tokens = cand.micro_batch_size * seq_len // cand.sequence_parallel
    out = [
        (
            "compute efficiency",
            f"{eff:.0%} of peak",
            given.get("compute efficiency")
            or f"{PROBED if 'gemm' in c.measured else FITTED}: {c.gpu.name}'s GEMM ceiling {c.gpu.gemm_fraction:.0%}"
            f", {tokens:,} tokens per micro-step",
        )
    ]
    if fp8_pays(stack, c, cand):
        out.append(("fp8", "the decoder's matmuls at twice the bf16 rate", f"planned, not measured; {FP8_PUBLISHED}"))
    if stack.switches is not None and stack.switches.effect.knee_factor != 1.0:
        out.append(("speed switches", stack.label(), f"measured: {stack.switches.effect.measured}"))
    if cand.offload_param != "none":
        out.append(
            (
                "parameter fetch",
                f"{offload_rate(c, rates, cand.pin_memory) / 1e9:.3g} GB/s per node"
                + ("" if cand.pin_memory else " (pageable: pin_memory false)"),
                given.get("parameter fetch")
                or f"{FITTED}: a share of {c.cpu_mem_bw_gbs:.3g} GB/s host memory bandwidth"
                + (f" ({PROBED})" if "cpu_mem_bw" in c.measured else ""),
            )
        )
    if cand.offload_optimizer != "none":
        rate = rates.cpu_adam_params_per_s or cpu_adam_rate(c, cand, stack)
        how = "bound to cores" if stack.bind_cores else "ranks not bound to cores"
        out.append(
            (
                "CPU Adam",
                f"{rate / 1e9:.2g}e9 parameters/s per node",
                given.get("CPU Adam")
                or (f"{PROBED}, {how}" if "cpu_adam" in c.measured else None)
                or f"{FITTED}: {c.cpu_cores} cores, {c.cpu_mem_bw_gbs:g} GB/s memory, {how}",
            )
        )
    return out


MFU_CONVENTION = "PaLM: 6N + 12*L*h*s FLOPs per token (as TinyLlama and torchtitan count)"


def estimate_dict(e: Estimate) -> dict[str, Any]:
    return {
        "config": asdict(e.layout),
        "label": e.layout.label(),
        "gpu_bytes": e.gpu,
        "peak_allocated": e.gpu["peak_allocated"],
        "reserved": e.gpu["reserved"],
        "margin": e.gpu["margin"],
        "host_bytes_per_node": e.host,
        "nvme_bytes_per_node": e.nvme_bytes,
        "time_s": e.time,
        "step_time_s": e.step_time_s,
        "step_time_range_s": list(e.step_time_range_s),
        "tokens_per_s": e.tokens_per_s,
        "tokens_per_s_range": list(e.tokens_per_s_range),
        "ceiling_tokens_per_s": e.ceiling_tokens_per_s,
        "mfu": e.mfu,
        "fits": e.fits,
        "why_not": e.why_not,
        "warnings": e.warnings,
        "checkpoint_bytes": e.checkpoint,
        "assumed": [{"figure": f, "value": v, "source": src} for f, v, src in e.assumed],
    }
