"""pipeline.plan.timing: no throughput above the physical ceiling, the network and PCIe per node, CPU Adam on the
node's cores and memory bandwidth, what ZenFlow hides."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.model import PRESETS, ModelShape
from pipeline.plan.cluster import Cluster, Layout, Stack
from pipeline.plan.estimate import estimate
from pipeline.plan.gpus import GPUS
from pipeline.plan.search import search
from pipeline.plan.timing import (
    ADAM_BYTES,
    CPU_ADAM_BW_FRACTION,
    CPU_ADAM_PARAMS_PER_CORE_S,
    CPU_ADAM_UNBOUND_SLOPE,
    HOST_COPY_FRACTION,
    NET_EFFICIENCY_SOCKETS,
    regathered,
)

SEED = Cluster(8, 1, GPUS["4090d"], 512 * 10**9)


def resolve_1b() -> ModelShape:
    return replace(PRESETS["1b"], vocab_size=32000)


@settings(max_examples=40, deadline=None)
@given(
    preset=st.sampled_from(["125m", "1b", "7b", "13b", "70b"]),
    gpu=st.sampled_from(sorted(GPUS)),
    nodes=st.sampled_from([1, 2, 8]),
    gpn=st.sampled_from([1, 4]),
    seq=st.sampled_from([1024, 4096]),
)
def test_no_throughput_above_the_physical_ceiling(preset: str, gpu: str, nodes: int, gpn: int, seq: int) -> None:
    c = Cluster(nodes, gpn, GPUS[gpu], 512 * 10**9)
    p = search(PRESETS[preset], seq, c)
    for e in p.ranked + p.rejected:
        # Compute runs at most at the card's GEMM ceiling (a measured share of its peak); the range's fast end at
        # most at the peak itself.
        assert e.tokens_per_s <= e.ceiling_tokens_per_s * GPUS[gpu].gemm_fraction + 1e-6
        assert 0 < e.mfu <= GPUS[gpu].gemm_fraction
        assert e.tokens_per_s_range[0] <= e.tokens_per_s <= e.tokens_per_s_range[1]
        assert e.tokens_per_s_range[1] <= e.ceiling_tokens_per_s + 1e-6
        if e.layout.offload_optimizer == e.layout.offload_param == "none":  # a range, not a shrug; offload
            assert e.tokens_per_s_range[1] / e.tokens_per_s_range[0] < 2.0  # rests on assumed host rates: wider


def test_zenflow_hides_cpu_adam_where_it_is_a_large_share_of_the_step() -> None:
    """Under ZenFlow CPU Adam runs once per update interval, in its own process, while the GPU goes on: the step
    pays only what the interval's micro-steps do not hide. With 4M-token batches (GA 61) Adam is under 1% of the
    step and the gain is nothing; with 64K-token batches on a slow host it is most of the step."""
    shape = resolve_1b()
    slow_host = Cluster(1, 1, GPUS["4090d"], 128 * 10**9, cpu_mem_bw_gbs=20, cpu_cores=4)
    plain = Layout(2, "cpu", "none", True, 4, 8)
    zen = replace(plain, grad_accum=1, zenflow_interval=8)
    a, b = estimate(shape, 2048, slow_host, plain), estimate(shape, 2048, slow_host, zen)
    assert a.time["optimizer"] > 0.3 * a.step_time_s  # CPU Adam is a large share without it
    per_update = 8 * b.step_time_s
    assert per_update < a.step_time_s and b.time["optimizer"] < 0.1 * a.time["optimizer"]
    assert b.tokens_per_s / a.tokens_per_s == pytest.approx(a.step_time_s / per_update)
    assert b.gpu["optimizer"] > a.gpu["optimizer"]  # the top-k columns' moments live on the GPU
    big = Layout(2, "cpu", "none", True, 2, 61)
    gain = estimate(shape, 4096, SEED, replace(big, grad_accum=1, zenflow_interval=61)).tokens_per_s
    assert gain / estimate(shape, 4096, SEED, big).tokens_per_s < 1.02


FOUR_BY_FOUR = Cluster(4, 4, GPUS["4090d"], 512 * 10**9)


def test_network_is_charged_per_node_and_recompute_regathers() -> None:
    cand = Layout(3, "cpu", "cpu", True, 1, 1, 1e8, 1e8, 3e8, 1e8)
    sixteen = estimate(PRESETS["70b"], 4096, Cluster(16, 1, GPUS["4090d"], 512 * 10**9), cand).time["network"]
    p2p = replace(FOUR_BY_FOUR, gpu=replace(GPUS["4090d"], p2p=True))
    four = estimate(PRESETS["70b"], 4096, p2p, cand).time["network"]
    assert four == pytest.approx(sixteen, rel=0.01)  # one rank's volume crosses each node's NIC, not four
    # Without P2P the ring's hops inside a node go through its host memory, all four GPUs' at once, each out and
    # back in: the node's share of host bandwidth for copies, over 2 x 4, is slower than the NIC here.
    no_p2p = estimate(PRESETS["70b"], 4096, FOUR_BY_FOUR, cand).time["network"]
    nic = 100 / 8 * NET_EFFICIENCY_SOCKETS[1]
    host = FOUR_BY_FOUR.cpu_mem_bw_gbs * HOST_COPY_FRACTION / (2 * 4)
    assert no_p2p / sixteen == pytest.approx(nic / host, rel=0.01) and host < nic
    # A 70B layer (856M parameters) is beyond a reuse distance of 3e8: the backward gathers again what the
    # recompute gathered, but for the down projection (nothing is used between its recompute and its backward).
    reused = estimate(PRESETS["70b"], 4096, p2p, replace(cand, max_reuse=1e12)).time["network"]
    again = regathered(PRESETS["70b"], 3e8) * PRESETS["70b"].layer_params() * 80 / PRESETS["70b"].num_params()
    assert four / reused == pytest.approx((3 + again) / 3, rel=0.01)  # gathers, the reduce-scatter


def test_the_backward_gathers_again_what_its_reuse_distance_released() -> None:
    """DeepSpeed keeps a module gathered for its next use when fewer than stage3_max_reuse_distance parameters
    are used in between: between a module's recompute and its backward come the layer's later modules, twice."""
    s = PRESETS["70b"]
    h, f, kv = s.hidden_size, s.ffn_hidden_size, s.num_kv_heads * s.head_dim
    attention, mlp = 2 * h * h + 2 * h * kv, h * f
    total = attention + 3 * mlp
    assert regathered(s, 1e12) == 0.0
    assert regathered(s, 5e8) == pytest.approx((attention + mlp) / total)  # up (470M apart) and down kept
    assert regathered(s, 3e8) == pytest.approx((attention + 2 * mlp) / total)  # only down kept
    assert regathered(PRESETS["7b"], 5e8) == 0.0  # a 7B layer's modules are all within 5e8 of their backward


def test_pcie_of_a_nodes_cards_shares_one_host() -> None:
    cand = Layout(3, "cpu", "cpu", True, 1, 1, 1e8, 1e8, 3e8, 1e8)
    shared = estimate(PRESETS["7b"], 4096, FOUR_BY_FOUR, cand).time["host_copies"]
    alone = estimate(PRESETS["7b"], 4096, Cluster(16, 1, GPUS["4090d"], 512 * 10**9), cand).time["host_copies"]
    # Four cards' copies at once, through the node's share of host bandwidth (not 4 x 25 GB/s of PCIe).
    host = FOUR_BY_FOUR.cpu_mem_bw_gbs * HOST_COPY_FRACTION
    assert shared == pytest.approx(alone * 4 * 25 / min(4 * 25, host), rel=0.01)


def test_cpu_adam_time_follows_the_nodes_cores_and_memory_bandwidth() -> None:
    """Offloaded Adam runs at the lower of cores x 0.3e9 parameters/s (memory-bound arrays) and the share of the
    node's memory bandwidth its streaming kernel sustains over the 40 bytes it touches per parameter."""
    cand = Layout(3, "cpu", "cpu", True, 1, 1, 1e8, 1e8, 3e8, 1e8)
    big = Cluster(8, 1, GPUS["4090d"], 512 * 10**9, cpu_mem_bw_gbs=300, cpu_cores=128)  # hostfiles/8node
    rented = replace(big, cpu_mem_bw_gbs=50, cpu_cores=10)  # hostfiles/4node4gpu
    two_cores = replace(big, cpu_cores=2)
    t = {
        name: estimate(PRESETS["7b"], 4096, c, cand).time["optimizer"]
        for name, c in (("big", big), ("rented", rented), ("two", two_cores))
    }
    per_node = PRESETS["7b"].num_params() / 8
    assert t["big"] == pytest.approx(per_node * ADAM_BYTES["fp32"] / (300e9 * CPU_ADAM_BW_FRACTION))
    assert t["rented"] == pytest.approx(6 * t["big"])
    assert t["two"] == pytest.approx(per_node / (2 * CPU_ADAM_PARAMS_PER_CORE_S))  # too few cores set the pace
    unbound = estimate(PRESETS["7b"], 4096, replace(big, gpus_per_node=4, nodes=2), cand, stack=Stack(bind_cores=False))
    bound = estimate(PRESETS["7b"], 4096, replace(big, gpus_per_node=4, nodes=2), cand)
    assert unbound.time["optimizer"] / bound.time["optimizer"] == pytest.approx(1 + 3 * CPU_ADAM_UNBOUND_SLOPE)


