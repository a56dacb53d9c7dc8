"""pipeline.plan.memory's activation terms, each counted on the graph it prices: what one bf16 decoder layer saves
for its backward (saved-tensor hooks) under transformers' modules, torch.compile and Liger Kernel's autograd
contract, and what its backward holds at its peak beyond that (every tensor's storage tracked by a dispatch mode
until it is freed). Each planner term is within 10% of the count, and never under it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from pipeline.model import ModelShape, llama_config
from pipeline.plan.cluster import Stack
from pipeline.plan.memory import (
    ATTENTION_BACKWARD_PER_H,
    layer_activation_bytes_per_token,
    layer_backward_bytes_per_token,
)

SHAPES = [
    ModelShape(hidden_size=256, num_layers=1, ffn_hidden_size=688, num_heads=4, num_kv_heads=2, vocab_size=500),
    ModelShape(hidden_size=512, num_layers=1, ffn_hidden_size=1376, num_heads=8, num_kv_heads=8, vocab_size=500),
    ModelShape(hidden_size=384, num_layers=1, ffn_hidden_size=1536, num_heads=6, num_kv_heads=2, vocab_size=500),
]
SEQ = 128


class _LayerRun:
    """One bf16 LlamaDecoderLayer of `shape` with its input, position ids and RoPE tables; `storages` are those a
    count leaves out (the parameters, the input, the tables: shared by all layers or priced elsewhere)."""

    def __init__(self, shape: ModelShape, seq: int = SEQ) -> None:
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

        torch.manual_seed(0)
        cfg = llama_config(shape)
        self.layer = LlamaDecoderLayer(cfg, 0).to(torch.bfloat16)
        self.x = torch.randn(1, seq, shape.hidden_size, dtype=torch.bfloat16, requires_grad=True)
        self.pos = torch.arange(seq)[None]
        self.rope = tuple(t.to(torch.bfloat16) for t in LlamaRotaryEmbedding(cfg)(self.x, self.pos))
        self.storages = {t.untyped_storage().data_ptr() for t in (self.x, *self.rope, *self.layer.parameters())}

    def __call__(self, layer: Callable[..., Any] | None = None) -> torch.Tensor:
        run = self.layer if layer is None else layer
        return run(self.x, attention_mask=None, position_ids=self.pos, position_embeddings=self.rope)


def saved_bytes_per_token(run: _LayerRun, layer: Callable[..., Any] | None = None) -> float:
    """Bytes the layer saves for its backward per token (distinct storages, those of `run.storages` left out)."""
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in run.storages:
            seen[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run(layer)
    return sum(seen.values()) / run.x.shape[1]


class _Live(TorchDispatchMode):
    """The peak of the bytes alive in tensors made inside it (each storage counted until it is freed), but those
    of `skip`."""

    def __init__(self, skip: set[int]) -> None:
        super().__init__()
        self.skip, self.live, self.peak = skip, {}, 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and (ptr := t.untyped_storage().data_ptr()) not in self.skip:
                self.live[ptr] = (StorageWeakRef(t.untyped_storage()), t.untyped_storage().nbytes())
        self.live = {k: v for k, v in self.live.items() if not v[0].expired()}
        self.peak = max(self.peak, sum(n for _, n in self.live.values()))
        return out


def live_peak_per_token(run: _LayerRun, layer: Callable[..., Any] | None = None) -> float:
    """The live peak of one layer's forward and backward per token, its parameters frozen (their gradients are the
    engine's, priced with the model states) and the gradient it receives made before."""
    for p in run.layer.parameters():
        p.requires_grad_(False)
    grad = torch.randn_like(run.x)
    mode = _Live(run.storages | {grad.untyped_storage().data_ptr()})
    with mode:
        run(layer).backward(grad)
    return mode.peak / run.x.shape[1]


ROWS = 16
"""The stand-ins below work this many tokens at a time, as Liger's Triton kernels work a row in registers: their
temporaries are not what is counted."""


