"""Workarounds for DeepSpeed behaviours; each says what it repairs and why. They reach into DeepSpeed internals, so
the resume, shared-memory and op-loading tests exist to catch an upgrade that breaks them."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

DEEPSPEED_NEEDED = (0, 19, 8)
"""The oldest DeepSpeed this code runs on: 0.19.8's activation offload (pipeline.train.engine) and the internals
patched here; pyproject.toml pins the same. An older 0.19 imports fine and fails at the first step."""


def deepspeed_version_problems(installed: str | None = None) -> list[str]:
    """One line naming the version and the fix where the installed DeepSpeed is older than DEEPSPEED_NEEDED."""
    import importlib.metadata as md

    from packaging.version import Version

    version = installed or md.version("deepspeed")
    need = ".".join(map(str, DEEPSPEED_NEEDED))
    if Version(version).release[:3] < DEEPSPEED_NEEDED:
        return [
            f"deepspeed {version} is installed; this pipeline needs {need} or later (activation offload and the "
            f"ZeRO internals it relies on): pip install 'deepspeed>={need},<0.20' on every node"
        ]
    return []


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
    group = next((g for g in basic.param_groups if "betas" in g), None)  # Muon's matrix groups have none
    if group is None:
        return 0
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


def sequence_parallel_loss_factor(stage: int, sequence_parallel: int) -> float:
    """What a rank's loss is multiplied by before its backward under sequence parallelism, so that every ZeRO stage
    applies the update one rank holding the whole sequence would. ZeRO 0-2 divide the gradients they sum over all
    ranks by world / sequence_parallel (the data-parallel replicas), which is right: a group's ranks each hold the
    gradient of their share of the loss. ZeRO-3's reduce-scatter of gradients (DeepSpeed 0.19.8,
    `DeepSpeedZeroOptimizer_Stage3.__avg_scatter_grads`, its default path) divides by the whole world instead,
    which makes every gradient sequence_parallel times too small: measured, the gradient norm of a 2-rank group was
    exactly half of one rank's, and Adam's epsilon turned that into losses 4e-4 apart after 10 steps
    (tests/multiproc/test_sequence_parallel.py). The loss is scaled here to compensate; its other path (reduce_scatter
    off) divides correctly only for buckets that fit, so it is refused with sequence parallelism."""
    return float(sequence_parallel) if sequence_parallel > 1 and stage == 3 else 1.0


class SequenceGroups:
    """DeepSpeed's sequence-parallel groups (`parallel_state_sp`) as `deepspeed.initialize(mpu=...)` takes them,
    but saying that tensor parallelism is 1. `parallel_state_sp` calls its sequence-parallel group the
    model-parallel one, which DeepSpeed 0.19.8 records in every checkpoint as tensor-parallel degree N
    (`checkpoint_parallel_dimensions`) while it writes one model-state file (sequence-parallel ranks hold the same
    weights, as data-parallel ones do); the universal conversion that resumes on another world size then refuses
    the checkpoint ("model-state file count 1 does not match pp_degree=1 * tp_degree=2", measured). Everything
    else is `parallel_state_sp`'s own, and DeepSpeed still recognises it (`initialize_sequence_parallel`)."""

    def __getattr__(self, name: str) -> Any:
        import deepspeed.runtime.sequence_parallel.parallel_state_sp as groups

        return getattr(groups, name)

    @staticmethod
    def get_tensor_model_parallel_world_size() -> int:
        return 1

    @staticmethod
    def get_tensor_model_parallel_rank() -> int:
        return 0


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
    subprocess: 1.1 s of CPU each, on every rank of every launch, for an answer that does not change. The answer
    is kept in the process, and in the op cache (TORCH_EXTENSIONS_DIR/cpuinfo-KEY.json) for the next process, KEY
    naming this CPU's model and flags (/proc/cpuinfo): another CPU asks py-cpuinfo again."""
    import functools
    import hashlib
    import json

    import cpuinfo

    from pipeline.atomic import write_json
    from pipeline.train.runtime.ops import extensions_dir

    if hasattr(cpuinfo.get_cpu_info, "cache_info"):
        return
    ask = cpuinfo.get_cpu_info
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        seen = [line for line in lines if line.startswith(("model name", "flags", "vendor_id"))][:3]
        key = hashlib.sha256("\n".join(seen).encode()).hexdigest()[:16] if seen else None
    except OSError:
        key = None

    @functools.lru_cache(maxsize=1)
    def get_cpu_info() -> dict[str, Any]:
        path = extensions_dir() / f"cpuinfo-{key}.json"
        if key is not None:
            try:
                return dict(json.loads(path.read_text()))
            except (OSError, ValueError):
                pass
        info: dict[str, Any] = ask()
        if key is not None:
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                write_json(path, info)
            except OSError:
                pass  # a read-only cache: asked again next time
        return info

    cpuinfo.get_cpu_info = get_cpu_info
