"""pipeline.plan.search: the seed cluster's plans, refusals that say what would fit, the stated margin kept, ties
toward less memory, the offload features chosen and left to the user."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from click.testing import CliRunner

from pipeline.cli import main
from pipeline.model import PRESETS, ModelShape
from pipeline.plan.cluster import TRAINER, Cluster, Layout, Stack
from pipeline.plan.estimate import estimate
from pipeline.plan.gpus import GPUS
from pipeline.plan.search import choose, search

ROOT = Path(__file__).resolve().parents[3]


SEED = Cluster(8, 1, GPUS["4090d"], 512 * 10**9)


RENTED = Cluster(4, 4, GPUS["4090d"], 120 * 10**9, cpu_mem_bw_gbs=50, cpu_cores=10, disk_bytes=40 * 10**9)
"""hostfiles/4node4gpu's cluster."""


def qwen_7b() -> ModelShape:
    from pipeline.model import families

    return families.shape_from_config(families.read_config(str(ROOT / "configs/hf/qwen2.5-7b.json")), "qwen2.5-7b")


def test_llama2_70b_fits_the_seed_cluster_below_the_compute_ceiling() -> None:
    p = search(PRESETS["70b"], 4096, SEED)
    assert p.best is not None
    # Without DeepSpeed 0.19's activation offload: micro 1 (micro 2 did fit until the plan carried the 1.37 GiB
    # the 70B slices held on the H200 beyond its terms), the network the larger part of each step.
    plain = next(e for e in p.ranked if "activation-offload" not in e.layout.features())
    c = plain.layout
    assert (c.stage, c.offload_optimizer, c.offload_param, c.activation_checkpointing) == (3, "cpu", "cpu", True)
    assert plain.ceiling_tokens_per_s == pytest.approx(2647, rel=0.01)  # 8 x 147.1 TF / 4.45e11 FLOP/token
    assert plain.tokens_per_s < 2647 and plain.mfu < 0.40
    assert plain.gpu["reserved"] + plain.gpu["margin"] <= 23.6 * 2**30 and plain.host["total"] <= 0.8 * 512e9
    # 225 GB with a bf16 accumulation buffer (DeepSpeed's estimator says 233 + 6 for the process); the fp32 buffer
    # of GA 61 doubles it: 8.6B partitioned parameters, 17.2 -> 34.4 GB, pinned and rounded from 32 to 64 GiB.
    assert plain.host["total"] / 1e9 == pytest.approx(225 + 34.4, rel=0.05)
    # With it the checkpointed layer inputs wait in host memory, micro 4 fits, and ZeRO-3's traffic per token
    # is a quarter: faster, by less than the 4x that quartering the network's part could give, below the ceiling.
    best = p.best
    assert best.layout.features() == {"activation-offload"} and best.layout.micro_batch_size == 4
    assert plain.layout.micro_batch_size == 1
    assert 1.5 < best.tokens_per_s / plain.tokens_per_s < 4.0
    assert best.tokens_per_s < 2647 * GPUS["4090d"].gemm_fraction and best.mfu < GPUS["4090d"].gemm_fraction
    assert best.gpu["reserved"] + best.gpu["margin"] <= 23.6 * 2**30
    # 79 of 80 layer inputs (4 x 4096 tokens x 8192 x 2 bytes = 256 MiB each) pinned on the host.
    assert best.host["total"] - plain.host["total"] == pytest.approx(79 * 2**28, rel=0.01)


def test_refuses_70b_on_one_node_without_nvme_and_says_what_would_fit() -> None:
    p = search(PRESETS["70b"], 4096, Cluster(1, 1, GPUS["4090d"], 512 * 10**9))
    assert p.best is None
    text = " ".join(p.advice)
    # 1,104 GB of fp32 states; pinned buffers rounded to powers of two make 4 nodes of 512 GB fall short.
    assert "about 5 nodes of 512 GB" in text and "NVMe offload (ZeRO-Infinity) would fit" in text and "13b" in text
    with_nvme = search(PRESETS["70b"], 4096, Cluster(1, 1, GPUS["4090d"], 512 * 10**9, nvme_bytes=4 * 10**12))
    assert with_nvme.best is not None and with_nvme.best.layout.offload_optimizer == "nvme"