class _LigerNorm(torch.autograd.Function):
    """Liger Kernel 0.8.5's RMSNorm contract (liger_kernel/ops/rms_norm.py:676, 555): the output computed in fp32,
    `save_for_backward(X, RSTD)` (the bf16 input and fp32 1/rms per row); the backward writes dX over dY (in_place,
    the default)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        rstd = torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, rstd)
        ctx.weight = weight
        return (x.float() * rstd).to(x.dtype) * weight

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        x, rstd = ctx.saved_tensors
        flat_x, flat_g, flat_r = x.view(-1, x.shape[-1]), grad.view(-1, x.shape[-1]), rstd.view(-1, 1)
        for i in range(0, flat_x.shape[0], ROWS):
            xs, r = flat_x[i : i + ROWS].float(), flat_r[i : i + ROWS]
            gw = flat_g[i : i + ROWS].float() * ctx.weight.float()
            dx = r * (gw - xs * r * r * (gw * xs).mean(-1, keepdim=True))
            flat_g[i : i + ROWS] = dx.to(grad.dtype)
        return grad, None, None


class _LigerSiLUMul(torch.autograd.Function):
    """Liger Kernel 0.8.5's SwiGLU contract (liger_kernel/ops/swiglu.py:272, 155): silu(a) * b in one kernel,
    `save_for_backward(a, b)`; the backward writes da and db over a and b."""

    @staticmethod
    def forward(ctx: Any, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(a, b)
        return torch.nn.functional.silu(a) * b

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        a, b = ctx.saved_tensors
        fa, fb, fg = (t.view(-1, t.shape[-1]) for t in (a, b, grad))
        for i in range(0, fa.shape[0], ROWS):
            ra, rb, rg = fa[i : i + ROWS].float(), fb[i : i + ROWS].float(), fg[i : i + ROWS].float()
            sig = torch.sigmoid(ra)
            silu = ra * sig
            fb[i : i + ROWS] = (rg * silu).to(b.dtype)
            fa[i : i + ROWS] = (rg * (silu * (1 - sig) + sig) * rb).to(a.dtype)
        return a, b


def as_liger(layer: Any) -> Any:
    """The layer's norms and MLP as Liger's modules run them (LigerRMSNorm, and LigerSwiGLUMLP's
    down_proj(LigerSiLUMulFunction(gate_proj(x), up_proj(x))): liger_kernel/transformers/swiglu.py:35)."""
    for norm in (layer.input_layernorm, layer.post_attention_layernorm):
        norm.forward = lambda x, n=norm: _LigerNorm.apply(x, n.weight, n.variance_epsilon)
    mlp = layer.mlp
    mlp.forward = lambda x: mlp.down_proj(_LigerSiLUMul.apply(mlp.gate_proj(x), mlp.up_proj(x)))
    return layer


def _within(term: float, counted: float) -> None:
    assert counted <= term <= 1.10 * counted, f"planner {term:.0f} B/token against {counted:.0f} counted"


@pytest.mark.parametrize("shape", SHAPES)
def test_transformers_layer_saves_what_the_hf_layout_prices(shape: ModelShape) -> None:
    term = layer_activation_bytes_per_token(shape, Stack(kernels="hf"))
    assert term == pytest.approx(saved_bytes_per_token(_LayerRun(shape)), rel=0.02)


@pytest.mark.parametrize("shape", SHAPES)
def test_ligers_modules_save_what_the_liger_layout_prices(shape: ModelShape) -> None:
    run = _LayerRun(shape)
    _within(
        layer_activation_bytes_per_token(shape, Stack(kernels="liger")), saved_bytes_per_token(run, as_liger(run.layer))
    )


def test_the_compiled_layer_saves_what_the_compiled_layout_prices() -> None:
    """Inductor on the CPU partitions the layer as on a GPU (its min-cut recomputes the norms and the SwiGLU's
    product from what it keeps): 10 h + 4 h_kv + 6 f + 4 a + two fp32 1/rms a token."""
    shape = SHAPES[0]
    run = _LayerRun(shape)
    compiled = torch.compile(run.layer)
    saved_bytes_per_token(run, compiled)  # compiles
    _within(layer_activation_bytes_per_token(shape, Stack(kernels="compiled")), saved_bytes_per_token(run, compiled))


@pytest.mark.parametrize("shape", SHAPES)
def test_a_layers_backward_holds_what_its_working_set_prices(shape: ModelShape) -> None:
    """The live peak of a layer's forward and backward: what it saved, then its MLP's gradients while the saved
    tensors are freed. The GPU's flash backward adds an fp32 dq accumulator the CPU's SDPA has none of."""
    run = _LayerRun(shape)
    term = layer_activation_bytes_per_token(shape) + layer_backward_bytes_per_token(shape)
    _within(term - ATTENTION_BACKWARD_PER_H * shape.hidden_size, live_peak_per_token(run))
