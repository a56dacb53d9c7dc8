"""What the planner otherwise assumes of a node, measured on it in seconds: host memory bandwidth (what CPU Adam
and every offload copy stream through), pinned host<->device copy rates, DeepSpeed's CPU Adam rate on this
node's cores, and the GPU's bf16 GEMM rate at a model's own shapes. Each function returns plain numbers; the
GPU ones return None without a CUDA device. Used by bench/gpu_bench.py before its cases, so every planned figure
beside a measurement can be given the measured host."""

from __future__ import annotations

import time
from typing import Any


def _best_of(fn: Any, repeats: int, sync: Any = None) -> float:
    """The shortest of `repeats` timed calls (after one warm call), in seconds."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        if sync:
            sync()
        t0 = time.perf_counter()
        fn()
        if sync:
            sync()
        best = min(best, time.perf_counter() - t0)
    return best


def host_memory_bandwidth(size_bytes: int = 2**30, repeats: int = 3) -> dict[str, float]:
    """Bytes per second read plus written by a multi-threaded copy of `size_bytes` of host memory (torch's copy
    uses every intra-op thread, as CPU Adam's OpenMP loop does)."""
    import torch

    n = size_bytes // 4
    a, b = torch.ones(n), torch.empty(n)
    seconds = _best_of(lambda: b.copy_(a), repeats)
    return {
        "bytes": float(size_bytes),
        "threads": float(torch.get_num_threads()),
        "bytes_per_s": 2 * size_bytes / seconds,
    }


def pinned_copy_rates(size_bytes: int = 2**30, repeats: int = 3) -> dict[str, float] | None:
    """Host->device and device->host bytes per second over a pinned host buffer (ZeRO-Offload's path)."""
    import torch

    if not torch.cuda.is_available():
        return None
    host = torch.empty(size_bytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(size_bytes, dtype=torch.uint8, device="cuda")
    sync = torch.cuda.synchronize
    h2d = _best_of(lambda: dev.copy_(host, non_blocking=True), repeats, sync)
    d2h = _best_of(lambda: host.copy_(dev, non_blocking=True), repeats, sync)
    return {"bytes": float(size_bytes), "h2d_bytes_per_s": size_bytes / h2d, "d2h_bytes_per_s": size_bytes / d2h}


def cpu_adam_rate(num_params: int = 2**26, repeats: int = 3) -> dict[str, float]:
    """Parameters per second that DeepSpeed's CPU Adam (the op ZeRO-Offload steps with) updates on this node's
    cores, fp32 parameters, gradients and moments: the term that dominates an offloaded step."""
    import torch
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    p = torch.nn.Parameter(torch.zeros(num_params))
    p.grad = torch.full((num_params,), 1e-3)
    opt = DeepSpeedCPUAdam([p], lr=1e-4, adamw_mode=True)
    seconds = _best_of(opt.step, repeats)
    return {
        "params": float(num_params),
        "threads": float(torch.get_num_threads()),
        "params_per_s": num_params / seconds,
    }


def gemm_rates(hidden: int, ffn: int, tokens: int, repeats: int = 5) -> dict[str, float] | None:
    """bf16 TFLOP/s of a model's own matrix products for `tokens` tokens: the attention projection (h x h) and
    the MLP's (h x ffn), forward shapes."""
    import torch

    if not torch.cuda.is_available():
        return None
    out = {}
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
    for name, cols in (("attention_proj", hidden), ("mlp_up", ffn)):
        w = torch.randn(hidden, cols, device="cuda", dtype=torch.bfloat16)
        seconds = _best_of(lambda w=w: x @ w, repeats, torch.cuda.synchronize)
        out[f"{name}_tflops"] = 2 * tokens * hidden * cols / seconds / 1e12
    return out


def probe_host(smoke: bool = False) -> dict[str, Any]:
    """Every host measurement above, at a size that takes a few seconds (smoke: a fraction of a second)."""
    size = 2**24 if smoke else 2**30
    return {
        "memory": host_memory_bandwidth(size),
        "pinned": pinned_copy_rates(size),
        "cpu_adam": cpu_adam_rate(2**20 if smoke else 2**26),
    }
