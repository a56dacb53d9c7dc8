"""The planner's time model: seconds per optimizer step, by part, at rates that were fitted to what the field has
measured (tests/unit/plan/test_timing_published.py holds every published row, bench/plan_calibration.py fits them) and
to our own H200 runs. Pure arithmetic.

Per micro-step the parts run side by side and overlap imperfectly (the largest, plus OVERLAP_RESIDUE of the rest):
  compute         FLOPs (PaLM count, x4/3 with activation checkpointing) at an efficiency that grows with the
                  work per micro-step (`efficiency`), plus the memory traffic of materialised attention scores;
  network         ZeRO's collectives across the node's NIC (a ring carries about one rank's volume per node);
  host copies     collectives between a node's GPUs through host memory when they have no P2P (GeForce), and
                  inter-node traffic staged there without GPUDirect RDMA, all sharing the node's host bandwidth;
  param fetch     ZeRO-3 parameter offload: every gather copies the partitions in from host memory, at a rate per
                  node that DeepSpeed's offload reaches whatever the GPU count (#3901, #6695: "one DIMM's worth");
  grad offload    the gradient partition copied out to the host each micro-step under optimizer offload;
  act offload     activation offload: every checkpointed layer input but the last copied out in the forward and
                  back in the backward, on a side stream (host copies).
Per step: the optimizer (CPU Adam at a node-level rate under offload: the node's cores and memory bandwidth, the
bytes it touches per parameter), ZeRO-0-2's step collectives, a fixed engine overhead. Under ZenFlow a step is one
micro-step whose top-k gradient columns are updated on the GPU; CPU Adam runs every `zenflow_interval` steps in a
process of its own while the GPU goes on (overlap_step), so only what it does not hide is paid, spread over them.

`Rates` says what every figure ran at and where it came from, and carries a run's measured rates (`plan
--from-run`) into the next plan.

One job: the seconds of a step, part by part; the parts share one overlap rule and one set of `Rates`, which is
why they are one module (memory is pipeline.plan.memory's)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace

from pipeline.model import ModelShape
from pipeline.plan.cluster import ZENFLOW_TOPK, Cluster, Layout, Stack

# ---- fitted to published runs (bench/plan_calibration.py) ------------------------------------------------------
EFFICIENCY_KNEE_S = 2.0e-4
"""Compute efficiency = the card's GEMM ceiling x g / (g + KNEE), with g the time one (tokens x h) x (h x h) GEMM of
the micro-step takes at peak: small micro-steps (few tokens, narrow models, fast cards) lose to kernel launches
and memory-bound work. H200 1b at 16k tokens: g 0.14 ms, 34%; a 4090 7B at 32k tokens: g 5 ms, near the ceiling."""
OVERLAP_RESIDUE = 0.35
"""Share of the smaller per-micro-step parts that the largest does not hide."""
OFFLOAD_BW_FRACTION = 0.13
"""ZeRO-3 parameter offload from pinned memory: the node's host-to-GPU fetch rate as a share of its memory
bandwidth (all of its GPUs together, at most their PCIe): DeepSpeed's per-module copies reach "one DIMM's worth"
(#6695). A fetch hides behind compute: DeepSpeed prefetches at least one parameter ahead."""
PAGEABLE_BW_FRACTION = 0.015
"""The same from pageable memory (offload_param.pin_memory false, DeepSpeed's default before 0.19.5): the CPU
copies every byte through a staging buffer (#3901: about 5 GB/s for an 8-GPU node)."""
HOST_COPY_FRACTION = 0.12
"""Collectives through host memory (no P2P, no GPUDirect RDMA): the share of the node's memory bandwidth they get."""
CPU_ADAM_PARAMS_PER_CORE_S = 0.3e9
"""DeepSpeed's CPU Adam per core on arrays that do not fit the caches (memory-bound, not the 0.85e9 of one
thread on cached data)."""
CPU_ADAM_BW_FRACTION = 0.5
"""Share of the node's memory bandwidth CPU Adam's streaming kernel sustains when bound to its cores (published
node rates, with 8 unbound ranks: 0.9-1.8e9 parameters/s)."""
CPU_ADAM_UNBOUND_SLOPE = 0.3
"""Ranks not bound to their cores each start threads on every core: the node's rate / (1 + SLOPE x (ranks - 1)).
DeepSpeed PR #7474 measured 1.3x from binding 2 ranks."""
EAGER_SCORE_BYTES = 56
"""Bytes of memory traffic per attention score per layer and micro-step when scores are materialised (written,
read for the softmax and the product, forward, recompute and backward)."""
STEP_OVERHEAD_S = 0.02
"""Engine bookkeeping per optimizer step (clipping, norms, the scheduler)."""
COLLECTIVE_LATENCY_S = 2e-4
"""The fixed cost of one ZeRO-3 bucket's collective where it crosses sockets or host memory: between nodes, and
between GeForce cards without P2P (NCCL's staged copies)."""
NVLINK_LATENCY_S = 1e-5
"""The same inside one node whose cards talk over NVLink (or PCIe P2P): NCCL's intra-node latency is a few
microseconds (nccl-tests' small-message all-reduce on 8 x H100 NVLink, 10-20 us); published steps of single-node
NVLink runs show no per-bucket term, where 2e-4 made it 23-39% of the planned step with small buckets."""


def collective_latency(c: Cluster) -> float:
    """Seconds of fixed cost per bucket collective on this cluster's slowest hop."""
    direct = c.gpu.nvlink_gbs > 0 or c.gpu.p2p
    return NVLINK_LATENCY_S if c.nodes == 1 and direct else COLLECTIVE_LATENCY_S


RANGE = (0.75, 1.2)
"""The compute, offload and CPU-Adam rates' low and high factors: the printed range (the published figures fall
inside it; its width stays under 2x)."""
MEASURED_SPREAD = 0.4
"""A rate measured on the node by `pipeline probe` ranges over RANGE ** this (0.89-1.08x): what is left is a
training step's contention that a probe alone does not see."""
# Fraction of a NIC's line rate that NCCL reaches: with GPUDirect RDMA ~98% (12.2 GB/s busbw on 100 Gbps, an NCCL
# maintainer); GeForce has none, so traffic is staged through host memory and sockets reach 6-12 GB/s.
NET_EFFICIENCY_RDMA = (0.90, 0.94, 0.98)  # low, point, high
NET_EFFICIENCY_SOCKETS = (0.48, 0.72, 0.96)
ADAM_BYTES = {"fp32": 40, "bf16_master": 32, "bf16_states": 24}
"""Bytes CPU Adam touches per parameter and step: fp32 master, moments and gradient read and written, the
gradient's copy and norm passes, the 16-bit copy back; bf16 master weights and gradients, and bf16 moments, less."""


@dataclass(frozen=True, slots=True)
class Rates:
    """The rates one estimate runs at. None: the model's (fitted) value; a number: given (`--mfu`) or measured by
    a run (`--from-run`), and `sources` says which."""

    efficiency: float | None = None
    """Compute efficiency of the hardware FLOPs (PaLM count plus recompute), fixed (`--mfu`); None: the curve
    `efficiency(...)` times `efficiency_scale`."""
    efficiency_scale: float = 1.0
    """A run's measured efficiency over the curve's at its own micro-step (`--from-run`): carried to other
    micro-batch sizes along the curve."""
    offload_node_gbs: float | None = None
    """Parameter-offload fetch rate per node; None: OFFLOAD_BW_FRACTION of its memory bandwidth."""
    cpu_adam_params_per_s: float | None = None
    """Per node; None: from its cores and memory bandwidth."""
    factor: float = 1.0
    """Scales every rate at once (the range's low and high ends)."""
    sources: tuple[tuple[str, str], ...] = ()
    """(figure, where it came from) for the report."""


def efficiency(shape: ModelShape, tokens_micro: int, c: Cluster, knee_factor: float = 1.0) -> float:
    """`knee_factor`: what the speed switches leave of the knee (pipeline.model.kernels.Effect)."""
    g = 2.0 * tokens_micro * shape.hidden_size**2 / (c.gpu.bf16_tflops * 1e12)
    return c.gpu.gemm_fraction * g / (g + EFFICIENCY_KNEE_S * knee_factor)


def cpu_adam_rate(c: Cluster, cand: Layout, stack: Stack) -> float:
    """Parameters per second CPU Adam updates on one node (all of its ranks together): measured on the node when
    `pipeline probe` ran there (fp32; the 16-bit kinds by the bytes they touch, the kernel being memory-bound),
    else from its cores and memory bandwidth."""
    kind = "bf16_states" if cand.bf16_optimizer_states else "bf16_master" if cand.bf16_master else "fp32"
    if c.cpu_adam_params_per_s:
        rate = c.cpu_adam_params_per_s * ADAM_BYTES["fp32"] / ADAM_BYTES[kind]
    else:
        rate = min(
            c.cpu_cores * CPU_ADAM_PARAMS_PER_CORE_S, c.cpu_mem_bw_gbs * 1e9 * CPU_ADAM_BW_FRACTION / ADAM_BYTES[kind]
        )
    return rate if stack.bind_cores else rate / (1 + CPU_ADAM_UNBOUND_SLOPE * (c.gpus_per_node - 1))


ASSUMED_SPREAD = {
    "cpu_adam": (RANGE[0], 4.4),
    "param_fetch": (RANGE[0], 1.6),
}
"""Host rates the planner derives from assumed facts, and how far real hosts fall from the derivation (low and
high factor on the rate, the printed range's ends; other rates: RANGE). CPU Adam from cores and memory bandwidth:
the lent H200 host (16 cores, 72.9 GB/s measured) ran DeepSpeed's CPU Adam at 4.04e9 parameters/s where the
formula gives 0.91e9 (4.4x; bench/results/gpu-h200-2026-12-04b.json), the published rows sit inside RANGE. The
parameter fetch as OFFLOAD_BW_FRACTION of memory bandwidth: 0.13 fits the hosts of DeepSpeed #6695; the H200
host's 70B slices imply about 0.2 (1.6x). `pipeline probe` measures CPU Adam, and the range narrows to
MEASURED_SPREAD; the fetch share stays assumed."""


def spread(c: Cluster, rates: Rates, fact: str) -> float:
    """The range factor of a rate that rests on node fact `fact`: narrower where `pipeline probe` measured it,
    wider where it is assumed and real hosts spread further (ASSUMED_SPREAD); 1 at the point estimate."""
    f = rates.factor
    if fact in c.measured:
        return f**MEASURED_SPREAD
    lo, hi = ASSUMED_SPREAD.get(fact, RANGE)
    if f == 1.0:
        return 1.0
    return f ** (math.log(hi) / math.log(RANGE[1])) if f > 1 else f ** (math.log(lo) / math.log(RANGE[0]))


def offload_rate(c: Cluster, rates: Rates, pinned: bool = True) -> float:
    """Bytes per second the node's parameter-offload fetches reach, all of its GPUs together."""
    if rates.offload_node_gbs is not None:
        return rates.offload_node_gbs * 1e9
    fraction = OFFLOAD_BW_FRACTION if pinned else PAGEABLE_BW_FRACTION
    return min(c.gpus_per_node * c.gpu.pcie_gbs * 1e9, c.cpu_mem_bw_gbs * 1e9 * fraction)


def net_efficiency(c: Cluster) -> tuple[float, float, float]:
    return NET_EFFICIENCY_RDMA if c.gpu.gpudirect else NET_EFFICIENCY_SOCKETS


def _links(c: Cluster, rates: Rates, net_eff: float) -> tuple[float, float]:
    """Bytes per second of (the node's PCIe to host memory, one GPU's collective bandwidth: inside the node, or
    the network's share when there are several nodes)."""
    gpn, pcie = c.gpus_per_node, c.gpu.pcie_gbs * 1e9
    host_bw = c.cpu_mem_bw_gbs * 1e9 * HOST_COPY_FRACTION * spread(c, rates, "cpu_mem_bw")  # host-staged copies
    node_pcie = min(gpn * pcie, host_bw) if gpn > 1 else pcie
    if gpn == 1:
        intra = math.inf  # no hop inside a node (inter-node staging through the host is in host copies)
    elif c.gpu.nvlink_gbs:
        intra = c.gpu.nvlink_gbs * 1e9
    elif c.gpu.p2p:
        intra = pcie
    else:  # through host memory: each GPU's bytes go out and back in, all of the node's at once
        intra = min(pcie, host_bw / (2 * gpn))
    coll_bw = intra if c.nodes == 1 else min(intra, c.network_gbps / 8 * 1e9 * net_eff)
    return node_pcie, coll_bw


def fp8_pays(stack: Stack, c: Cluster, cand: Layout) -> bool:
    """train.fp8 speeds this configuration: the card has FP8 tensor cores and the stage is one fp8 runs under."""
    return stack.fp8 and c.gpu.fp8 and cand.stage != 3


def _compute(
    shape: ModelShape, seq_len: int, c: Cluster, cand: Layout, stack: Stack, rates: Rates
) -> tuple[float, float]:
    """(seconds of one micro-step's forward and backward at the compute efficiency, that efficiency). Under
    sequence parallelism a rank computes its seq_len / N tokens of each sample, and attention over the whole
    sequence for N-th of the heads: the same FLOPs per token."""
    tokens_micro = cand.micro_batch_size * seq_len // cand.sequence_parallel
    peak = c.gpu.bf16_tflops * 1e12
    eff = (
        rates.efficiency
        if rates.efficiency is not None
        else efficiency(shape, tokens_micro, c, stack.knee_factor) * rates.efficiency_scale
    )
    eff = min(eff * spread(c, rates, "gemm"), 1.0)  # the fast end never above the card's peak
    hw_fpt = shape.flops_per_token(seq_len) * (4 / 3 if cand.activation_checkpointing else 1)
    if cand.tiled_mlp > 1:  # each tile's MLP forward again in the backward: 2 x 3 h f FLOPs a token and layer
        hw_fpt += 6 * shape.hidden_size * shape.ffn_hidden_size * shape.num_layers
    compute = tokens_micro * hw_fpt / (peak * eff)
    if fp8_pays(stack, c, cand):  # the decoder layers' projections at twice the rate, the rest as it was
        linear = 6.0 * shape.layer_params() * shape.num_layers * (4 / 3 if cand.activation_checkpointing else 1)
        compute *= 1 - min(1.0, linear / hw_fpt) / 2
    if stack.attention == "eager":
        scores = cand.micro_batch_size * shape.num_heads * seq_len**2 * shape.num_layers
        compute += scores * EAGER_SCORE_BYTES / (c.gpu.mem_bw_gbs * 1e9)
    return compute, eff


def regathered(shape: ModelShape, max_reuse: float) -> float:
    """Share of a decoder layer's parameters that ZeRO-3 gathers a third time under activation checkpointing.
    The recompute of a layer runs just before its backward; DeepSpeed keeps a gathered module until its next use
    only when the parameters used in between (its reuse distance, `stage3_max_reuse_distance`) are fewer than the
    limit. In between a module's recompute and its own backward come the modules after it in the layer, twice
    (their recompute, then their backward in reverse order): the last projections are kept, the first gathered
    again."""
    h, f = shape.hidden_size, shape.ffn_hidden_size
    q, kv = shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
    modules = [h * q, h * kv, h * kv, q * h, h * f, h * f, h * f]  # in forward order: q, k, v, o, gate, up, down
    again = sum(m for i, m in enumerate(modules) if 2 * sum(modules[i + 1 :]) > max_reuse)
    return again / sum(modules)


def _traffic(shape: ModelShape, seq_len: int, c: Cluster, cand: Layout) -> tuple[float, float, float, float]:
    """Bytes one GPU moves: (ZeRO-3's all-gathers of every parameter per micro-step, collective bytes per
    micro-step, collective bytes once per step, the larger direction of its host copies per micro-step)."""
    psi, g = shape.num_params(), c.world
    share = (g - 1) / g if g > 1 else 0.0
    gathers = 0.0
    if cand.stage == 3:
        gathers = 2.0  # forward and backward all-gather of every parameter
        if cand.activation_checkpointing:  # the recompute gathers a layer; its backward again what was released
            gathers += (
                regathered(shape, cand.max_reuse or cand.max_live) * shape.layer_params() * shape.num_layers / psi
            )
        mlp = shape.mlp_params()
        if cand.tiled_mlp > 1 and (cand.max_reuse or cand.max_live) < mlp:
            # each tile gathers the MLP's matrices again: in the forward, the recompute and TiledMLP's backward
            passes = 3 if cand.activation_checkpointing else 2
            gathers += passes * (cand.tiled_mlp - 1) * mlp * shape.num_layers / psi
    if cand.stage == 3:
        net_micro = (gathers * 2 * psi + 2 * psi) * share
    else:
        net_micro = 2 * psi * share if cand.stage == 2 else 0.0
    net_step = {0: 4 * psi * share, 1: 6 * psi * share, 2: 2 * psi * share, 3: 0.0}[cand.stage]
    # Inter-node traffic without GPUDirect RDMA is staged through host memory: one more copy each way per GPU.
    staged = net_micro / 2 if c.nodes > 1 and not c.gpu.gpudirect else 0.0
    accum = 4 if cand.fp32_grad_accum and not cand.bf16_master else 2  # bytes of a gradient sent to the host
    grad_out = 0.0
    if cand.offload_optimizer != "none":
        grad_out = accum * psi / g * ((1 - ZENFLOW_TOPK) if cand.zenflow_interval else 1.0)
    acts = 0.0
    if cand.offload_activations and cand.activation_checkpointing:  # out in the forward, back in the backward
        tokens_micro = cand.micro_batch_size * seq_len // cand.sequence_parallel
        acts = max(0, shape.num_layers - 1) * 2.0 * tokens_micro * shape.hidden_size
    return gathers, net_micro, net_step, max(staged + acts, grad_out + staged + acts)


def sequence_all_to_all(shape: ModelShape, seq_len: int, c: Cluster, cand: Layout) -> tuple[float, str]:
    """(bytes one GPU sends per micro-step in Ulysses' all-to-alls, the link that carries them). Each layer's
    attention sends q, k, v (h + 2 h_kv per token) out before it and the output (h) back after it, in the forward,
    again in the backward, and a third time when the layer is recomputed; of its tokens' bytes a rank keeps 1 / N.
    A group is consecutive ranks: inside a node while it fits one, else across the NIC."""
    n = cand.sequence_parallel
    if n == 1:
        return 0.0, ""
    passes = 3 if cand.activation_checkpointing else 2
    h_kv = shape.num_kv_heads * shape.head_dim
    per_token = 2 * (2 * shape.num_heads * shape.head_dim + 2 * h_kv)  # bf16 q, k, v out and o back
    tokens = cand.micro_batch_size * seq_len // n
    link = "inside the node" if n <= c.gpus_per_node else "across the NIC"
    return passes * shape.num_layers * tokens * per_token * (n - 1) / n, link


def _optimizer(
    shape: ModelShape, c: Cluster, cand: Layout, stack: Stack, rates: Rates, node_pcie: float, micro_t: float
) -> float:
    """Seconds of the optimizer step: CPU Adam over the node's share (and its copies back, its NVMe traffic;
    ZenFlow's once per interval, behind the interval's micro-steps), or Adam on the GPU."""
    psi, g, gpn = shape.num_params(), c.world, c.gpus_per_node
    if cand.offload_optimizer == "none":
        return (psi / g if cand.stage else psi) * ADAM_BYTES["fp32"] / (c.gpu.mem_bw_gbs * 1e9)
    adam_rate = (rates.cpu_adam_params_per_s or cpu_adam_rate(c, cand, stack)) * spread(c, rates, "cpu_adam")
    opt_t = psi / c.nodes / adam_rate
    if cand.offload_param == "none":  # the updated 16-bit partitions go back to the GPUs
        opt_t += 2 * psi / g * gpn / node_pcie
    if cand.offload_optimizer == "nvme":
        opt_t += 2 * 16 * psi / c.nodes / (c.nvme_gbs * 1e9)
    if cand.zenflow_interval:  # once per interval, behind the interval's micro-steps but for a residue
        hidden = cand.zenflow_interval * micro_t
        opt_t = (max(0.0, opt_t - hidden) + OVERLAP_RESIDUE * min(opt_t, hidden)) / cand.zenflow_interval
    return opt_t


def step_time(
    shape: ModelShape, seq_len: int, c: Cluster, cand: Layout, stack: Stack, rates: Rates, net_eff: float
) -> dict[str, float]:
    """Seconds per optimizer step, by part (see the module's docstring)."""
    psi, g, gpn, f = shape.num_params(), c.world, c.gpus_per_node, rates.factor
    node_pcie, coll_bw = _links(c, rates, net_eff)
    compute, eff = _compute(shape, seq_len, c, cand, stack, rates)
    gathers, net_micro, net_step, host_bytes = _traffic(shape, seq_len, c, cand)
    net_t = net_micro / coll_bw if net_micro else 0.0
    copies_t = gpn * host_bytes / node_pcie if host_bytes else 0.0
    off_par = cand.offload_param != "none"
    fetch_rate = offload_rate(c, rates, cand.pin_memory) * (
        f if rates.offload_node_gbs else spread(c, rates, "param_fetch")
    )
    fetch_t = gathers * 2 * psi / g * gpn / fetch_rate if off_par else 0.0
    parts = [compute, net_t, copies_t, fetch_t]
    n_coll = (3 * psi / cand.reduce_bucket) if cand.stage == 3 and g > 1 else 0.0  # one GPU: no collective
    # Ulysses' all-to-alls sit between a layer's projections and its attention: nothing overlaps them.
    sp_bytes, link = sequence_all_to_all(shape, seq_len, c, cand)
    sp_t = 0.0
    if sp_bytes:
        intra = _links(replace(c, nodes=1), rates, net_eff)[1]  # a node's GPUs: NVLink, P2P or host memory
        nic = c.network_gbps / 8 * 1e9 * net_eff / gpn  # the node's NIC, shared by its GPUs
        sp_t = sp_bytes / (intra if link == "inside the node" else min(intra, nic))
    latency = collective_latency(c)
    micro_t = max(parts) + OVERLAP_RESIDUE * (sum(parts) - max(parts)) + n_coll * latency + sp_t

    opt_t = _optimizer(shape, c, cand, stack, rates, node_pcie, micro_t)
    step_net_t = net_step / coll_bw if net_step else 0.0
    if cand.zenflow_interval:  # the updated partitions are gathered after the CPU update, once per interval
        step_net_t /= cand.zenflow_interval
    total = cand.grad_accum * micro_t + opt_t + step_net_t + STEP_OVERHEAD_S
    return {
        "total": total,
        "compute": cand.grad_accum * compute,
        "efficiency": eff,
        "network": cand.grad_accum * net_t + step_net_t,
        "host_copies": cand.grad_accum * copies_t,
        "param_fetch": cand.grad_accum * fetch_t,
        "optimizer": opt_t,
        "collective_latency": cand.grad_accum * n_coll * latency,
        "sequence_all_to_all": cand.grad_accum * sp_t,
        "overhead": STEP_OVERHEAD_S,
    }


def step_time_range(
    shape: ModelShape, seq_len: int, c: Cluster, cand: Layout, stack: Stack, rates: Rates
) -> tuple[dict[str, float], float, float]:
    """(the point estimate by part, the fast end, the slow end): every rate at RANGE's factors and the network
    over its efficiency range."""
    lo_eff, point_eff, hi_eff = net_efficiency(c)
    point = step_time(shape, seq_len, c, cand, stack, rates, point_eff)
    fast = step_time(shape, seq_len, c, cand, stack, replace(rates, factor=rates.factor * RANGE[1]), hi_eff)
    slow = step_time(shape, seq_len, c, cand, stack, replace(rates, factor=rates.factor * RANGE[0]), lo_eff)
    return point, fast["total"], slow["total"]


def solve(f: Callable[[float], float], target: float, lo: float, hi: float) -> float | None:
    """x in [lo, hi] with f(x) = target for f decreasing in x (a time against a rate), by bisection on log x;
    None when the target lies outside f's values there."""
    if not f(hi) <= target <= f(lo):
        return None
    a, b = math.log(lo), math.log(hi)
    for _ in range(60):
        mid = (a + b) / 2
        a, b = (mid, b) if f(math.exp(mid)) > target else (a, mid)
    return math.exp((a + b) / 2)


@dataclass(frozen=True, slots=True)
class Measured:
    """What a run logged (RUN_DIR/metrics.jsonl): median seconds per optimizer step and of its optimizer step
    (the accumulation boundary's engine.step, CPU Adam under offload; None in runs from before it was logged)."""

    step_s: float
    optimizer_s: float | None
    label: str
    """Where it came from, for the report: "run runs/7b, 40 steps"."""


def rates_from_run(
    shape: ModelShape, seq_len: int, c: Cluster, cand: Layout, stack: Stack, got: Measured
) -> tuple[Rates, list[str]]:
    """The rates that make the model reproduce a run's own step (`plan --from-run`), and notes on what could not
    be measured. CPU Adam from the optimizer step; then the compute efficiency (and, under parameter offload, the
    fetch rate by the same factor: one step time cannot tell them apart) from the rest of the step."""
    notes: list[str] = []
    rates = Rates()
    net = net_efficiency(c)[1]
    stack = stack.resolved(shape, cand)

    def part(r: Rates, key: str) -> float:
        return step_time(shape, seq_len, c, cand, stack, r, net)[key]

    sources: list[tuple[str, str]] = []
    if cand.offload_optimizer != "none" and got.optimizer_s:
        adam = solve(lambda x: part(replace(rates, cpu_adam_params_per_s=x), "optimizer"), got.optimizer_s, 1e6, 1e13)
        if adam is None:
            notes.append(
                f"CPU Adam: the measured optimizer step ({got.optimizer_s:.3g} s) is below what the copies alone "
                "take in the model; the fitted rate is kept"
            )
        else:
            rates = replace(rates, cpu_adam_params_per_s=adam)
            sources.append(("CPU Adam", f"measured: {got.label}, optimizer step {got.optimizer_s:.3g} s"))
    elif cand.offload_optimizer != "none":
        notes.append("CPU Adam: the run logged no optimizer_s (a run from before it was logged); fitted rate kept")
    rest = got.step_s - (got.optimizer_s or part(rates, "optimizer"))
    base = offload_rate(c, rates, cand.pin_memory) / 1e9

    def with_scale(k: float) -> Rates:
        r = replace(rates, efficiency_scale=k)
        return replace(r, offload_node_gbs=base * k) if cand.offload_param != "none" else r

    def micro_time(x: float) -> float:
        return part(with_scale(x), "total") - part(with_scale(x), "optimizer")

    curve = efficiency(shape, cand.micro_batch_size * seq_len, c)
    k = solve(micro_time, rest, 0.01, 1.0 / curve)
    if k is not None and micro_time(k) / micro_time(k * 1.25) < 1.05:
        notes.append(
            f"compute: in the model the run's step is set by its network and host copies, not by compute or "
            f"parameter fetch ({got.step_s:.3g} s); a step time cannot measure the efficiency of such a run. The "
            "fitted curve is kept; a run with larger micro-batches (or one node) measures it"
        )
    elif k is None:
        notes.append(
            f"compute: the measured step ({got.step_s:.3g} s) is outside what any efficiency up to the peak gives "
            "on this cluster in the model (its network or cluster facts differ); the fitted curve is kept"
        )
    else:
        rates = with_scale(k)
        how = f"measured: {got.label}, step {got.step_s:.3g} s; the fitted curve x{k:.2f}"
        sources.append(("compute efficiency", how))
        if cand.offload_param != "none":
            sources.append(("parameter fetch", how + " (one step time cannot tell fetch from compute)"))
    return replace(rates, sources=tuple(sources)), notes
