"""pipeline.plan.memory: model states equal DeepSpeed's estimators (activation terms:
tests/unit/plan/test_memory_graphs.py),
host RAM buffer by buffer, pinned buffers, evaluation batches."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.model import PRESETS, ModelShape
from pipeline.plan.cluster import Cluster, Layout
from pipeline.plan.estimate import estimate
from pipeline.plan.gpus import GPUS
from pipeline.plan.memory import (
    activation_bytes,
    deepspeed_model_states,
    pinned,
    state_split,
)
from pipeline.plan.search import search


@settings(max_examples=60, deadline=None)
@given(
    h=st.sampled_from([256, 1024, 4096, 8192]),
    layers=st.integers(1, 96),
    vocab=st.sampled_from([500, 32000, 128256]),
    gpn=st.sampled_from([1, 2, 4, 8]),
    nodes=st.sampled_from([1, 2, 8, 16]),
)
def test_model_states_equal_deepspeed_estimators(h: int, layers: int, vocab: int, gpn: int, nodes: int) -> None:
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    shape = ModelShape(
        hidden_size=h,
        num_layers=layers,
        ffn_hidden_size=h * 8 // 3,
        num_heads=h // 128 or 1,
        num_kv_heads=h // 128 or 1,
        vocab_size=vocab,
    )
    psi, largest = shape.num_params(), shape.largest_layer_params()
    for off in (False, True):
        assert deepspeed_model_states(2, psi, largest, gpn, nodes, off, False) == estimate_zero2_model_states_mem_needs(
            psi, gpn, nodes, cpu_offload=off
        )
    for off_opt, off_par in ((False, False), (True, False), (True, True)):
        cpu, gpu, _ = estimate_zero3_model_states_mem_needs(
            psi, largest, gpn, nodes, cpu_offload=off_opt, cpu_offload_params=off_par, zero_init=True
        )
        assert deepspeed_model_states(3, psi, largest, gpn, nodes, off_opt, off_par) == (cpu, gpu)


def test_largest_layer_matches_the_real_module() -> None:

    from pipeline.model import build_model

    shape = replace(PRESETS["1b"], vocab_size=32000)
    with torch.device("meta"):
        model = build_model(shape)
    biggest = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())
    assert shape.largest_layer_params() == biggest
    assert sum(p.numel() for p in model.parameters()) == shape.num_params()


GiB = 2**30


SEED = Cluster(8, 1, GPUS["4090d"], 512 * 10**9)


FOUR_BY_FOUR = Cluster(4, 4, GPUS["4090d"], 512 * 10**9)


def test_the_trainers_chunked_loss_holds_one_chunk_of_logits() -> None:
    full = activation_bytes(PRESETS["1b"], 2048, 8, False)["logits"]
    assert full == 14 * 2048 * 8 * 32000
    assert activation_bytes(PRESETS["1b"], 2048, 8, False, loss_chunk_tokens=2097)["logits"] == 14 * 2097 * 32000


def test_pinned_buffers_round_up_to_powers_of_two() -> None:
    assert pinned(3 * 2**30) == 4 * 2**30 and pinned(2**30) == 2**30
    assert pinned(10 * 4e8, 10) == 10 * 2**29 and pinned(0) == 0


def test_host_ram_70b_refused_on_4x4_and_accepted_on_8x1() -> None:
    """ZeRO-3 offload of 70B: 465 GB per 512 GB node on 4 nodes x 4 cards (DeepSpeed's estimator: 466 + the
    processes), above the 80% limit; 225 GB per node on 8 x 1."""
    offload = Layout(3, "cpu", "cpu", True, 1, 61, 1e8, 1e8, 3e8, 1e8, grad_accum_dtype="bf16")
    e = estimate(PRESETS["70b"], 4096, FOUR_BY_FOUR, offload)
    assert e.host["total"] / 1e9 == pytest.approx(465, rel=0.03) and not e.fits
    assert any("host RAM 465 GB per node > 80% of 512 GB" in w for w in e.why_not)
    assert e.host["deepspeed_estimate"] / 1e9 == pytest.approx(466 + 24, rel=0.01)
    best = search(PRESETS["70b"], 4096, FOUR_BY_FOUR).best  # optimizer-only offload may still fit: within 80%
    assert best is None or (best.layout.offload_param == "none" and best.host["total"] <= 0.8 * 512e9)
    eight = estimate(PRESETS["70b"], 4096, SEED, replace(offload, grad_accum=122))
    assert eight.host["total"] / 1e9 == pytest.approx(225, rel=0.03) and eight.fits


def test_fp32_gradient_accumulation_is_counted_where_deepspeed_allocates_it() -> None:
    """ZeRO-3 offload: the pinned accumulation buffer doubles (70B on 8 x 1: 8.6B parameters a rank, 17.2 -> 34.4 GB,
    rounded by torch's pinned allocator to 32 -> 64 GiB). ZeRO-2/3 on the GPU: +2 B a partitioned parameter.
    ZeRO-1: DeepSpeed's BF16_Optimizer keeps a whole fp32 gradient (+4 B a parameter, less the partition)."""
    offload = Layout(3, "cpu", "cpu", True, 1, 122, 1e8, 1e8, 3e8, 1e8)
    assert offload.fp32_grad_accum and not replace(offload, grad_accum=1).fp32_grad_accum
    fp32 = estimate(PRESETS["70b"], 4096, SEED, offload).host["pinned"]
    bf16 = estimate(PRESETS["70b"], 4096, SEED, replace(offload, grad_accum_dtype="bf16")).host["pinned"]
    assert (fp32 - bf16) / 2**30 == pytest.approx(32.0)  # per node, one rank per node
    psi, g = PRESETS["1b"].num_params(), 8
    for stage, extra in ((3, 2 * psi / g), (2, 2 * psi / g), (1, 4 * psi - 4 * psi / g)):
        accum = state_split(stage, psi, g, False, False, fp32_accum=True)["grads"]
        assert accum - state_split(stage, psi, g, False, False)["grads"] == pytest.approx(extra)


def test_distributed_evaluation_of_70b_picks_a_batch_that_fits_24_gib() -> None:
    """70B split 8 ways at seq 4096: 16.1 GiB of bf16 partitions and 5.25 GiB of MLP transients at batch 8 are over
    a 24 GiB card (the review's estimate: 24.5 GiB against 23.6 usable); batch 2 fits."""
    from pipeline.model import loss_chunk_tokens
    from pipeline.plan.memory import evaluation_batch, inference_bytes

    shape, chunk = PRESETS["70b"], loss_chunk_tokens(32000)
    at8 = inference_bytes(shape, 4096, 8, 8, chunk)
    assert 2 * shape.num_params() / 8 / GiB == pytest.approx(16.06, rel=0.01)
    assert at8["total"] / GiB > 23.6
    batch, need = evaluation_batch(shape, 4096, 8, 8, 23.6 * GiB, chunk)
    assert batch == 2 and need / GiB < 23.6 - 1.5
    assert evaluation_batch(shape, 4096, 8, 2, 23.6 * GiB, chunk)[0] == 0  # 2 ranks: 64 GiB of partitions each


def test_activation_offload_keeps_four_layer_inputs_on_the_gpu_and_pins_the_rest() -> None:
    """DeepSpeed's CheckpointHiddenStatesOffload keeps the last checkpointed input, two whose copies are in flight
    and the one restored for the layer being recomputed; every other layer input waits in pinned host memory (one
    buffer each, rounded up to a power of two as torch's host allocator does)."""
    from pipeline.plan.memory import ACT_OFFLOAD_KEPT, host_memory

    shape = PRESETS["70b"]
    plain = activation_bytes(shape, 4096, 4, True)
    moved = activation_bytes(shape, 4096, 4, True, offloaded=True)
    layer_input = 2 * 4 * 4096 * shape.hidden_size
    assert plain["layers"] - moved["layers"] == (shape.num_layers - ACT_OFFLOAD_KEPT) * layer_input
    assert moved["one_layer"] == plain["one_layer"]
    c = Cluster(8, 1, GPUS["4090d"], 512 * 10**9)
    cand = Layout(3, "cpu", "cpu", True, 4, 31, 1e8, 1e8, 3e8, 1e8)
    more = host_memory(shape, c, replace(cand, offload_activations=True), 4096)["pinned"]
    assert more - host_memory(shape, c, cand, 4096)["pinned"] == 79 * 2 ** math.ceil(math.log2(layer_input))


def test_bf16_master_weights_and_states_shrink_the_host_state() -> None:
    """With CPU offload DeepSpeed keeps per parameter (ZeRO-3, fp32 accumulation): a 4-byte accumulation buffer,
    the optimizer's gradient, the master weight and two moments. bf16 master weights and gradients take 2 bytes off
    each of two; bf16 optimizer states 2 off each moment."""
    from pipeline.plan.memory import host_memory

    shape = PRESETS["7b"]
    c = Cluster(1, 1, GPUS["4090d"], 512 * 10**9)
    cand = Layout(3, "cpu", "cpu", True, 1, 8, 1e8, 1e8, 3e8, 1e8)
    fp32, master, states = (
        host_memory(shape, c, replace(cand, bf16_master=m, bf16_optimizer_states=s))["pageable"]
        for m, s in ((False, False), (True, False), (True, True))
    )
    psi = shape.num_params()
    assert (fp32 - master) == pytest.approx(2 * psi) and (master - states) == pytest.approx(4 * psi)


def test_whole_documents_on_sdpas_dense_mask_are_priced_and_on_the_varlen_path_cost_nothing() -> None:
    """At 32K, micro 1: the (1, 1, T, T) boolean mask is 1 GiB and SDPA's bf16 bias of it 2 GiB in each layer that
    keeps its attention: one (the recomputed one) with checkpointing, every layer without. The varlen path and
    plain packing price none, and the dense path's 3 GiB reach the peak."""
    from pipeline.plan.cluster import Stack
    from pipeline.plan.memory import document_mask_bytes, gpu_memory

    shape = PRESETS["7b"]
    dense = Stack(whole_documents=True)
    assert document_mask_bytes(shape, 32768, 1, True, dense) == (3 * GiB, 3 * GiB)
    assert document_mask_bytes(shape, 32768, 1, False, dense) == ((1 + 2 * 32) * GiB, 3 * GiB)
    assert document_mask_bytes(shape, 32768, 2, True, dense)[0] == 6 * GiB
    for stack in (Stack(), Stack(whole_documents=True, varlen=True)):
        assert document_mask_bytes(shape, 32768, 1, True, stack) == (0.0, 0.0)
    c = Cluster(8, 1, GPUS["4090d"], 512e9)
    cand = Layout(3, "cpu", "cpu", True, 1, 15, 1e8, 1e8, 3e8, 1e8, offload_activations=True)
    plain = gpu_memory(shape, 32768, c, cand, 2048, Stack())
    masked = gpu_memory(shape, 32768, c, cand, 2048, dense)
    assert masked["document_mask"] == 3 * GiB and plain["document_mask"] == 0
    assert masked["peak_allocated"] - plain["peak_allocated"] == pytest.approx(3 * GiB)