def test_the_per_bucket_collective_latency_is_the_slowest_hops() -> None:
    """ZeRO-3's bucket collectives cost a fixed latency each: microseconds inside an NVLink (or P2P) node, where
    published single-node steps show no such term; 0.2 ms across nodes or between GeForce cards staged through host
    memory."""
    from pipeline.plan.timing import COLLECTIVE_LATENCY_S, NVLINK_LATENCY_S, collective_latency

    nvlink_node = Cluster(1, 8, GPUS["h100"], 2048 * 10**9)
    assert collective_latency(nvlink_node) == NVLINK_LATENCY_S < COLLECTIVE_LATENCY_S / 10
    assert collective_latency(replace(nvlink_node, nodes=2)) == COLLECTIVE_LATENCY_S
    assert collective_latency(Cluster(1, 4, GPUS["4090d"], 120 * 10**9)) == COLLECTIVE_LATENCY_S  # no P2P
    cand = Layout(3, "none", "none", True, 1, 4, 1e7, 1e7, 3e8, 1e9)  # small buckets: many collectives
    one = estimate(PRESETS["7b"], 4096, nvlink_node, cand).time["collective_latency"]
    two = estimate(PRESETS["7b"], 4096, replace(nvlink_node, nodes=2), cand).time["collective_latency"]
    assert two == pytest.approx(one * COLLECTIVE_LATENCY_S / NVLINK_LATENCY_S)
