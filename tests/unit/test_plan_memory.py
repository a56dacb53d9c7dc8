"""The planner's memory and time model item by item: activation bytes measured on a real transformers layer,
host RAM buffer by buffer, the margin, the network and PCIe per node, time as a range, ties toward less memory."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest
import torch
from click.testing import CliRunner

from pipeline.cli import main
from pipeline.model import PRESETS, ModelShape
from pipeline.plan.cluster import Candidate, Cluster, Stack
from pipeline.plan.estimate import estimate
from pipeline.plan.gpus import GPUS
from pipeline.plan.memory import activation_bytes, layer_activation_bytes_per_token, pinned, state_split
from pipeline.plan.search import choose, search
from pipeline.plan.timing import (
    ADAM_BYTES,
    CPU_ADAM_BW_FRACTION,
    CPU_ADAM_PARAMS_PER_CORE_S,
    CPU_ADAM_UNBOUND_SLOPE,
    HOST_COPY_FRACTION,
    NET_EFFICIENCY_SOCKETS,
)

GiB = 2**30
SEED = Cluster(8, 1, GPUS["4090d"], 512 * 10**9)
FOUR_BY_FOUR = Cluster(4, 4, GPUS["4090d"], 512 * 10**9)


def saved_bytes_per_token(shape: ModelShape, seq: int = 128) -> float:
    """Bytes a bf16 transformers LlamaDecoderLayer saves for its backward, per token, by saved-tensor hooks
    (distinct storages; the layer's parameters, its input and the RoPE tables shared by all layers excluded)."""
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    from pipeline.model import llama_config

    cfg = llama_config(shape)
    layer = LlamaDecoderLayer(cfg, 0).to(torch.bfloat16)
    x = torch.randn(1, seq, shape.hidden_size, dtype=torch.bfloat16, requires_grad=True)
    pos = torch.arange(seq)[None]
    cos, sin = (t.to(torch.bfloat16) for t in LlamaRotaryEmbedding(cfg)(x, pos))
    skip = {p.untyped_storage().data_ptr() for p in layer.parameters()} | {
        t.untyped_storage().data_ptr() for t in (x, cos, sin)
    }
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in skip:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        layer(x, attention_mask=None, position_ids=pos, position_embeddings=(cos, sin))
    return sum(seen.values()) / seq


@pytest.mark.parametrize(
    "shape",
    [
        ModelShape(hidden_size=256, num_layers=1, ffn_hidden_size=688, num_heads=4, num_kv_heads=2, vocab_size=500),
        ModelShape(hidden_size=512, num_layers=1, ffn_hidden_size=1376, num_heads=8, num_kv_heads=8, vocab_size=500),
        ModelShape(hidden_size=384, num_layers=1, ffn_hidden_size=1536, num_heads=6, num_kv_heads=2, vocab_size=500),
    ],
)
def test_activation_coefficients_are_what_a_real_llama_layer_saves(shape: ModelShape) -> None:
    measured = saved_bytes_per_token(shape)
    assert layer_activation_bytes_per_token(shape) == pytest.approx(measured, rel=0.02)


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
    offload = Candidate(3, "cpu", "cpu", True, 1, 61, 1e8, 1e8, 3e8, 1e8, grad_accum_dtype="bf16")
    e = estimate(PRESETS["70b"], 4096, FOUR_BY_FOUR, offload)
    assert e.host["total"] / 1e9 == pytest.approx(465, rel=0.03) and not e.fits
    assert any("host RAM 465 GB per node > 80% of 512 GB" in w for w in e.why_not)
    assert e.host["deepspeed_estimate"] / 1e9 == pytest.approx(466 + 24, rel=0.01)
    best = search(PRESETS["70b"], 4096, FOUR_BY_FOUR).best  # optimizer-only offload may still fit: within 80%
    assert best is None or (best.candidate.offload_param == "none" and best.host["total"] <= 0.8 * 512e9)
    eight = estimate(PRESETS["70b"], 4096, SEED, replace(offload, grad_accum=122))
    assert eight.host["total"] / 1e9 == pytest.approx(225, rel=0.03) and eight.fits


def test_fp32_gradient_accumulation_is_counted_where_deepspeed_allocates_it() -> None:
    """ZeRO-3 offload: the pinned accumulation buffer doubles (70B on 8 x 1: 8.6B parameters a rank, 17.2 -> 34.4 GB,
    rounded by torch's pinned allocator to 32 -> 64 GiB). ZeRO-2/3 on the GPU: +2 B a partitioned parameter.
    ZeRO-1: DeepSpeed's BF16_Optimizer keeps a whole fp32 gradient (+4 B a parameter, less the partition)."""
    offload = Candidate(3, "cpu", "cpu", True, 1, 122, 1e8, 1e8, 3e8, 1e8)
    assert offload.fp32_grad_accum and not replace(offload, grad_accum=1).fp32_grad_accum
    fp32 = estimate(PRESETS["70b"], 4096, SEED, offload).host["pinned"]
    bf16 = estimate(PRESETS["70b"], 4096, SEED, replace(offload, grad_accum_dtype="bf16")).host["pinned"]
    assert (fp32 - bf16) / 2**30 == pytest.approx(32.0)  # per node, one rank per node
    psi, g = PRESETS["1b"].num_params(), 8
    for stage, extra in ((3, 2 * psi / g), (2, 2 * psi / g), (1, 4 * psi - 4 * psi / g)):
        accum = state_split(stage, psi, g, False, False, fp32_accum=True)["grads"]
        assert accum - state_split(stage, psi, g, False, False)["grads"] == pytest.approx(extra)


def test_every_accepted_plan_keeps_the_stated_margin() -> None:
    for name in ("1b", "7b", "13b", "70b"):
        for cluster in (SEED, FOUR_BY_FOUR):
            for e in search(PRESETS[name], 4096, cluster).ranked:
                assert e.gpu["reserved"] + max(1.5 * GiB, 0.07 * 23.6 * GiB) <= 23.6 * GiB
                assert e.gpu["peak_allocated"] < e.gpu["reserved"]
    r = CliRunner().invoke(main, ["plan", "--model", "13b", "--hostfile", "hostfiles/8node"])
    assert r.exit_code == 0 and "margin kept" in r.output and "max(1.5 GiB, 7%)" in r.output


def test_network_is_charged_per_node_and_recompute_regathers() -> None:
    cand = Candidate(3, "cpu", "cpu", True, 1, 1, 1e8, 1e8, 3e8, 1e8)
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
    # A 70B layer (856M parameters) is beyond a reuse distance of 3e8: the recompute gathers it again.
    reused = estimate(PRESETS["70b"], 4096, p2p, replace(cand, max_reuse=1e9)).time["network"]
    assert four / reused == pytest.approx(4 / 3, rel=0.01)  # forward, recompute, backward gathers + reduce-scatter


def test_pcie_of_a_nodes_cards_shares_one_host() -> None:
    cand = Candidate(3, "cpu", "cpu", True, 1, 1, 1e8, 1e8, 3e8, 1e8)
    shared = estimate(PRESETS["7b"], 4096, FOUR_BY_FOUR, cand).time["host_copies"]
    alone = estimate(PRESETS["7b"], 4096, Cluster(16, 1, GPUS["4090d"], 512 * 10**9), cand).time["host_copies"]
    # Four cards' copies at once, through the node's share of host bandwidth (not 4 x 25 GB/s of PCIe).
    host = FOUR_BY_FOUR.cpu_mem_bw_gbs * HOST_COPY_FRACTION
    assert shared == pytest.approx(alone * 4 * 25 / min(4 * 25, host), rel=0.01)


def test_time_is_a_range_around_the_point_and_printed() -> None:
    e = search(PRESETS["7b"], 4096, SEED).best
    assert e is not None
    lo, hi = e.step_time_range_s
    assert lo < e.step_time_s < hi and 1.2 < hi / lo < 2  # every rate x0.75-1.2 and 6-12 GB/s
    r = CliRunner().invoke(main, ["plan", "--model", "7b", "--hostfile", "hostfiles/8node", "--json"])
    d = json.loads(r.output)["best"]
    for key in ("peak_allocated", "reserved", "margin", "step_time_range_s", "tokens_per_s_range"):
        assert key in d
    assert d["tokens_per_s_range"][0] < d["tokens_per_s"] < d["tokens_per_s_range"][1]
    text = CliRunner().invoke(main, ["plan", "--model", "7b", "--hostfile", "hostfiles/8node"]).output
    assert "tokens/s (range" in text and "peak allocated" in text and "PaLM count" in text


def test_near_ties_go_to_less_memory() -> None:
    p = search(PRESETS["7b"], 4096, SEED)
    fast = p.ranked[0]
    cheaper = replace(
        fast, tokens_per_s=fast.tokens_per_s * 1.01, gpu={**fast.gpu, "reserved": fast.gpu["reserved"] + GiB}
    )
    assert choose([cheaper, fast])[0] is fast
    much_faster = replace(cheaper, tokens_per_s=fast.tokens_per_s * 1.05)
    assert choose([much_faster, fast])[0] is much_faster


def test_a_rounded_global_batch_is_said() -> None:
    r = CliRunner().invoke(
        main, ["plan", "--model", "7b", "--hostfile", "hostfiles/8node", "--global-batch-tokens", "3.1M"]
    )
    assert (
        r.exit_code == 0 and "3,100,000 tokens per step were asked for; whole micro-batches on 8 GPUs give" in r.output
    )


def test_plan_config_evaluates_the_run_about_to_launch(tmp_path) -> None:
    r = CliRunner().invoke(
        main, ["plan", "--config", "configs/70b_8node.yaml", "--hostfile", "hostfiles/8node", "--seq-len", "4096"]
    )
    assert r.exit_code == 0, r.output
    assert "your config: ZeRO-3 + cpu offload (opt, params) + ckpt, micro 2 x GA 61" in r.output
    assert "FITS: +" in r.output and "the search would choose" in r.output and "seq_len 4096 from --seq-len" in r.output
    # The same run with DeepSpeed's default ZeRO-3 buckets on a 24 GiB-capped H200, 2 layers: predicted not to fit.
    ds = tmp_path / "defaults.json"
    ds.write_text(
        json.dumps(
            {
                "zero_optimization": {
                    "stage": 3,
                    "offload_optimizer": {"device": "cpu"},
                    "offload_param": {"device": "cpu"},
                }
            }
        )
    )
    r = CliRunner().invoke(
        main,
        [
            "plan",
            "--config",
            "configs/70b_8node.yaml",
            "--set",
            f"train.deepspeed_config={ds}",
            "--set",
            "batch.micro_batch_size=1",
            "--set",
            "batch.global_batch_size=1",
            "--layers",
            "2",
            "--gpu",
            "h200",
            "--gpu-mem",
            "24GiB",
            "--seq-len",
            "4096",
            "--json",
        ],
    )
    assert r.exit_code == 3, r.output
    d = json.loads(r.output)
    assert d["fits"] is False and "GPU memory" in d["yours"]["why_not"][0]
    assert d["yours"]["config"]["max_live"] == 1e9 and d["search_best"]["config"]["max_live"] <= 5e8


def test_plan_config_takes_seq_len_from_the_shards(tmp_path) -> None:
    from pipeline.data.manifest import read_shard_manifest  # noqa: F401 - the shards' reader is what is used

    cfg = tmp_path / "c.yaml"
    shards = tmp_path / "shards"
    shards.mkdir()
    (shards / "manifest.json").write_text("{}")
    cfg.write_text(
        f"model: {{preset: tiny}}\ndata: {{path: {shards}}}\nbatch: {{micro_batch_size: 2, "
        "global_batch_size: 4}\ntrain: {max_steps: 1, deepspeed_config: ds_configs/zero2.json}\n"
    )
    r = CliRunner().invoke(main, ["plan", "--config", str(cfg)])
    assert r.exit_code == 2 and "manifest.json" in r.output  # a damaged manifest is named, not a traceback
    r = CliRunner().invoke(main, ["plan", "--config", str(cfg), "--from-run", str(tmp_path)])
    assert r.exit_code == 2 and "not a run folder" in r.output  # --from-run calibrates --config: on a run folder


def test_pretrain_refuses_a_run_whose_checkpoints_do_not_fit_the_disk(tmp_path, shards) -> None:
    """70B at the fixture's vocabulary: a ZeRO-2 checkpoint is ~1.1 TB on the first node, more than this disk has."""
    import shutil

    if shutil.disk_usage(tmp_path).free > 2 * 10**12:
        pytest.skip("this disk has over 2 TB free")
    cfg = tmp_path / "c.yaml"
    cfg.write_text(
        f"run_dir: {tmp_path}/run\nmodel: {{preset: 70b}}\ndata: {{path: {shards}}}\n"
        "batch: {micro_batch_size: 1, global_batch_size: 2}\n"
        "train: {max_steps: 1, deepspeed_config: ds_configs/zero2.json}\n"
    )
    r = CliRunner().invoke(main, ["pretrain", "--config", str(cfg), "--num-gpus", "2", "--dry-run"])
    assert r.exit_code == 2 and "a checkpoint is" in r.output and "GB free" in r.output, r.output
    assert "checkpoint.keep_last" in r.output and not (tmp_path / "run").exists()
    r = CliRunner().invoke(
        main, ["pretrain", "--config", str(cfg), "--num-gpus", "2", "--dry-run", "--set", "checkpoint.enabled=false"]
    )
    assert r.exit_code == 0, r.output


def test_reference_hostfiles_carry_their_clusters() -> None:
    r = CliRunner().invoke(main, ["plan", "--model", "7b", "--hostfile", "hostfiles/4node4gpu"])
    assert "cluster facts from hostfiles/4node4gpu: gpu=4090d cpu_mem=120GB cpu_cores=10" in r.output
    assert "defaults for network" in r.output and "120 GB RAM and 10 cores/node" in r.output
    assert "a safe save keeps 1 checkpoint(s) while writing the next" in r.output  # 2 x 20 GB > the 40 GB disk
    r = CliRunner().invoke(main, ["plan", "--model", "13b", "--hostfile", "hostfiles/4node4gpu", "--json"])
    d = json.loads(r.output)["best"]
    assert (
        d is None or any("checkpoint disk" in w for w in d["warnings"]) or any("checkpoint" in w for w in d["why_not"])
    )
    r = CliRunner().invoke(main, ["plan", "--model", "70b", "--hostfile", "hostfiles/4node4gpu"])
    assert r.exit_code == 3 and "host RAM" in r.output and "(80% limit: 96 GB)" in r.output
    r = CliRunner().invoke(main, ["plan", "--model", "70b", "--hostfile", "hostfiles/4node4gpu", "--cpu-mem", "512GB"])
    assert "cpu_mem=120GB" not in r.output.splitlines()[0] and "512 GB RAM and 10 cores/node" in r.output  # flag wins
    # The 8 x 1 cluster's answer is the same with its facts as with the flags it had before.
    a = CliRunner().invoke(main, ["plan", "--model", "70b", "--hostfile", "hostfiles/8node", "--json"]).output
    assert json.loads(a)["best"]["label"] == "ZeRO-3 + cpu offload (opt, params) + ckpt (offloaded), micro 4 x GA 31"


def test_a_hostfile_without_facts_plans_with_named_defaults(tmp_path) -> None:
    hf = tmp_path / "hosts"
    hf.write_text("a slots=2\nb slots=2\n")
    r = CliRunner().invoke(main, ["plan", "--model", "1b", "--hostfile", str(hf)])
    assert r.exit_code == 0 and "has no '# cluster:' line" in r.output and "defaults for cpu_cores, cpu_mem" in r.output
    hf.write_text("# cluster: gpu=4090d ram=1TB\na slots=2\n")
    r = CliRunner().invoke(main, ["plan", "--model", "1b", "--hostfile", str(hf)])
    assert r.exit_code == 2 and "hosts:1: 'ram=1TB'" in r.output


def test_the_readme_fits_table_is_what_the_planner_says() -> None:
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    block = readme.split("<!-- fits-table -->")[1].strip()
    r = CliRunner().invoke(main, ["plan", "--fits-table"])
    assert r.exit_code == 0 and block == r.output.strip(), "regenerate with `pipeline plan --fits-table`"


def test_cpu_adam_time_follows_the_nodes_cores_and_memory_bandwidth() -> None:
    """Offloaded Adam runs at the lower of cores x 0.3e9 parameters/s (memory-bound arrays) and the share of the
    node's memory bandwidth its streaming kernel sustains over the 40 bytes it touches per parameter."""
    cand = Candidate(3, "cpu", "cpu", True, 1, 1, 1e8, 1e8, 3e8, 1e8)
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
    cand = Candidate(3, "cpu", "cpu", True, 4, 31, 1e8, 1e8, 3e8, 1e8)
    more = host_memory(shape, c, replace(cand, offload_activations=True), 4096)["pinned"]
    assert more - host_memory(shape, c, cand, 4096)["pinned"] == 79 * 2 ** math.ceil(math.log2(layer_input))


def test_bf16_master_weights_and_states_shrink_the_host_state() -> None:
    """With CPU offload DeepSpeed keeps per parameter (ZeRO-3, fp32 accumulation): a 4-byte accumulation buffer,
    the optimizer's gradient, the master weight and two moments. bf16 master weights and gradients take 2 bytes off
    each of two; bf16 optimizer states 2 off each moment."""
    from pipeline.plan.memory import host_memory

    shape = PRESETS["7b"]
    c = Cluster(1, 1, GPUS["4090d"], 512 * 10**9)
    cand = Candidate(3, "cpu", "cpu", True, 1, 8, 1e8, 1e8, 3e8, 1e8)
    fp32, master, states = (
        host_memory(shape, c, replace(cand, bf16_master=m, bf16_optimizer_states=s))["pageable"]
        for m, s in ((False, False), (True, False), (True, True))
    )
    psi = shape.num_params()
    assert (fp32 - master) == pytest.approx(2 * psi) and (master - states) == pytest.approx(4 * psi)
