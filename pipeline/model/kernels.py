"""The speed switches of the training model, each a closed set in one table: which SDPA backend serves attention
(`train.attention`), which kernels replace transformers' modules and our chunked loss (`train.kernels`). Every
consumer (the model builder, the config check, the planner, the bench, `--help`) reads these tables; a new
backend or kernel set is one entry here.

GPU-only choices fall back on the CPU (where the project is tested, not where users train) and say what they used
instead: a run never fails because a speed switch cannot apply where it runs.

One job in sections (attention's backend and its timing, the kernel sets, what each costs the planner, FP8,
compile, the tiled MLP): each switch resolved for a device, applied to the process or model, and priced; they
share the fall-back rule and the planner's `Effect`. What keeps documents apart is not a speed switch:
pipeline.model.varlen."""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from pipeline.model import ModelShape

log = logging.getLogger(__name__)


# ---- attention: SDPA backends ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class AttentionBackend:
    name: str
    sdp: str | None
    """torch.nn.attention.SDPBackend member; None: torch's own priority order, untouched."""
    doc: str


ATTENTION: dict[str, AttentionBackend] = {
    b.name: b
    for b in (
        AttentionBackend(
            "auto",
            None,
            "on a CUDA GPU, time every SDPA backend at the model's own shape (forward and backward) once at start, "
            "check each against FlashAttention's output, use the fastest that agrees; elsewhere torch's choice",
        ),
        AttentionBackend("torch", None, "torch's own priority order (what transformers gets without a choice)"),
        AttentionBackend("flash", "FLASH_ATTENTION", "FlashAttention-2 as built into torch"),
        AttentionBackend("cudnn", "CUDNN_ATTENTION", "cuDNN's fused attention (Hopper: the fastest measured)"),
        AttentionBackend("efficient", "EFFICIENT_ATTENTION", "the memory-efficient kernel"),
        AttentionBackend("math", "MATH", "the reference composition of matmuls (slow; for checks)"),
    )
}
GPU_BACKENDS = ("cudnn", "flash", "efficient")
"""The order `auto` tries; also the fallback order after the chosen one."""
AGREE_ATOL = 0.02
"""Largest absolute difference from FlashAttention's output (bf16, unit-variance inputs) that counts as the same
attention: bf16 rounding of such outputs is about 0.004; a wrong kernel is off by the values' scale."""


@dataclass(frozen=True, slots=True)
class AttentionChoice:
    backend: str
    """The entry of ATTENTION used (after fallbacks): torch, flash, cudnn, efficient or math."""
    note: str
    """One line for the run's log: what was asked, what is used and why."""
    timings_ms: dict[str, float | str] | None = None
    """`auto` on a GPU: each backend's forward + backward time, or why it could not run."""


def attention_heads(shape: ModelShape, sequence_parallel: int = 1) -> tuple[int, int]:
    """(query heads, key/value heads) of one rank's attention call: under sequence parallelism Ulysses' all-to-all
    gives each rank the whole sequence for N-th of the query heads, and N-th of the key/value heads (or one of them
    replicated where there are fewer than N)."""
    n = max(1, sequence_parallel)
    return shape.num_heads // n, max(1, shape.num_kv_heads // n)


TIMING_BUDGET_S = 20.0
"""The most `auto` spends timing the backends (the other ranks wait for rank 0's choice): each backend gets its
share, and stops repeating when it is spent. At 128K a single call takes seconds."""


def timed(call: Any, repeats: int, budget_s: float, sync: Any) -> tuple[float, int]:
    """Pure timing: `call` (warmed up already) repeated up to `repeats` times, stopping once `budget_s` is spent
    (at least once); (seconds per call, calls)."""
    sync()
    t0 = time.perf_counter()
    calls = 0
    while calls < repeats and (calls == 0 or time.perf_counter() - t0 < budget_s):
        call()
        calls += 1
        sync()
    return (time.perf_counter() - t0) / calls, calls