def test_every_preset_gets_an_answer_for_the_seed_clusters() -> None:
    for name, shape in PRESETS.items():
        for cluster in (SEED, Cluster(4, 4, GPUS["4090d"], 512 * 10**9)):
            p = search(shape, 4096 if name != "tiny" else 1024, cluster)
            assert p.best is not None or p.advice, name


def test_offload_features_the_choice_uses_and_the_ones_it_leaves_to_the_user() -> None:
    """Continued pretraining of Qwen2.5-7B on the rented 4 x 4 cluster: ZeRO-2 no longer fits there, because its 4
    ranks each build the whole 7.6B model in host memory at start-up (100 GB of the 96 allowed per node: the build
    term); ZeRO-3 builds partitioned. bf16 master weights and states, which change the numerics, are priced (they
    free the host RAM that micro-batch 8 needs) and chosen only when the user opts in; ZenFlow's GPU-side states do
    not fit beside ZeRO-2's whole bf16 model on a 24 GB card, and the plan says so."""
    p = search(qwen_7b(), 4096, RENTED)
    assert p.best is not None and p.best.layout.stage == 3
    assert not {"bf16-master", "bf16-states", "zenflow"} & p.best.layout.features()
    zero2 = [e for e in p.rejected if e.layout.stage == 2 and not e.layout.zenflow_interval]
    assert zero2 and all(any(w.startswith("host RAM ") for w in e.why_not) for e in zero2)
    assert any("host RAM 100 GB per node > 80% of 120 GB" in e.why_not for e in zero2)
    notes = "\n".join(p.feature_notes())
    assert "bf16-states: not chosen; --opt-in bf16-states allows it" in notes
    assert "zenflow: no configuration with it fits (closest: ZeRO-2 + cpu offload (opt) + ckpt + ZenFlow" in notes
    option, _ = p.by_feature["bf16-states"]
    assert option is not None and option.layout.micro_batch_size == 8
    assert (
        option.host["total"]
        < 0.8 * RENTED.cpu_mem_bytes
        < replace(
            option,
            host=estimate(
                qwen_7b(), 4096, RENTED, replace(option.layout, bf16_master=False, bf16_optimizer_states=False)
            ).host,
        ).host["total"]
    )
    assert 1.2 < option.tokens_per_s / p.best.tokens_per_s < 2.0
    allowed = search(qwen_7b(), 4096, RENTED, opt_in=frozenset({"bf16-states"}))
    assert allowed.best is not None and "bf16-states" in allowed.best.layout.features()
    assert allowed.best.tokens_per_s == pytest.approx(option.tokens_per_s)
    assert "bf16-states: used, +" in "\n".join(allowed.feature_notes())


GiB = 2**30


FOUR_BY_FOUR = Cluster(4, 4, GPUS["4090d"], 512 * 10**9)


def test_every_accepted_plan_keeps_the_stated_margin() -> None:
    for name in ("1b", "7b", "13b", "70b"):
        for cluster in (SEED, FOUR_BY_FOUR):
            for e in search(PRESETS[name], 4096, cluster).ranked:
                assert e.gpu["reserved"] + max(1.5 * GiB, 0.07 * 23.6 * GiB) <= 23.6 * GiB
                assert e.gpu["peak_allocated"] < e.gpu["reserved"]
    r = CliRunner().invoke(main, ["plan", "--model", "13b", "--hostfile", "hostfiles/8node"])
    assert r.exit_code == 0 and "margin kept" in r.output and "max(1.5 GiB, 7%)" in r.output


def test_near_ties_go_to_less_memory() -> None:
    p = search(PRESETS["7b"], 4096, SEED)
    fast = p.ranked[0]
    cheaper = replace(
        fast, tokens_per_s=fast.tokens_per_s * 1.01, gpu={**fast.gpu, "reserved": fast.gpu["reserved"] + GiB}
    )
    assert choose([cheaper, fast])[0] is fast
    much_faster = replace(cheaper, tokens_per_s=fast.tokens_per_s * 1.05)
    assert choose([much_faster, fast])[0] is much_faster


