"""What the planner otherwise assumes of a node, measured on it in seconds: host memory bandwidth (what CPU Adam
and every offload copy stream through), pinned host<->device copy rates, DeepSpeed's CPU Adam rate on this
node's cores, and the GPU's bf16 GEMM rate at a model's own shapes. Each function returns plain numbers; the
GPU ones return None without a CUDA device.

`pipeline probe` runs them on one node and writes the result beside the hostfile (HOSTFILE.probe.json), where
`pipeline plan` reads it (`measured`): the measured figures replace the node facts they measure, the plan says
which figures were measured and gives them a narrower range. bench/gpu_bench.py runs the same probe before its
cases, so every planned figure beside a measurement is given the measured host."""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pipeline.errors import PipelineError

SUFFIX = ".probe.json"


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


KERNEL_PACKAGES = ("liger-kernel", "flash-attn")
"""The pip packages whose presence on the nodes changes a plan (pipeline.model.kernels, pipeline.model.varlen)."""


def parse_packages(text: str, where: str = "--packages") -> frozenset[str]:
    """A `packages` fact: comma-separated names of KERNEL_PACKAGES, or none."""
    names = {p.strip().lower().replace("_", "-") for p in text.split(",") if p.strip()}
    names.discard("none")
    unknown = sorted(names - set(KERNEL_PACKAGES))
    if unknown:
        raise PipelineError(
            f"{where} {text}: {', '.join(unknown)} is not a kernel package the planner prices; give "
            f"{', '.join(KERNEL_PACKAGES)} (comma-separated) or none"
        )
    return frozenset(names)


def installed_packages() -> list[str]:
    """The kernel packages installed on this node."""
    import importlib.util

    return [p for p in KERNEL_PACKAGES if importlib.util.find_spec(p.replace("-", "_")) is not None]


def probe_node(quick: bool = False, gemm_shape: tuple[int, int, int] | None = None) -> dict[str, Any]:
    """This node measured, with what it ran on: host, time, cores and threads, the GPU (None without CUDA).
    `gemm_shape`: (hidden, ffn, tokens per micro-step) of the model to plan, for the GEMM rate (a GPU only).
    CPU Adam runs in this one process on every thread torch has (OMP_NUM_THREADS, else all cores): the rate of
    a node whose ranks are bound to their share of the cores, as `pipeline pretrain` binds them."""
    import psutil
    import torch

    cuda = torch.cuda.is_available()
    doc: dict[str, Any] = {
        "version": 1,
        "host": socket.gethostname(),
        "when": time.strftime("%Y-%m-%d %H:%M:%S %z"),
        "quick": quick,
        "cpu_cores": psutil.cpu_count(logical=False) or os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "gpu": torch.cuda.get_device_name(0) if cuda else None,
    }
    doc["packages"] = installed_packages()
    doc |= probe_host(quick)
    doc["gemm"] = gemm_rates(*gemm_shape) if gemm_shape and cuda else None
    return doc


def run(
    hostfile: str | None,
    out: str | None,
    gemm_shape: tuple[int, int, int] | None,
    quick: bool,
    slices: dict[str, Any] | None = None,
) -> tuple[dict[str, Any], Path]:
    """`pipeline probe`: this node measured and written where `pipeline plan` reads it; (the probe, its file).
    `gemm_shape`: see probe_node; `slices`: a config's model measured at small depths (pipeline.launch.slices)."""
    path = probe_file(hostfile, out)
    if not path.parent.is_dir():
        raise PipelineError(f"{path}: its folder does not exist; give --out in an existing folder")
    doc = probe_node(quick, gemm_shape) | ({"slices": slices} if slices else {})
    try:
        write_probe(doc, path)
    except OSError as e:
        raise PipelineError(
            f"{path}: cannot write the probe: {e.strerror or e}; give --out somewhere writable"
        ) from None
    return doc, path


def probe_file(hostfile: str | None, out: str | None = None) -> Path:
    """Where a probe is written and read: `out`, else beside the hostfile, else probe.json here."""
    return Path(out) if out else Path(hostfile + SUFFIX) if hostfile else Path("probe.json")


