"""What a decoder layer holds under Ulysses sequence parallelism, counted on 2 gloo ranks on the graph the planner
prices (pipeline.plan.memory: the layer's saved tensors, its backward's working set and ULYSSES_COPY_PER_H): each
rank runs one bf16 layer over its half of the tokens through DeepSpeed's UlyssesSPAttentionHF, whose all-to-alls
rearrange q, k, v and the attention's output into send and receive buffers in the forward and again in the
backward. Every storage made in the forward and backward is tracked until freed (as
tests/unit/plan/test_memory_graphs.py does for one rank); the live peak per local token is checked against the
planner's terms for sequence_parallel 2: within 10%, never under. The GPU's flash backward's fp32 dq has no CPU
counterpart and is left out, as on one rank."""

from __future__ import annotations

from typing import Any

import pytest

from tests.distributed.runner import run_distributed

pytestmark = pytest.mark.dist

SEQ = 128


def _peak_per_local_token(rank: int, world: int, hidden: int, ffn: int, heads: int, kv_heads: int) -> float:
    import torch

    from pipeline.model import ModelShape, build_model
    from pipeline.train.runtime.sequence import register
    from tests.unit.plan.test_memory_graphs import _Live

    shape = ModelShape(
        hidden_size=hidden, num_layers=1, ffn_hidden_size=ffn, num_heads=heads, num_kv_heads=kv_heads, vocab_size=500
    )
    torch.manual_seed(0)
    model = build_model(shape).to(torch.bfloat16)
    model.config._attn_implementation = "sdpa"
    register(model, world, micro_batch_size=1)
    layer = model.model.layers[0]
    local = SEQ // world
    x = torch.randn(1, local, hidden, dtype=torch.bfloat16, requires_grad=True)
    pos = torch.arange(rank * local, (rank + 1) * local)[None]
    rope = tuple(t.to(torch.bfloat16) for t in model.model.rotary_emb(x, pos))
    for p in layer.parameters():
        p.requires_grad_(False)
    grad = torch.randn_like(x)
    skip = {t.untyped_storage().data_ptr() for t in (x, grad, *rope, *model.parameters())}
    mode = _Live(skip)
    with mode:
        out = layer(x, attention_mask=None, position_ids=pos, position_embeddings=rope)
        (out[0] if isinstance(out, tuple) else out).backward(grad)
    return float(mode.peak / local)


@pytest.mark.parametrize("dims", [(256, 688, 4, 2), (512, 1376, 8, 8)], ids=["gqa", "mha"])
def test_ulysses_layer_holds_what_the_planner_prices(dims: tuple[int, int, int, int]) -> None:
    from pipeline.model import ModelShape
    from pipeline.plan.memory import (
        ATTENTION_BACKWARD_PER_H,
        layer_activation_bytes_per_token,
        layer_backward_bytes_per_token,
    )

    hidden, ffn, heads, kv_heads = dims
    counted: list[Any] = run_distributed(_peak_per_local_token, *dims, world_size=2)
    shape = ModelShape(
        hidden_size=hidden, num_layers=1, ffn_hidden_size=ffn, num_heads=heads, num_kv_heads=kv_heads, vocab_size=500
    )
    term = layer_activation_bytes_per_token(shape) + layer_backward_bytes_per_token(shape, sequence_parallel=2)
    term -= ATTENTION_BACKWARD_PER_H * hidden  # the GPU's flash dq: none on the CPU
    for peak in counted:
        assert peak <= term <= 1.1 * peak, (dims, peak, term, term / peak)