def time_backends(
    shape: ModelShape,
    micro_batch_size: int,
    seq_len: int,
    device: Any,
    repeats: int = 5,
    sequence_parallel: int = 1,
    budget_s: float = TIMING_BUDGET_S,
    backends: tuple[str, ...] = GPU_BACKENDS,
) -> dict[str, float | str]:
    """Each backend's causal forward + backward at the shape one rank's attention runs at (seq x heads / N under
    sequence parallelism; grouped-query through enable_gqa, as transformers calls SDPA), in ms, or why it cannot run
    it or disagrees with FlashAttention: the forward's output and the backward's gradients of q, k and v are both
    compared. Within `budget_s` in all."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    heads, kv = attention_heads(shape, sequence_parallel)
    d = shape.head_dim
    g = torch.Generator(device=device).manual_seed(0)

    def draw(h: int) -> Any:
        return torch.randn(micro_batch_size, h, seq_len, d, device=device, dtype=torch.bfloat16, generator=g)

    inputs = (draw(heads), draw(kv), draw(kv))
    grad = draw(heads)
    gqa = kv != heads

    def sync() -> None:
        if getattr(device, "type", str(device)) == "cuda":
            torch.cuda.synchronize(device)

    def step() -> list[Any]:
        q, k, v = (t.detach().requires_grad_() for t in inputs)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        y.backward(grad)
        return [t.detach().float() for t in (y, q.grad, k.grad, v.grad)]

    out: dict[str, float | str] = {}
    reference = None
    names = ("flash", *(n for n in backends if n != "flash")) if "flash" in backends else backends
    for name in names:
        backend = getattr(SDPBackend, str(ATTENTION[name].sdp))
        try:
            with sdpa_kernel(backend):
                got = step()  # the warm-up, and what is compared
                seconds, _ = timed(step, repeats, budget_s / len(names), sync)
        except RuntimeError as e:
            out[name] = f"unavailable: {str(e).splitlines()[0][:100]}"
            continue
        if reference is None:
            reference = got
        else:
            diffs = [(a - b).abs().max().item() for a, b in zip(got, reference, strict=True)]
            if (worst := max(diffs)) > AGREE_ATOL:
                what = ("output", "dq", "dk", "dv")[diffs.index(worst)]
                out[name] = f"disagrees with flash by {worst:.3g} ({what})"
                continue
        out[name] = seconds * 1e3
    return out


def choose_attention(
    setting: str,
    shape: ModelShape,
    micro_batch_size: int,
    seq_len: int,
    device: Any,
    sequence_parallel: int = 1,
) -> AttentionChoice:
    """`train.attention` resolved on this device (see ATTENTION), `auto` timed at one rank's attention shape."""
    cuda = getattr(device, "type", str(device)) == "cuda"
    if setting == "torch":
        return AttentionChoice("torch", "attention: torch's own SDPA choice")
    if not cuda:
        if setting == "auto":
            return AttentionChoice("torch", "attention: torch's SDPA choice (auto measures only on a CUDA GPU)")
        if setting != "math":
            return AttentionChoice(
                "torch", f"attention: {setting} is a CUDA kernel; on {device} torch's own SDPA choice is used instead"
            )
        return AttentionChoice("math", "attention: math")
    if setting != "auto":
        return AttentionChoice(setting, f"attention: {setting} (asked for; others only where it cannot serve a call)")
    timings = time_backends(shape, micro_batch_size, seq_len, device, sequence_parallel=sequence_parallel)
    heads, kv = attention_heads(shape, sequence_parallel)
    at = f"{micro_batch_size} x {seq_len} tokens x {heads}/{kv} heads"
    usable = {n: t for n, t in timings.items() if isinstance(t, float)}
    if not usable:
        return AttentionChoice("torch", f"attention: no backend ran at {at} ({timings}); torch's choice", timings)
    best = min(usable, key=lambda n: usable[n])
    said = ", ".join(f"{n} {t:.2f} ms" if isinstance(t, float) else f"{n} {t}" for n, t in timings.items())
    return AttentionChoice(
        best, f"attention: {best}, the fastest at {at} (forward + backward, both checked: {said})", timings
    )


def apply_attention(choice: AttentionChoice) -> None:
    """Make `choice` the process's SDPA priority (the chosen backend first, the other GPU kernels after it, math
    last), before the model runs or compiles: torch.compile bakes the backend in when it traces, and eager calls
    read the same flags. The backward uses the kernel its forward chose."""
    if choice.backend == "torch":
        return
    from torch.nn.attention import SDPBackend, sdpa_kernel

    order = [choice.backend, *(n for n in GPU_BACKENDS if n != choice.backend), "math"]
    ctx = sdpa_kernel([getattr(SDPBackend, str(ATTENTION[n].sdp)) for n in order], set_priority=True)
    ctx.__enter__()  # for the life of the process: nothing else in a training process sets SDPA flags