@pytest.mark.parametrize(
    "preset, seq_len, hostfile, cluster",
    [("70b", 32768, "hostfiles/8node", SEED), ("7b", 131072, "hostfiles/4node4gpu", RENTED)],
)
def test_long_context_fits_by_sharing_each_sample(preset: str, seq_len: int, hostfile: str, cluster: Cluster) -> None:
    """A 70B continued at 32K on the seed cluster and a 7B at 128K on the rented nodes: nothing fits a rank holding
    a whole sequence with its MLP untiled; ranks sharing each sample (sequence parallelism) or the tiled MLP do, and
    the plan says which, with the sizes to set."""
    shape = PRESETS[preset]
    p = search(shape, seq_len, cluster)  # transformers' own modules (train.kernels torch)
    assert p.best is not None and p.best.fits
    assert all(e.layout.sequence_parallel > 1 or e.layout.tiled_mlp > 1 for e in p.ranked)
    sharing = [e for e in p.ranked if e.layout.sequence_parallel > 1]
    assert sharing and all(e.time["sequence_all_to_all"] > 0 for e in sharing)  # priced, never free
    for e in sharing:
        sp = e.layout.sequence_parallel
        assert cluster.world % sp == 0 and shape.num_heads % sp == 0 and e.tokens_per_s < e.ceiling_tokens_per_s
    # What `pipeline plan` prices: the trainer's switches as they resolve against the packages the hostfile's
    # nodes are known to have (none here: transformers' modules), with the room a long context keeps
    best = search(shape, seq_len, cluster, stack=TRAINER).best.layout
    out = CliRunner().invoke(main, ["plan", "--model", preset, "--seq-len", str(seq_len), "--hostfile", hostfile])
    assert out.exit_code == 0, out.output
    assert f"long context: sequence parallel {best.sequence_parallel} " in out.output or best.sequence_parallel == 1
    assert f"train.tiled_mlp: {best.tiled_mlp}" in out.output or best.tiled_mlp == 0


