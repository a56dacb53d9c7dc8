"""Workarounds for DeepSpeed behaviours; each says what it repairs and why. They reach into DeepSpeed internals, so
the resume, shared-memory and op-loading tests exist to catch an upgrade that breaks them."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch


def replay_adam_beta_powers(optimizer: Any, device: torch.device) -> int:
    """Make a resumed run continue bit for bit. DeepSpeed's C++ CPU Adam (FusedAdam on the CPU accelerator,
    DeepSpeedCPUAdam under ZeRO-Offload) keeps beta^t as a running product in a process-wide object; a resumed
    process would restart it from pow(beta, t), which rounds differently in the last bit. Replaying steps 1..t on
    a dummy tensor with lr 0 rebuilds the same product. Returns the steps replayed (0 when not needed)."""
    from deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam
    from deepspeed.ops.adam.fused_adam import multi_tensor_applier

    basic = getattr(optimizer, "optimizer", optimizer)
    steps = max((int(st["step"]) for st in basic.state.values() if isinstance(st, dict) and "step" in st), default=0)
    if steps == 0 or not basic.param_groups:
        return 0
    group = basic.param_groups[0]
    beta1, beta2 = group["betas"]
    dummy = [torch.zeros(8, dtype=torch.float32) for _ in range(4)]  # param, grad, exp_avg, exp_avg_sq
    if isinstance(basic, DeepSpeedCPUAdam):
        for t in range(1, steps + 1):
            basic.ds_opt_adam.adam_update(basic.opt_id, t, 0.0, beta1, beta2, group["eps"], 0.0, True, *dummy)
    elif isinstance(basic, FusedAdam) and device.type == "cpu":
        p, g, m, v = dummy
        for t in range(1, steps + 1):
            multi_tensor_applier(
                basic.multi_tensor_adam,
                basic._dummy_overflow_buf,
                [[g], [p], [m], [v]],
                0.0,
                beta1,
                beta2,
                group["eps"],
                t,
                basic.adam_w_mode,
                1,
                0.0,
            )
    else:
        return 0  # CUDA FusedAdam computes beta^t on every call
    return steps


def release_shm_names(rank: int) -> None:
    """DeepSpeed's CPU shared-memory all-reduce (all ranks on one machine) creates
    /dev/shm/deepspeed_allreduce_buffer_* and never unlinks it: about 66 MB of RAM per rank leaks with every run,
    until /dev/shm fills the machine's memory. Once every rank has mapped every buffer the names can go; the
    mappings live on until the process ends, even when it is killed."""
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if addr and port:
        Path(f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_{addr}_{port}_{rank}").unlink(missing_ok=True)


def memoize_cpu_info() -> None:
    """DeepSpeed's op builder asks py-cpuinfo for the CPU's architecture and SIMD width each time it loads an op
    (the shared-memory comm op, CPU Adam, fused Adam on the CPU), and py-cpuinfo answers by starting a Python
    subprocess: 1.1 s each, measured three times per rank at every launch (about 2.3 s before the first step on
    this 2-core machine, and on GPU nodes for CPU Adam under offload). The CPU does not change within a process."""
    import functools

    import cpuinfo

    if not hasattr(cpuinfo.get_cpu_info, "cache_info"):
        cpuinfo.get_cpu_info = functools.lru_cache(maxsize=1)(cpuinfo.get_cpu_info)