# ---- what a speed switch does to time and memory, as measured: the planner prices it from here ----------------


@dataclass(frozen=True, slots=True)
class Effect:
    """A speed switch's effect in the planner's terms (pipeline.plan), each figure measured on a GPU."""

    activations: Literal["hf", "compiled", "liger"]
    """What a decoder layer keeps for the backward under the switch (pipeline.plan.memory.SAVED_PER_H_F, each
    counted on its graph): hf, transformers' modules'; compiled, Inductor's; liger, Liger Kernel's modules'."""
    knee_factor: float
    """The planner's compute efficiency is the card's GEMM ceiling x g / (g + knee), g the time of one (tokens x
    h) x (h x h) GEMM of a micro-step: the knee is what small micro-steps lose to kernel launches and the norms',
    RoPE's, SwiGLU's and residuals' separate memory-bound kernels. A switch that fuses those scales the knee by
    this (1: no change): much of a narrow model's small micro-step, little of a wide one's large one."""
    measured: str
    """Where the figures come from: card, date, cases."""


NO_EFFECT = Effect("hf", 1.0, "transformers' own modules: what the planner's fitted rates were measured with")
COMPILE_EFFECT = Effect(
    "compiled",
    0.6,
    "H200, 2026-12-04 (bench/results/gpu-h200-2026-12-04b.json): the 1b preset at micro 8 x 2048, ZeRO-2, "
    "1b_default (compiled) 0.286 s a step and 37.0 GiB peak against 1b_zero2 (eager) 0.377 s and 46.3 GiB; the "
    "knee's factor fits it and 1b_liger_micro16 (compiled, micro 16: 0.505 s) together, planned 1.08x and 0.91x",
)
"""train.compile: Inductor fuses the decoder layer's elementwise work and saves what the fused kernels save."""


# ---- kernels: what replaces transformers' modules and our chunked loss ----------------------------------------


@dataclass(frozen=True, slots=True)
class KernelSet:
    name: str
    replaces: str
    """What the set puts in place of what (said in the run's log)."""
    package: str | None
    """The pip package it needs (None: only torch)."""
    gpu_only: bool
    families: frozenset[str]
    """transformers model types it patches (empty: every family)."""
    fused_loss: bool
    """Its loss never builds logits (the planner counts no logits chunk; ZeRO-3 keeps the chunked loss)."""
    patch: str | None
    """liger_kernel.transformers function per family is `{patch}_{family}`."""
    effect: Effect
    """What it changes in time and memory, measured (the planner's price)."""


KERNELS: dict[str, KernelSet] = {
    k.name: k
    for k in (
        KernelSet(
            "torch",
            "nothing: transformers' RMSNorm, RoPE and SwiGLU modules and the chunked loss (lm_head and "
            "cross-entropy over 256 MiB of logits at a time, recomputed in the backward)",
            None,
            False,
            frozenset(),
            False,
            None,
            NO_EFFECT,
        ),
        KernelSet(
            "liger",
            "Liger Kernel's Triton RMSNorm, RoPE and SwiGLU in place of transformers' modules, and its fused linear "
            "cross-entropy (lm_head and the loss in one kernel, no logits kept) in place of the chunked loss",
            "liger-kernel",
            True,
            frozenset({"llama", "mistral", "qwen2", "qwen3"}),
            True,
            "apply_liger_kernel_to",
            Effect(
                "liger",
                0.6,
                "H200, 2026-12-04 (bench/results/gpu-h200-2026-12-04{b,c}.json): the 1b preset eager, ZeRO-2, "
                "1b_liger_eager 0.289 s and 36.5 GiB against 1b_zero2 0.377 s and 46.3 GiB; with compile it adds "
                "nothing (1b_liger 0.286 s, 1b_default 0.286 s); the 2-layer 7B offload slice 6.1 against 8.5 GiB; the "
                "knee's factor as compile's (1b_liger_eager planned 1.07x)",
            ),
        ),
    )
}
KERNEL_SETTINGS = ("auto", *KERNELS)
AUTO_WHEN_COMPILED, AUTO_WHEN_EAGER = "torch", "liger"
"""What `kernels: auto` uses on a CUDA GPU, as measured on an H200 (bench/results/gpu-h200-2026-12-04b.json): with
torch.compile the Liger set added nothing (1b ZeRO-2: 57,219 against 57,222 tokens/s; Inductor already fuses the
norms and SwiGLU); without it (ZeRO-3, or compile off) it pays: 1b eager 1.31x the eager baseline, the 7B offload
slice 1.04x at 28% less peak memory. Where liger-kernel is not installed, auto is torch and says so."""


