"""Planner: will a model fit a cluster, how fast will it really train, and the DeepSpeed config that gets there.
Pure arithmetic: no CUDA calls. Every throughput is printed beside its physical ceiling (100% of peak).

Memory: model states follow DeepSpeed's own estimators exactly (`estimate_zero2/3_model_states_mem_needs`);
activations use per-layer counts for this Llama block (bf16, SDPA/flash attention, so no s^2 scores stored);
DeepSpeed buffers come from the bucket sizes. Time: compute at an assumed MFU, ZeRO collectives over the network,
PCIe traffic (GeForce cards have no GPUDirect RDMA, so network bytes cross PCIe too), CPU/NVMe optimizer steps.
Overlap: the largest of compute/network/PCIe per micro-step, plus a quarter of the others (prefetch hides most,
not all). Calibration anchor: Llama-2-70B geometry, 4 layers, seq 4096, ZeRO-3 offload on an H200 at 24 GiB:
2.3 s/step measured; this model says 1.9 s.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from pipeline.model import ModelShape
from pipeline.plan.gpus import GPU

GiB = 2**30
RANK_HOST_OVERHEAD = 6 * GiB        # torch + CUDA libraries + DeepSpeed per rank process, host RAM
CUDA_CONTEXT = int(0.8 * GiB)       # CUDA context, cuBLAS/NCCL workspaces
FRAGMENTATION = 1.10                # allocator slack on top of live tensors
HOST_RAM_LIMIT = 0.80               # refuse plans above 80% of a node's RAM (host OOM kills are silent)
ADAM_BYTES_PER_PARAM = 32           # CPU Adam traffic: read p, g, m, v (16 B fp32), write p, m, v, bf16 copy
OVERLAP_RESIDUE = 0.25
COLLECTIVE_LATENCY_S = 2e-4
# Measured on an H200 capped at 24 GiB (70B geometry): DeepSpeed's defaults (5e8 reduce, 1e9 live) ran out of memory,
# 1e8/1e8/3e8 peaked at 5.8 GiB. Only sizes at or near the measured-safe ones are offered.
BUCKETS_ZERO3 = [(1e8, 1e8, 3e8), (2e8, 2e8, 5e8)]  # reduce, prefetch, max-live


@dataclass(frozen=True, slots=True)
class Cluster:
    nodes: int
    gpus_per_node: int
    gpu: GPU
    cpu_mem_bytes: int
    nvme_bytes: int = 0
    network_gbps: float = 100.0
    nvme_gbs: float = 3.0           # per node, sequential read/write
    cpu_mem_bw_gbs: float = 80.0    # effective host memory bandwidth per node for CPU Adam

    @property
    def world(self) -> int:
        return self.nodes * self.gpus_per_node


@dataclass(frozen=True, slots=True)
class Candidate:
    stage: int
    offload_optimizer: str          # none | cpu | nvme
    offload_param: str              # none | cpu | nvme
    activation_checkpointing: bool
    micro_batch_size: int
    grad_accum: int
    reduce_bucket: float = 5e8
    prefetch_bucket: float = 5e7
    max_live: float = 1e9
    sub_group: float = 1e9

    def label(self) -> str:
        off = "" if self.offload_optimizer == "none" else f" + {self.offload_optimizer} offload (opt"
        if off:
            off += ", params)" if self.offload_param != "none" else ")"
        ck = " + ckpt" if self.activation_checkpointing else ""
        return f"ZeRO-{self.stage}{off}{ck}, micro {self.micro_batch_size} x GA {self.grad_accum}"


@dataclass
class Estimate:
    candidate: Candidate
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


def deepspeed_model_states(stage: int, psi: int, largest_layer: int, gpus_per_node: int, nodes: int,
                           offload_optimizer: bool, offload_param: bool, buffer_factor: float = 1.5) -> tuple[int, int]:
    """(cpu bytes per node, gpu bytes per GPU) for model states, exactly as DeepSpeed's estimators compute them
    (stage 2/3; stages 0/1 by the same accounting), zero.Init assumed."""
    g = nodes * gpus_per_node
    if stage == 3:
        ll = 4 * largest_layer
        if offload_optimizer and offload_param:
            return int(psi * 18 * (1 / nodes) * buffer_factor), int(ll)
        if offload_optimizer:
            return int(psi * 16 * (1 / nodes) * buffer_factor), int(ll + int(2 * psi / g))
        return int(largest_layer * 4 * gpus_per_node * buffer_factor), int(ll + int(18 * psi / g))
    if stage == 2 or (stage == 1 and offload_optimizer):
        if offload_optimizer:
            return int(psi * max(4 * g, 16) * buffer_factor), int(2 * psi)
        return int(psi * 4 * gpus_per_node * buffer_factor), int(2 * psi + int(18 * psi / g))
    if stage == 1:  # 16-bit params and grads whole; fp32 grads, master and Adam moments partitioned
        return int(psi * 4 * gpus_per_node * buffer_factor), int(4 * psi + int(16 * psi / g))
    return int(psi * 4 * gpus_per_node * buffer_factor), int(20 * psi)  # ZeRO-0: everything on every GPU


def _state_split(stage: int, psi: int, g: int, off_opt: bool, off_param: bool) -> dict[str, float]:
    """The same GPU model-state bytes, split into parameters / gradients / optimizer states."""
    if stage == 3:
        return {"params": 0 if off_param else 2 * psi / g, "grads": 0 if off_opt else 6 * psi / g,
                "optimizer": 0 if off_opt else 12 * psi / g}
    if stage == 2:
        return {"params": 2 * psi, "grads": 0 if off_opt else 6 * psi / g, "optimizer": 0 if off_opt else 12 * psi / g}
    if stage == 1:
        return {"params": 2 * psi, "grads": 2 * psi + (0 if off_opt else 4 * psi / g),
                "optimizer": 0 if off_opt else 12 * psi / g}
    return {"params": 2 * psi, "grads": 6 * psi, "optimizer": 12 * psi}


def activation_bytes(shape: ModelShape, seq_len: int, micro: int, checkpointing: bool) -> dict[str, float]:
    """Activation memory of one micro-batch (bf16). Per layer: attention norm in/out, q, k, v, attention output
    (10 s b h + 4 s b h_kv), SwiGLU gate, up, act, product (8 s b f), flash-attention row stats (4 s b a).
    Full recompute keeps each layer's input (2 s b h) plus one layer's activations while it is recomputed.
    Logits: bf16 output, fp32 copy and fp32 log-softmax for the loss (12 s b V)."""
    sb = seq_len * micro
    h_kv = shape.num_kv_heads * shape.head_dim
    per_layer = sb * (10 * shape.hidden_size + 4 * h_kv + 8 * shape.ffn_hidden_size) + 4 * sb * shape.num_heads
    layers = (shape.num_layers * 2 * sb * shape.hidden_size + per_layer) if checkpointing else shape.num_layers * per_layer
    return {"layers": float(layers), "logits": float(12 * sb * shape.vocab_size),
            "embeddings": float(4 * sb * shape.hidden_size)}


def _bandwidths(c: Cluster) -> tuple[float, float]:
    """(collective bandwidth per GPU in bytes/s, PCIe bytes/s per direction)."""
    pcie = c.gpu.pcie_gbs * 1e9
    intra = c.gpu.nvlink_gbs * 1e9 if c.gpu.nvlink_gbs else (pcie / 2 if not c.gpu.p2p else pcie)
    if c.nodes == 1:
        return intra, pcie
    # NCCL reaches ~12.2 GB/s busbw on 100 Gbps (98% of line rate); the NIC is shared by a node's GPUs.
    net = c.network_gbps / 8 * 1e9 * 0.98 / c.gpus_per_node
    return min(net, intra), pcie


def estimate(shape: ModelShape, seq_len: int, c: Cluster, cand: Candidate, mfu_assumed: float = 0.45) -> Estimate:
    psi, g = shape.num_params(), c.world
    off_opt, off_par = cand.offload_optimizer != "none", cand.offload_param != "none"
    _, states_gpu = deepspeed_model_states(cand.stage, psi, shape.largest_layer_params(), c.gpus_per_node, c.nodes,
                                           off_opt, off_par)
    split = _state_split(cand.stage, psi, g, off_opt, off_par)
    act = activation_bytes(shape, seq_len, cand.micro_batch_size, cand.activation_checkpointing)
    if cand.stage == 3:
        buffers = 2 * max(0.0, cand.max_live - shape.largest_layer_params()) + 2 * cand.prefetch_bucket \
            + 2 * 2 * cand.reduce_bucket
        working = 4.0 * shape.largest_layer_params()  # gathered 16-bit params + grads of the largest layer
    else:
        buffers = 4.5 * 2 * cand.reduce_bucket if cand.stage in (1, 2) else 2 * 2.5e7
        working = 0.0
    live = sum(split.values()) + working + buffers + sum(act.values())
    gpu = {**split, "working_layer": working, "ds_buffers": buffers, "activations": act["layers"] + act["embeddings"],
           "logits": act["logits"], "cuda_context": CUDA_CONTEXT,
           "fragmentation": (FRAGMENTATION - 1) * live}
    gpu["total"] = sum(gpu.values())
    gpu["model_states_deepspeed"] = states_gpu

    # Host memory per node: offloaded states (pinned 16-bit params + fp32 grads; pageable fp32 master + Adam).
    host_pinned, host_pageable, nvme = 0.0, 0.0, 0.0
    per_node = psi / c.nodes
    if cand.offload_optimizer == "cpu":
        host_pinned += 4 * per_node
        host_pageable += 12 * per_node
    elif cand.offload_optimizer == "nvme":
        nvme += 16 * per_node
        host_pinned += 4 * cand.sub_group * 4 * c.gpus_per_node
    if cand.offload_param == "cpu":
        host_pinned += 2 * per_node
    elif cand.offload_param == "nvme":
        nvme += 2 * per_node
        host_pinned += 5 * 1e8 * 2 * c.gpus_per_node
    host = {"pinned": host_pinned, "pageable": host_pageable + RANK_HOST_OVERHEAD * c.gpus_per_node}
    host["total"] = host["pinned"] + host["pageable"]

    # Time per optimizer step.
    coll_bw, pcie_bw = _bandwidths(c)
    tokens_micro = cand.micro_batch_size * seq_len
    peak = c.gpu.bf16_tflops * 1e12
    fpt = shape.flops_per_token(seq_len)
    hw_fpt = fpt * (4 / 3 if cand.activation_checkpointing else 1)
    compute = tokens_micro * hw_fpt / (peak * mfu_assumed)
    share = (g - 1) / g if g > 1 else 0.0
    net_micro = (3 * 2 * psi * share) if cand.stage == 3 else (2 * psi * share if cand.stage == 2 else 0.0)
    net_step = {0: 4 * psi * share, 1: 4 * psi * share + 2 * psi * share, 2: 2 * psi * share, 3: 0.0}[cand.stage]
    pcie_micro = (4 * psi if off_par else 0.0) + (0 if c.gpu.p2p and c.nodes == 1 else net_micro * 2 / 3)
    pcie_step = (6 * psi / g if off_opt and not off_par else 0.0) + (net_step if not c.gpu.p2p else 0.0)
    n_coll = (3 * psi / cand.reduce_bucket) if cand.stage == 3 else 0.0
    net_t, pcie_t = net_micro / coll_bw if net_micro else 0.0, pcie_micro / pcie_bw
    parts = [compute, net_t, pcie_t]
    micro_t = max(parts) + OVERLAP_RESIDUE * (sum(parts) - max(parts)) + n_coll * COLLECTIVE_LATENCY_S
    if off_opt:
        opt_t = per_node * ADAM_BYTES_PER_PARAM / (c.cpu_mem_bw_gbs * 1e9)
        if cand.offload_optimizer == "nvme":
            opt_t += 2 * 16 * per_node / (c.nvme_gbs * 1e9)
    else:
        opt_t = (psi / g if cand.stage else psi) * ADAM_BYTES_PER_PARAM / (c.gpu.mem_bw_gbs * 1e9)
    step_comm = (net_step / coll_bw if net_step else 0.0) + pcie_step / pcie_bw
    step_t = cand.grad_accum * micro_t + opt_t + step_comm
    tokens_step = tokens_micro * cand.grad_accum * g
    tps = tokens_step / step_t
    ceiling = g * peak / fpt
    time = {"compute": cand.grad_accum * compute, "network": cand.grad_accum * net_t + (net_step / coll_bw if net_step
                                                                                         else 0.0),
            "pcie": cand.grad_accum * pcie_t + pcie_step / pcie_bw, "optimizer": opt_t,
            "collective_latency": cand.grad_accum * n_coll * COLLECTIVE_LATENCY_S}
    why = []
    limit = c.gpu.memory_gib * GiB
    if gpu["total"] > limit:
        why.append(f"GPU memory {gpu['total'] / GiB:.1f} GiB > {c.gpu.memory_gib:.1f} GiB")
    if host["total"] > HOST_RAM_LIMIT * c.cpu_mem_bytes:
        why.append(f"host RAM {host['total'] / 1e9:.0f} GB per node > 80% of {c.cpu_mem_bytes / 1e9:.0f} GB")
    if nvme > c.nvme_bytes:
        why.append(f"NVMe {nvme / 1e12:.2f} TB per node needed, {c.nvme_bytes / 1e12:.2f} TB given")
    # No clamp to the ceiling: with 0 < MFU <= 1 the compute time alone keeps tokens/s below it, and a figure
    # above it would be a planner bug to see, not to hide.
    return Estimate(cand, gpu, host, nvme, time, step_t, tps, ceiling, tps * fpt / (g * peak), not why, why)


def candidates(c: Cluster, seq_len: int, global_batch_tokens: int, micro_sizes: tuple[int, ...] = (1, 2, 4, 8, 16),
               fixed_micro: int | None = None) -> list[Candidate]:
    out = []
    global_seqs = max(1, round(global_batch_tokens / seq_len))
    offloads = [(0, "none", "none"), (1, "none", "none"), (2, "none", "none"), (2, "cpu", "none"),
                (3, "none", "none"), (3, "cpu", "none"), (3, "cpu", "cpu")]
    if c.nvme_bytes:
        offloads += [(3, "nvme", "cpu"), (3, "nvme", "nvme")]
    for stage, oo, op in offloads:
        for ckpt in (False, True):
            for micro in ((fixed_micro,) if fixed_micro else micro_sizes):
                per = micro * c.world
                ga = max(1, round(global_seqs / per))
                buckets = BUCKETS_ZERO3 if stage == 3 else [(5e8, 5e7, 1e9)]
                for rb, pb, ml in buckets:
                    sub = 1e8 if oo != "none" else 1e9
                    out.append(Candidate(stage, oo, op, ckpt, micro, ga, rb, pb, ml, sub))
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
    mfu_assumed: float = 0.45

    def to_dict(self) -> dict[str, Any]:
        def est(e: Estimate) -> dict[str, Any]:
            return {"config": asdict(e.candidate), "label": e.candidate.label(), "gpu_bytes": e.gpu,
                    "host_bytes_per_node": e.host, "nvme_bytes_per_node": e.nvme_bytes, "time_s": e.time,
                    "step_time_s": e.step_time_s, "tokens_per_s": e.tokens_per_s,
                    "ceiling_tokens_per_s": e.ceiling_tokens_per_s, "mfu": e.mfu, "fits": e.fits, "why_not": e.why_not}
        return {"model": self.shape.as_dict(), "params": self.shape.num_params(), "seq_len": self.seq_len,
                "cluster": {**asdict(self.cluster), "gpu": asdict(self.cluster.gpu)},
                "best": est(self.best) if self.best else None, "runners_up": [est(e) for e in self.ranked[1:6]],
                "advice": self.advice, "mfu_assumed": self.mfu_assumed}


def search(shape: ModelShape, seq_len: int, c: Cluster, global_batch_tokens: int = 4 * 2**20,
           mfu_assumed: float = 0.45, fixed_micro: int | None = None) -> Plan:
    ests = [estimate(shape, seq_len, c, cand, mfu_assumed)
            for cand in candidates(c, seq_len, global_batch_tokens, fixed_micro=fixed_micro)]
    fitting = sorted((e for e in ests if e.fits), key=lambda e: (-e.tokens_per_s, e.gpu["total"]))
    rejected = sorted((e for e in ests if not e.fits), key=lambda e: -e.tokens_per_s)
    advice = [] if fitting else _advice(shape, seq_len, c, global_batch_tokens, mfu_assumed)
    return Plan(shape, seq_len, c, fitting[0] if fitting else None, fitting, rejected, advice, mfu_assumed)


def _advice(shape: ModelShape, seq_len: int, c: Cluster, gbt: int, mfu: float) -> list[str]:
    tips = []
    psi = shape.num_params()
    need = (18 * psi * 1.0 + RANK_HOST_OVERHEAD * c.world) / (HOST_RAM_LIMIT * c.cpu_mem_bytes)
    if need > c.nodes:
        tips.append(f"fp32 master weights, gradients and Adam moments alone are {16 * psi / 1e9:,.0f} GB; with CPU offload they need about "
                    f"{math.ceil(need)} nodes of {c.cpu_mem_bytes / 1e9:.0f} GB RAM (you have {c.nodes})")
    if not c.nvme_bytes:
        nv = replace(c, nvme_bytes=10**15)
        if search(shape, seq_len, nv, gbt, mfu).best is not None:
            tips.append(f"NVMe offload (ZeRO-Infinity) would fit: about {18 * psi / c.nodes / 1e12:.1f} TB of NVMe "
                        "per node (--nvme SIZE)")
    from pipeline.model import PRESETS

    for name, s in sorted(PRESETS.items(), key=lambda kv: -kv[1].num_params()):
        s = replace(s, vocab_size=shape.vocab_size)
        if s.num_params() < psi and search(s, seq_len, c, gbt, mfu).best is not None:
            tips.append(f"the largest preset that fits this cluster is {name} ({s.num_params() / 1e9:.1f}B)")
            break
    return tips or ["no configuration fits; try more nodes or GPUs with more memory"]


def ds_config(e: Estimate, nvme_path: str = "/local_nvme") -> dict[str, Any]:
    """A DeepSpeed JSON for the chosen configuration; batch and precision fields stay "auto" for pretrain."""
    cand = e.candidate
    zero: dict[str, Any] = {"stage": cand.stage, "overlap_comm": True, "contiguous_gradients": True,
                            "reduce_bucket_size": cand.reduce_bucket}
    if cand.stage == 3:
        zero.update({"stage3_prefetch_bucket_size": cand.prefetch_bucket, "stage3_max_live_parameters": cand.max_live,
                     "stage3_max_reuse_distance": cand.max_live, "stage3_param_persistence_threshold": 1e5,
                     "sub_group_size": cand.sub_group, "stage3_gather_16bit_weights_on_model_save": False})
    for key, dev in (("offload_optimizer", cand.offload_optimizer), ("offload_param", cand.offload_param)):
        if dev != "none":
            zero[key] = {"device": dev, "pin_memory": True}
            if dev == "nvme":
                zero[key]["nvme_path"] = nvme_path
    ds: dict[str, Any] = {
        "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto", "bf16": {"enabled": "auto"}, "fp16": {"enabled": "auto", "loss_scale": 0},
        "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                                  "weight_decay": "auto"}},
        "zero_optimization": zero, "steps_per_print": 10**9}
    if "nvme" in (cand.offload_optimizer, cand.offload_param):
        ds["aio"] = {"block_size": 1048576, "queue_depth": 8, "thread_count": 1, "single_submit": False,
                     "overlap_events": True}
    return ds