def test_sharing_a_sample_divides_its_activations_and_costs_an_all_to_all() -> None:
    from pipeline.plan.memory import gpu_memory, layer_backward_bytes_per_token
    from pipeline.plan.timing import sequence_all_to_all

    shape, seq = PRESETS["7b"], 32768
    one = Layout(3, "cpu", "cpu", True, 1, 8, 1e8, 1e8, 3e8, 1e8)
    memory = {n: gpu_memory(shape, seq, SEED, replace(one, sequence_parallel=n), 2048) for n in (1, 2, 4)}
    for n in (2, 4):  # a rank's share, and Ulysses' copies of the layer in its backward
        copies = seq // n * (layer_backward_bytes_per_token(shape, n) - layer_backward_bytes_per_token(shape))
        assert memory[n]["activations"] - copies == pytest.approx(memory[1]["activations"] / n)
    assert sequence_all_to_all(shape, seq, SEED, one) == (0.0, "")
    sent, link = sequence_all_to_all(shape, seq, SEED, replace(one, sequence_parallel=2))
    # q, k, v out and o back (4 x 4096 bf16 per token), 3 passes (recompute), 32 layers, half the tokens leave
    assert sent == 3 * 32 * (seq // 2) * 2 * 4 * 4096 / 2 and link == "across the NIC"
    assert sequence_all_to_all(shape, seq, RENTED, replace(one, sequence_parallel=4))[1] == "inside the node"


def test_a_sequence_parallel_choice_round_trips_through_its_deepspeed_json() -> None:
    from pipeline.plan.ds_json import ds_config, layout_from_ds

    p = search(PRESETS["70b"], 32768, SEED, fixed_sequence=2)
    assert p.best is not None
    ds = ds_config(p.best)
    assert ds["sequence_parallel_size"] == 2
    back = layout_from_ds(ds, p.best.layout.micro_batch_size, p.best.layout.grad_accum, True)
    assert back.sequence_parallel == 2
    assert search(PRESETS["70b"], 32768, SEED, fixed_sequence=2).best.layout.sequence_parallel == 2  # type: ignore[union-attr]


def test_a_tiled_mlp_keeps_one_tiles_intermediates_and_pays_one_more_mlp_forward() -> None:
    from pipeline.plan.memory import ACT_PER_F, BACKWARD_PER_F, activation_bytes
    from pipeline.plan.timing import Rates, step_time

    shape, seq = PRESETS["70b"], 32768
    whole = activation_bytes(shape, seq, 1, True)
    tiled = activation_bytes(shape, seq, 1, True, mlp_tiles=4)
    kept = ACT_PER_F + BACKWARD_PER_F  # a tile's intermediates and their gradients, not the whole sequence's
    assert whole["one_layer"] - tiled["one_layer"] == pytest.approx(seq * kept * shape.ffn_hidden_size * 3 / 4)
    cand = Layout(3, "cpu", "cpu", True, 1, 15, 1e8, 1e8, 3e8, 1e8)
    plain = step_time(shape, seq, SEED, cand, Stack(), Rates(), 0.72)["compute"]
    more = step_time(shape, seq, SEED, replace(cand, tiled_mlp=4), Stack(), Rates(), 0.72)["compute"]
    extra = 15 * seq * 6 * shape.hidden_size * shape.ffn_hidden_size * shape.num_layers
    assert more > plain and (more - plain) / plain == pytest.approx(
        extra / (15 * seq * shape.flops_per_token(seq) * 4 / 3)
    )
    # offered only where one sample does not fit untiled: not at 4K, where a larger micro-batch would buy it
    assert not any(e.layout.tiled_mlp for e in search(PRESETS["7b"], 4096, SEED).ranked)


@pytest.mark.parametrize("name", ["adamw", "adamw8bit", "muon"])
@pytest.mark.parametrize(
    "model, cluster",
    [("7b", Cluster(1, 1, GPUS["4090d"], 512 * 10**9)), ("1b", Cluster(1, 1, GPUS["4090d"], 64 * 10**9)), ("7b", SEED)],
)
def test_the_search_proposes_only_what_the_runs_optimizer_accepts(name: str, model: str, cluster: Cluster) -> None:
    """Every entry of the optimizer table: each configuration searched is one its entry takes (ZeRO stage,
    offload), priced at its state bytes, and the trainer's own check accepts the choice; where nothing fits the
    optimizer but AdamW would, the advice says so (a 7B on one 4090D needs Adam's CPU offload)."""
    from pipeline.train.setup.optimizers import OPTIMIZERS
    from pipeline.train.setup.prepare import optimizer_fit

    assert name in OPTIMIZERS and len(OPTIMIZERS) == 3, "a new optimizer entry: add it to the parametrisation"
    entry = OPTIMIZERS[name]
    p = search(PRESETS[model], 2048, cluster, 2**19, optimizer=optimizer_fit(name))
    tried = p.ranked + p.rejected
    assert tried and all(e.layout.stage in entry.zero_stages for e in tried)
    assert all(e.layout.moment_bytes == entry.moment_bytes for e in tried)
    assert entry.offload or all(e.layout.offload_optimizer == "none" for e in tried)
    if p.best is not None:
        c = p.best.layout
        assert not entry.problems(name, c.stage, c.offload_optimizer != "none")
    else:
        assert name != "adamw" and p.advice[0].startswith(f"optim.name {name} runs under ZeRO ")
        assert "without offload" in p.advice[0]
        assert "optim.name adamw would: ZeRO-" in p.advice[0]


@pytest.mark.parametrize("name", ["adamw", "adamw8bit", "muon"])
def test_deepspeed_config_auto_with_every_optimizer_prepares_a_config_the_trainer_accepts(shards, name: str) -> None:
    """`train.deepspeed_config: auto` with each OPTIMIZERS entry: the planner's choice passes the trainer's checks
    of the DeepSpeed JSON against the optimizer (pipeline.train.setup.ds_config.resolve)."""
    from pipeline.train.setup.config import from_dict
    from pipeline.train.setup.ds_config import zero_stage
    from pipeline.train.setup.optimizers import OPTIMIZERS
    from pipeline.train.setup.prepare import prepare

    raw = {
        "data": {"path": str(shards)},
        "batch": {"micro_batch_size": 2, "global_batch_size": 4},
        "optim": {"name": name},
        "train": {"max_steps": 2, "deepspeed_config": "auto"},
    }
    prepared = prepare(from_dict(raw), 2, local_size=2)
    offloaded = (prepared.ds["zero_optimization"].get("offload_optimizer") or {}).get("device", "none") != "none"
    assert not OPTIMIZERS[name].problems(name, zero_stage(prepared.ds), offloaded)


@pytest.mark.parametrize("on_nonfinite", ["stop", "skip"])
def test_deepspeed_config_auto_never_chooses_what_the_trainer_refuses(tmp_path: Path, on_nonfinite: str) -> None:
    """`deepspeed_config: auto` planned for a GPU cluster (`plan --config`) with every optimizer entry, every
    train.kernels setting and every train.compile setting: the chosen configuration's DeepSpeed JSON passes the
    trainer's own checks (resolve), for a config whose other fields refuse some stages (on_nonfinite skip refuses
    ZeRO-0, compile true refuses ZeRO-3), and its plan prices the switches as they resolve for its stage."""
    import itertools

    import yaml

    from pipeline.model.kernels import KERNEL_SETTINGS, gpu_switches
    from pipeline.plan.ds_json import ds_config
    from pipeline.train import forecast
    from pipeline.train.setup.config import from_dict
    from pipeline.train.setup.ds_config import resolve
    from pipeline.train.setup.optimizers import OPTIMIZERS

    one_card = Cluster(1, 1, GPUS["4090d"], 128 * 10**9)
    seen_stages = set()
    for name, kernels, compiled in itertools.product(OPTIMIZERS, KERNEL_SETTINGS, (None, True, False)):
        raw = {
            "model": {"preset": "350m"},
            "data": {"path": str(tmp_path / "none")},
            "batch": {"micro_batch_size": 4, "global_batch_size": 64},
            "optim": {"name": name, **({"grad_clip": 1.0} if on_nonfinite == "skip" else {})},
            "train": {
                "max_steps": 10,
                "deepspeed_config": "auto",
                "kernels": kernels,
                "compile": compiled,
                "on_nonfinite": on_nonfinite,
            },
        }
        path = tmp_path / f"{name}-{kernels}-{compiled}.yaml"
        path.write_text(yaml.safe_dump(raw))
        f = forecast.forecast_config(str(path), [], one_card, seq_len=2048, layers=None, vocab_size=32000, mfu=None)
        cand = f.yours.layout
        cfg = from_dict(raw)
        cfg = replace(cfg, train=replace(cfg.train, activation_checkpointing=cand.activation_checkpointing))
        resolve(cfg, ds_config(cand), f.batch, accelerator="cuda")  # raises ConfigError on a refusal
        seen_stages.add(cand.stage)
        assert compiled is not True or cand.stage != 3
        assert on_nonfinite != "skip" or cand.stage != 0
        sw = gpu_switches(compiled, kernels, f.shape, cand.stage, cand.tiled_mlp > 1 or cand.sequence_parallel > 1)
        said = {figure: value for figure, value, _ in f.yours.assumed}.get("speed switches", "")
        assert ("compiled" in said) == sw.compiled and ("liger kernels" in said) == (sw.kernels == "liger")
    # the refusals the search avoided are real ones: ZeRO-0 with on_nonfinite skip, ZeRO-3 with compile true
    from pipeline.train.setup.prepare import trainer_refusals

    cfg = from_dict(raw | {"train": raw["train"] | {"compile": True}, "optim": raw["optim"] | {"name": "adamw"}})
    refused = trainer_refusals(cfg, f.batch, "cuda")
    assert any("compile" in p for p in refused(Layout(3, "cpu", "cpu", True, 4, 16)))
    assert bool(refused(Layout(0, "none", "none", False, 4, 16))) == (on_nonfinite == "skip")
    assert seen_stages


def test_sequence_parallelism_is_offered_only_where_it_keeps_the_models_attention() -> None:
    """Whole documents on SDPA's dense mask, a sliding window shorter than the sample off the varlen path, and a
    dynamic RoPE: sequence parallel 1 only (the trainer refuses the rest); on the varlen path whole documents and
    the window are offered every size."""
    from pipeline.model import PRESETS
    from pipeline.model.families import read_config, shape_from_config
    from pipeline.plan.cluster import Cluster, Stack
    from pipeline.plan.gpus import GPUS
    from pipeline.plan.search import sequence_sizes

    c = Cluster(1, 4, GPUS["4090d"], 120e9)
    shape = PRESETS["7b"]
    assert sequence_sizes(shape, 32768, c, Stack()) == (1, 2, 4)
    assert sequence_sizes(shape, 32768, c, Stack(whole_documents=True)) == (1,)
    assert sequence_sizes(shape, 32768, c, Stack(whole_documents=True, varlen=True)) == (1, 2, 4)
    dynamic = replace(shape, rope={"rope_type": "dynamic", "factor": 4.0})
    assert sequence_sizes(dynamic, 32768, c, Stack(varlen=True)) == (1,)
    mistral = shape_from_config(read_config("configs/hf/mistral-7b-v0.1.json"), "mistral")
    assert sequence_sizes(mistral, 32768, c, Stack()) == (1,)  # a 4096-token window at 32K
    assert sequence_sizes(mistral, 4096, c, Stack()) == (1, 2, 4)  # the window is the whole sample
    assert sequence_sizes(mistral, 32768, c, Stack(varlen=True)) == (1, 2, 4)


def test_a_tiled_zero3_configuration_keeps_the_mlp_gathered_across_tiles_and_is_priced_so() -> None:
    """Llama-3.1-70B at 32K on the seed cluster: every tiled ZeRO-3 configuration the search prices has a reuse
    distance of at least gate + up + down (3 x h x f parameters), writes it into its DeepSpeed JSON, and carries
    those three matrices gathered (1.31 GiB in bf16) in its buffers; with the old distance (max live) it is priced
    as gathering them again every tile instead."""
    from pipeline.model.families import read_config, shape_from_config
    from pipeline.plan.cluster import TRAINER, Cluster
    from pipeline.plan.ds_json import ds_config
    from pipeline.plan.estimate import estimate
    from pipeline.plan.gpus import GPUS
    from pipeline.plan.search import mlp_reuse, search
    from pipeline.plan.timing import _traffic

    shape = shape_from_config(read_config("configs/hf/llama-3.1-70b.json"), "llama-3.1-70b")
    c = Cluster(8, 1, GPUS["4090d"], 512e9, network_gbps=100)
    p = search(shape, 32768, c, 4 * 2**20, stack=TRAINER)
    tiled = [e for e in p.ranked + p.rejected if e.layout.tiled_mlp > 1 and e.layout.stage == 3]
    assert tiled
    matrices = mlp_reuse(shape)
    assert matrices == 3 * 8192 * 28672
    for e in tiled:
        assert e.layout.max_reuse >= matrices
        assert ds_config(e)["zero_optimization"]["stage3_max_reuse_distance"] >= matrices
    e = tiled[0]
    old = replace(e.layout, max_reuse=e.layout.max_live)
    kept, again = (estimate(shape, 32768, c, cand, stack=TRAINER) for cand in (e.layout, old))
    cand = e.layout
    live_before = 2 * min(cand.max_live, shape.layer_params() + cand.prefetch_bucket)  # the gathered layer's part
    assert kept.gpu["ds_buffers"] - again.gpu["ds_buffers"] == pytest.approx(2 * matrices - live_before, rel=1e-6)
    assert _traffic(shape, 32768, c, old)[0] > _traffic(shape, 32768, c, e.layout)[0]


def test_zero2_buckets_shrink_only_where_one_sample_does_not_fit() -> None:
    """DeepSpeed's 5e8 reduce bucket (4.5 bf16 copies: 4.19 GiB) is what ZeRO-1/2 runs with; where no micro-batch of
    one sample fits with it, the search tries 1e8 (0.84 GiB), and nowhere else: at 128K the 7B's ZeRO-2 plans need
    it, at 4K the choice keeps DeepSpeed's."""
    from pipeline.plan.search import BUCKET_SMALL

    for seq in (131072, 4096):
        p = search(PRESETS["7b"], seq, RENTED, stack=TRAINER)
        small = [e for e in p.ranked + p.rejected if e.layout.stage in (1, 2)]
        small = [e for e in small if e.layout.reduce_bucket == BUCKET_SMALL]
        assert small
        for e in small:  # its twin with DeepSpeed's buckets fits not even one sample
            big = replace(e.layout, reduce_bucket=5e8, micro_batch_size=1)
            assert not estimate(PRESETS["7b"], seq, RENTED, big, stack=TRAINER).fits
        assert p.best is not None
        if seq == 131072:
            assert p.best.layout.stage == 2 and p.best.layout.reduce_bucket == BUCKET_SMALL
        else:
            assert p.best.layout.reduce_bucket != BUCKET_SMALL or p.best.layout.stage == 3