def write_probe(doc: dict[str, Any], path: Path) -> None:
    """Write to a temporary name, then rename: a plan never reads half a probe."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=2) + "\n")
    tmp.replace(path)


def measured(path: Path) -> dict[str, Any]:
    """The figures a probe file measured, in the planner's units: cpu_mem_bw_gbs, cpu_adam_params_per_s (fp32
    Adam, per node), and where a GPU was probed its name, pcie_gbs (the slower direction of pinned copies) and
    gemm_tflops (bf16, the faster of the model's projections); plus where and when it ran (`source`)."""
    try:
        doc = json.loads(path.read_text())
        got: dict[str, Any] = {
            "cpu_mem_bw_gbs": float(doc["memory"]["bytes_per_s"]) / 1e9,
            "cpu_adam_params_per_s": float(doc["cpu_adam"]["params_per_s"]),
            "gpu": doc.get("gpu"),
            "packages": frozenset(doc["packages"]) if isinstance(doc.get("packages"), list) else None,
        }
        pinned, gemm = doc.get("pinned"), doc.get("gemm")
        if pinned:
            got["pcie_gbs"] = min(float(pinned["h2d_bytes_per_s"]), float(pinned["d2h_bytes_per_s"])) / 1e9
        if gemm:
            got["gemm_tflops"] = max(float(v) for v in gemm.values())
        got["source"] = f"pipeline probe on {doc['host']} at {doc['when']} ({path})" + (
            ", a --quick probe" if doc.get("quick") else ""
        )
    except OSError as e:
        raise PipelineError(f"{path}: cannot read the probe ({e.strerror or e})") from None
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise PipelineError(
            f"{path}: not a probe written by `pipeline probe` ({type(e).__name__}: {e}); run it again on one node"
        ) from None
    if not all(v > 0 for k, v in got.items() if k.endswith(("_gbs", "_per_s", "_tflops"))):
        raise PipelineError(f"{path}: a measured rate is not positive; run `pipeline probe` again on one node")
    return got


def report(doc: dict[str, Any], path: Path, say: Callable[[str], None]) -> None:
    """The probe's figures, a line each, for people."""
    say(f"{doc['host']}: {doc['cpu_cores']} cores, torch on {doc['torch_threads']} threads, GPU {doc['gpu']}")
    say(f"  host memory bandwidth  {doc['memory']['bytes_per_s'] / 1e9:8.1f} GB/s (read + write, a copy)")
    say(f"  CPU Adam (DeepSpeed)   {doc['cpu_adam']['params_per_s'] / 1e9:8.3f} e9 fp32 parameters/s")
    if doc["pinned"]:
        h2d, d2h = doc["pinned"]["h2d_bytes_per_s"] / 1e9, doc["pinned"]["d2h_bytes_per_s"] / 1e9
        say(f"  pinned copies          {h2d:8.1f} GB/s to the GPU, {d2h:.1f} back")
    for name, tflops in (doc.get("gemm") or {}).items():
        say(f"  bf16 GEMM {name.removesuffix('_tflops'):<13}{tflops:8.1f} TFLOP/s at the model's shapes")
    if s := doc.get("slices"):
        full = s["full"]
        layers = " and ".join(str(m["layers"]) for m in s["slices"])
        say(
            f"  {Path(s['config']).name} at its {full['layers']} layers, from slices of {layers} on {s['ranks']} "
            f"{s['device']} rank(s): micro-step {full['micro_step_s']:.3f} s, optimizer step "
            f"{full['optimizer_s']:.3f} s, peak {full['peak_gib']:.2f} GiB per rank"
        )
    say(f"wrote {path}: `pipeline plan` uses it for plans with this hostfile (or --probe {path})")


def extrapolate(depths: list[int], values: list[float], to: int) -> float:
    """A figure measured at model slices of `depths` layers, at `to` layers: the least-squares line through them
    (per layer, plus the fixed part: embeddings, output layer, loss, engine buffers), as the bench read the 70B
    slices (7.57 and 7.82 GiB at 2 and 4 layers: 17.3 at 80)."""
    n = len(depths)
    if n < 2 or len(set(depths)) < 2 or len(values) != n:
        raise ValueError("extrapolate needs figures at two or more different depths")
    mx, my = sum(depths) / n, sum(values) / n
    slope = sum((x - mx) * (y - my) for x, y in zip(depths, values, strict=True)) / sum((x - mx) ** 2 for x in depths)
    return my + slope * (to - mx)