@dataclass(frozen=True, slots=True)
class KernelChoice:
    kernels: str
    fused_loss: bool
    note: str


def _installed(package: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(package.replace("-", "_")) is not None


def choose_kernels(
    setting: str,
    shape: ModelShape,
    device_type: str,
    zero3: bool,
    compiled: bool = False,
    installed: frozenset[str] | None = None,
) -> KernelChoice:
    """`train.kernels` resolved for this model on this device (see KERNELS): the set, whether the fused loss is
    used, and one line saying what replaced what, or what was used instead and why. `compiled`: the decoder
    layers are compiled (auto then keeps transformers' modules, see AUTO_WHEN_COMPILED). `installed`: the pip
    packages installed where it will run (a plan made for a cluster: its nodes' facts); None: those of this
    machine."""

    def missing(package: str | None) -> bool:
        if not package:
            return False
        return package not in installed if installed is not None else not _installed(package)

    if setting == "auto":
        if device_type != "cuda":
            return KernelChoice("torch", False, "kernels: torch (auto uses fused kernels on a CUDA GPU only)")
        name = AUTO_WHEN_COMPILED if compiled else AUTO_WHEN_EAGER
        package = KERNELS[name].package
        if missing(package):
            return KernelChoice(
                "torch",
                False,
                f"kernels: torch (auto would use {name} here, measured faster, but {package} is not installed: "
                f"pip install {package}, or pip install -e '.[gpu]')",
            )
        if KERNELS[name].families and shape.family not in KERNELS[name].families:
            name = "torch"
    else:
        name = setting
    entry = KERNELS[name]
    why = None
    if entry.gpu_only and device_type != "cuda":
        why = f"its kernels are Triton kernels for CUDA GPUs, and this rank runs on {device_type}"
    elif entry.families and shape.family not in entry.families:
        why = f"it has no kernels for the {shape.family} family (it has {', '.join(sorted(entry.families))})"
    elif missing(entry.package):
        why = f"the package {entry.package} is not installed (pip install {entry.package})"
    if why is not None:
        return KernelChoice("torch", False, f"kernels: {name} asked for, but {why}; using transformers' modules")
    fused = entry.fused_loss and not zero3
    note = f"kernels: {name}: {entry.replaces}"
    if entry.fused_loss and zero3:
        note += (
            "; under ZeRO-3 the chunked loss stays (the fused loss reads lm_head's weight directly, which ZeRO-3 "
            "partitions)"
        )
    return KernelChoice(name, fused, note)


@dataclass(frozen=True, slots=True)
class Switches:
    """The speed switches a configuration runs with on a CUDA GPU, as the trainer resolves them, and their
    combined measured effect (what the planner prices)."""

    compiled: bool
    kernels: str
    fused_loss: bool
    effect: Effect


def gpu_switches(
    compile_setting: bool | None,
    kernels_setting: str,
    shape: ModelShape,
    zero_stage: int,
    long_context: bool,
    installed: frozenset[str] | None = None,
) -> Switches:
    """`train.compile` and `train.kernels` resolved on a CUDA GPU for a configuration (its ZeRO stage, whether it
    uses the long-context parts) exactly as choose_compile and choose_kernels resolve them at the start of a run,
    with the kernels' packages `installed` there (the cluster's facts), or as they are on this machine (None:
    `deepspeed_config: auto` on the node that will run). Their effects combine as
    measured: compile and Liger together fuse what either fuses alone (1b_liger = 1b_default), so the larger saving
    of time counts once; of memory, the layout that keeps more (Liger's modules, opaque to Inductor)."""
    compiled, _ = choose_compile(compile_setting, "cuda", zero_stage, long_context)
    choice = choose_kernels(kernels_setting, shape, "cuda", zero_stage == 3, compiled, installed=installed)
    effects = [KERNELS[choice.kernels].effect, *([COMPILE_EFFECT] if compiled else [])]
    used = [e for e in effects if e is not NO_EFFECT]
    effect = (
        Effect(
            "liger" if any(e.activations == "liger" for e in used) else used[0].activations,
            min(e.knee_factor for e in used),
            "; ".join(e.measured for e in used),
        )
        if used
        else NO_EFFECT
    )
    return Switches(compiled, choice.kernels, choice.fused_loss, effect)


def apply_kernels(choice: KernelChoice, shape: ModelShape) -> None:
    """Patch transformers' modules for the chosen set; call before the model is built (the patched classes are
    what its constructor instantiates). The parameter names stay transformers', so checkpoints and exports are
    the same whichever set trained them."""
    entry = KERNELS[choice.kernels]
    if entry.patch is None:
        return
    import importlib

    module = importlib.import_module("liger_kernel.transformers")
    patch = getattr(module, f"{entry.patch}_{shape.family}")
    patch(rope=True, rms_norm=True, swiglu=True, cross_entropy=False, fused_linear_cross_entropy=False)


def fused_linear_cross_entropy() -> Any:
    """Liger's fused lm_head + cross-entropy, summed over the tokens whose label is not -100, fp32 accumulation."""
    import torch
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

    def loss(hidden: Any, weight: Any, labels: Any) -> Any:
        return liger_fused_linear_cross_entropy(
            hidden, weight, labels, ignore_index=-100, reduction="sum", accum_dtype=torch.float32
        )

    return loss


# ---- fp8: the linear layers' matmuls in float8 (torchao) -------------------------------------------------------

FP8_CAPABILITY = (8, 9)
"""FP8 tensor cores: Ada (sm_89: RTX 4090, L40S) and Hopper (sm_90), twice the bf16 rate with fp32 accumulation."""
FP8_MULTIPLE = 16
"""torchao's float8 matmuls (cuBLAS's) need both dimensions of a weight divisible by 16."""
FP8_PUBLISHED = (
    "published end to end on 4 x RTX 4090 (LLMQ benchmarks/4090x4.md, six-step snapshots): 7B 1.51x, 1.5B 1.37x, "
    "0.5B 1.18x over bf16; torchtitan on H100: about +25% at 8B with compile"
)


@dataclass(frozen=True, slots=True)
class Fp8Choice:
    on: bool
    emulate: bool
    """torchao's emulation (float8 rounding in higher precision): where there are no FP8 tensor cores (the CPU,
    where the project is tested); numerically the float8 recipe, no faster."""
    note: str


def fp8_keeps(module: Any, fqn: str) -> bool:
    """Which linear layers get float8 matmuls: the decoder layers' projections whose both dimensions are multiples of
    FP8_MULTIPLE; the output layer (lm_head: its logits feed the loss, and the fused and chunked losses read its
    weight directly) and anything not an nn.Linear (embeddings, norms) stay in the training precision."""
    import torch

    return (
        isinstance(module, torch.nn.Linear)
        and fqn.split(".")[-1] != "lm_head"
        and module.in_features % FP8_MULTIPLE == 0
        and module.out_features % FP8_MULTIPLE == 0
    )


def fp8_layers(shape: ModelShape) -> int:
    """How many linear layers fp8_keeps takes in a model of this shape (q, k, v, o, gate, up, down per layer)."""
    h, f = shape.hidden_size, shape.ffn_hidden_size
    q, kv = shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
    dims = [(h, q), (h, kv), (h, kv), (q, h), (h, f), (h, f), (f, h)]
    return shape.num_layers * sum(1 for a, b in dims if a % FP8_MULTIPLE == 0 and b % FP8_MULTIPLE == 0)


def choose_fp8(setting: bool, device: Any, shape: ModelShape) -> Fp8Choice:
    """`train.fp8` resolved on this device: float8 matmuls on a GPU with FP8 tensor cores, emulated on the CPU (the
    plumbing and the numerics, for tests), off with the reason on an older GPU."""
    if not setting:
        return Fp8Choice(False, False, "fp8: off")
    layers = f"{fp8_layers(shape)} of the decoder's linear layers (embeddings, norms and lm_head stay bf16)"
    if getattr(device, "type", str(device)) != "cuda":
        return Fp8Choice(True, True, f"fp8: {layers} in float8, emulated on {device} (the numerics; speed on a GPU)")
    import torch

    capability = torch.cuda.get_device_capability(device)
    if capability < FP8_CAPABILITY:
        return Fp8Choice(
            False,
            False,
            f"fp8: asked for, but this GPU (sm_{capability[0]}{capability[1]}) has no FP8 tensor cores "
            "(Ada sm_89 or Hopper sm_90 and later); bf16 matmuls instead",
        )
    return Fp8Choice(True, False, f"fp8: {layers} in float8 (torchao, tensorwise scaling)")


def apply_fp8(model: Any, choice: Fp8Choice) -> int:
    """Swap the kept linear layers for torchao's Float8Linear in place (their parameters and names unchanged, so
    checkpoints and exports are the bf16 model's, with or without fp8); returns how many. Before compiling."""
    if not choice.on:
        return 0
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    convert_to_float8_training(model, config=Float8LinearConfig(emulate=choice.emulate), module_filter_fn=fp8_keeps)
    return sum(1 for m in model.modules() if type(m).__name__ == "Float8Linear")  # fp8_layers(shape), tested


# ---- compile ----------------------------------------------------------------------------------------------------


COMPILE_OFF_SWITCHES = ("TORCHDYNAMO_DISABLE", "TORCH_COMPILE_DISABLE")
"""Environment variables with which torch.compile returns the function unchanged (torch._dynamo reads them)."""


def choose_compile(
    setting: bool | None,
    device_type: str,
    zero_stage: int,
    long_context: bool = False,
    environ: Mapping[str, str] | None = None,
) -> tuple[bool, str]:
    """`train.compile` resolved: null (auto) compiles where it was measured to pay, a CUDA GPU with ZeRO 0-2
    (1.21x on the H200's 1b case, 2026-12-04); true/false as asked (true with ZeRO-3 is refused earlier).
    `long_context`: sequence parallelism or the tiled MLP, which have not run compiled on a GPU here. `environ`
    (the process's, at the start of a run): a switch that turns torch.compile off turns it off here too, saying so,
    instead of reporting compiled layers that run eager."""
    switch = next((k for k in COMPILE_OFF_SWITCHES if (environ or {}).get(k) == "1"), None)
    if switch and setting is not False:
        return False, f"compile: off ({switch}=1 in the environment turns torch.compile off; unset it to compile)"
    if setting is not None:
        return setting, f"compile: {'on' if setting else 'off'} (asked for)"
    if device_type != "cuda":
        return False, "compile: off (auto compiles on a CUDA GPU only: the CPU is for tests)"
    if zero_stage == 3:
        return False, "compile: off (auto: ZeRO-3's parameter hooks break the compiled graphs)"
    if long_context:  # Ulysses' all-to-all and the tiled MLP inside a compiled layer: eager until measured
        return False, "compile: off (auto with long-context parts; train.compile: true to try)"
    return True, "compile: on (auto on a GPU with ZeRO 0-2; the first steps are slower while each layer compiles)"


def tile_mlp(model: Any, tiles: int) -> int:
    """Compute every decoder layer's MLP in `tiles` pieces along the sequence, each recomputed in the backward
    (DeepSpeed's TiledMLP): one piece's SwiGLU intermediates are alive at a time. Patches the layers of `model`
    in place (its class and parameter names unchanged; any kernel set's MLP). Returns the layers tiled. Under
    ZeRO-3 the MLP's weights hand their gradients to DeepSpeed only after the last tile (`ds_grad_is_ready`)."""
    if tiles < 2:
        return 0
    import types

    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledMLP

    def untiled(mlp: Any, x: Any) -> Any:
        return type(mlp).forward(mlp, x)

    def tiled(mlp: Any, x: Any) -> Any:
        weights = [p for p in mlp.parameters() if p.requires_grad]
        return TiledMLP.apply(untiled, mlp, x, min(tiles, x.shape[-2]), weights)

    for layer in model.model.layers:
        layer.mlp.forward = types.MethodType(tiled, layer.mlp)
    return len(model.model.layers)
