"""Stage 3 through the real `deepspeed` launcher with 2 CPU ranks: ZeRO 1-3 and offload train; losses match a
plain PyTorch AdamW loop; runs are deterministic; kill-and-resume and SIGTERM behave."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pipeline.data.loader import ShardedDataset, collate_samples, rank_batches
from pipeline.model import llama_config, resolve_shape
from pipeline.train.checkpoint import files as ckpt
from pipeline.train.setup.config import load
from pipeline.train.setup.schedule import lr_at
from tests.multiproc import launch
from tests.multiproc.conftest import STEPS

pytestmark = pytest.mark.slow


def reference_losses(config: Path, shards: Path) -> list[float]:
    """Plain single-process PyTorch: same init, same global batches, torch AdamW, same clipping and schedule."""
    from transformers import LlamaForCausalLM

    from pipeline.train.engine import param_groups
    from pipeline.train.runtime.weights import init_weights
    from pipeline.train.step import lm_loss

    cfg = load(config)
    ds = ShardedDataset(shards, "train")
    tok = ds.manifest["tokenizer"]
    shape = resolve_shape(cfg.model.preset, {}, tok["vocab_size"])
    model = LlamaForCausalLM(llama_config(shape, bos_id=tok["bos_id"], eos_id=tok["eos_id"], pad_id=tok["pad_id"]))
    init_weights(model, cfg.train.seed, 0, stage3=False)
    o = cfg.optim
    opt = torch.optim.AdamW(param_groups(model, o.weight_decay), lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps)
    micro, global_batch = cfg.batch.micro_batch_size, cfg.batch.global_batch_size
    assert global_batch is not None
    n_micro = global_batch // micro
    it = rank_batches(len(ds), cfg.train.seed, micro, 1, 0, 0)
    out = []
    for step in range(STEPS):
        for g in opt.param_groups:
            g["lr"] = lr_at(step, cfg, STEPS)
        opt.zero_grad()
        total = 0.0
        for _ in range(n_micro):
            batch = collate_samples(ds, next(it))
            loss, loss_total, tokens = lm_loss(model(input_ids=batch["input_ids"]).logits, batch["labels"])
            (loss / n_micro).backward()
            total += float(loss_total) / tokens
        torch.nn.utils.clip_grad_norm_(model.parameters(), o.grad_clip)
        opt.step()
        out.append(total / n_micro)
    return out


def test_zero_stages_match_plain_pytorch_and_loss_falls(zero_runs: dict[int, Path], shards: Path) -> None:
    ref = reference_losses(zero_runs[1].parent / "zero1.yaml", shards)
    assert ref[-1] < ref[0] - 0.5
    for stage, run_dir in zero_runs.items():
        got = launch.losses(run_dir)
        assert sorted(got) == list(range(1, STEPS + 1))
        for step in range(1, STEPS + 1):
            r, g = ref[step - 1], got[step]
            assert abs(g - r) / abs(r) < 1e-5, f"ZeRO-{stage} step {step}: {g} vs reference {r}"
        assert got[STEPS] < got[1] - 0.5, f"ZeRO-{stage} loss did not fall: {got[1]} -> {got[STEPS]}"


def test_zero3_builds_under_zero_init_and_logs_validation(zero_runs: dict[int, Path]) -> None:
    run_dir = zero_runs[3]
    assert (run_dir / "ds_config.json").exists() and (run_dir / "config.yaml").exists()
    val = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if "val_loss" in line]
    assert [v["step"] for v in val] == [10, 20]
    assert ckpt.complete_tags(run_dir) == ["step00000015", "step00000020"]  # keep_last 2
    assert (run_dir / "latest").read_text() == "step00000020"
    assert list((run_dir / "tb").iterdir()), "TensorBoard events written"
    marker = ckpt.read_marker(run_dir, "step00000020")
    assert marker["consumed_samples"] == 20 * 8 and marker["world_size"] == 2


def test_kill_and_resume_gives_identical_losses(zero_runs: dict[int, Path], shards: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "killed"
    cfg = launch.write_config(tmp_path / "k.yaml", run_dir=run_dir, shards=shards, ds_config="zero1.json", steps=STEPS)
    # rank 0 SIGKILLs itself right after step 7; the launcher then takes the other rank down
    proc = launch.start(cfg, tmp_path / "first.log", extra_env={"PIPELINE_FAULT_KILL_AT_STEP": "7"})
    launch.wait_group(proc)
    assert proc.returncode != 0
    assert ckpt.latest_complete(run_dir) == "step00000005"
    before = launch.losses(run_dir)
    out = launch.run(cfg)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "resumed from" in out.stdout + out.stderr
    uninterrupted, resumed = launch.losses(zero_runs[1]), launch.losses(run_dir)
    assert sorted(resumed) == list(range(1, STEPS + 1))
    # bit for bit: the same config and seed give the same losses, and resuming changes nothing
    assert all(before[s] == uninterrupted[s] for s in range(1, 8))
    assert all(resumed[s] == uninterrupted[s] for s in range(1, STEPS + 1)), [
        (s, resumed[s], uninterrupted[s]) for s in range(1, STEPS + 1) if resumed[s] != uninterrupted[s]
    ]


def test_compiled_layers_give_the_eager_losses(zero_runs: dict[int, Path], shards: Path, tmp_path: Path) -> None:
    """train.compile (torch.compile per decoder layer) under ZeRO-2 gives the eager run's losses (fp32, 1e-5). The
    GPU-only switches asked for in the same run (Liger kernels, cuDNN attention) say what the CPU used instead."""
    run_dir = tmp_path / "compiled"
    cfg = launch.write_config(
        tmp_path / "c.yaml", run_dir=run_dir, shards=shards, ds_config="zero2.json", steps=STEPS, ckpt_interval=STEPS
    )
    sets = ("train.compile=true", "train.kernels=liger", "train.attention=cudnn")
    out = launch.run(cfg, sets=sets, extra_env=launch.env(compile=True))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    said = out.stdout + out.stderr
    assert "compile: on (asked for)" in said
    assert "kernels: liger asked for, but its kernels are Triton kernels for CUDA GPUs" in said
    assert "attention: cudnn is a CUDA kernel; on cpu torch's own SDPA choice is used instead" in said
    speed = json.loads((run_dir / "environment.json").read_text())["speed"]
    assert (speed["compile"], speed["attention"], speed["kernels"], speed["fused_loss"]) == (
        True,
        "torch",
        "torch",
        False,
    )
    got, eager = launch.losses(run_dir), launch.losses(zero_runs[2])
    for step in range(1, STEPS + 1):
        assert abs(got[step] - eager[step]) <= 1e-5 * abs(eager[step]), (step, got[step], eager[step])


def test_adamw8bit_trains_under_zero2(shards: Path, tmp_path: Path) -> None:
    """bitsandbytes' 8-bit AdamW as the client optimizer of ZeRO-2 (DeepSpeed calls it untested): trains, saves."""
    run_dir = tmp_path / "bnb"
    cfg = launch.write_config(
        tmp_path / "b.yaml", run_dir=run_dir, shards=shards, ds_config="zero2.json", steps=8, ckpt_interval=8, extra=""
    )
    out = launch.run(cfg, sets=("optim.name=adamw8bit",))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    got = launch.losses(run_dir)
    assert got[6] < got[1] - 0.2, got
    ds = json.loads((run_dir / "ds_config.json").read_text())
    assert ds["zero_allow_untested_optimizer"] is True and "optimizer" not in ds
    assert ckpt.latest_complete(run_dir) == "step00000008"


def test_sigterm_saves_a_checkpoint_and_stops(shards: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "term"
    cfg = launch.write_config(
        tmp_path / "t.yaml", run_dir=run_dir, shards=shards, ds_config="zero2.json", steps=100000, ckpt_interval=100000
    )
    proc = launch.start(cfg, tmp_path / "term.log")
    launch.wait_for_step(run_dir, 3, proc)
    launch.kill_group(proc, signal.SIGTERM)  # what a scheduler does on preemption
    launch.wait_group(proc)
    log = (tmp_path / "term.log").read_text()
    assert "stopped by signal" in log, log[-3000:]
    tag = ckpt.latest_complete(run_dir)
    assert tag is not None and int(tag[4:]) >= 3
    assert ckpt.read_marker(run_dir, tag)["step"] == int(tag[4:])


def test_zero3_cpu_offload_trains_and_resumes_bit_for_bit(shards: Path, tmp_path: Path) -> None:
    import shutil

    run_dir = tmp_path / "offload"
    cfg = launch.write_config(
        tmp_path / "o.yaml", run_dir=run_dir, shards=shards, ds_config="zero3_offload.json", steps=10, ckpt_interval=5
    )
    out = launch.run(cfg)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    got = launch.losses(run_dir)
    assert got[10] < got[1] - 0.3
    ds = json.loads((run_dir / "ds_config.json").read_text())
    assert ds["zero_optimization"]["offload_param"]["device"] == "cpu"
    assert ckpt.latest_complete(run_dir) == "step00000010"
    # resume from step 5 in a copy: DeepSpeedCPUAdam's running beta^t is rebuilt, so the losses match exactly
    resumed_dir = tmp_path / "resumed"
    shutil.copytree(run_dir, resumed_dir)
    shutil.rmtree(resumed_dir / "step00000010")
    cfg2 = launch.write_config(
        tmp_path / "o2.yaml",
        run_dir=resumed_dir,
        shards=shards,
        ds_config="zero3_offload.json",
        steps=10,
        ckpt_interval=5,
    )
    out = launch.run(cfg2)
    assert out.returncode == 0 and "resumed from" in out.stdout + out.stderr, out.stderr[-3000:]
    again = launch.losses(resumed_dir)
    assert [again[s] for s in range(6, 11)] == [got[s] for s in range(6, 11)]


def test_zero3_nvme_offload_trains_and_resumes(shards: Path, tmp_path: Path) -> None:
    """ZeRO-Infinity (ds_configs/zero3_nvme.json): optimizer states and parameters swapped to a folder through
    DeepSpeed's async_io op; trains and checkpoints. A resume is refused with the reason: DeepSpeed 0.19.8 resumes
    these checkpoints from freshly initialised weights (measured: the resumed loss returned to the first step's)."""
    import shutil

    from deepspeed.ops.op_builder import AsyncIOBuilder

    if not AsyncIOBuilder().is_compatible():
        pytest.skip("DeepSpeed's async_io op cannot build here (libaio-dev missing; .ci/run installs it)")
    swap = tmp_path / "nvme"
    swap.mkdir()
    ds = json.loads((launch.ROOT / "ds_configs" / "zero3_nvme.json").read_text())
    for key in ("offload_optimizer", "offload_param"):
        ds["zero_optimization"][key]["nvme_path"] = str(swap)
    ds_file = tmp_path / "nvme.json"
    ds_file.write_text(json.dumps(ds))
    run_dir = tmp_path / "run"
    cfg = launch.write_config(
        tmp_path / "n.yaml", run_dir=run_dir, shards=shards, ds_config=str(ds_file), steps=6, ckpt_interval=3
    )
    out = launch.run(cfg)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    got = launch.losses(run_dir)
    assert got[6] < got[1] - 0.2, got
    # DeepSpeed's swappers made their per-rank folders there (they delete their files when they are done).
    for part in ("optimizer", "float32params"):
        assert {p.name for p in (swap / "zero_stage_3" / part).iterdir()} == {"rank0", "rank1"}
    assert (run_dir / "step00000006" / "offloaded_tensors").is_dir()  # DeepSpeed's copy of the swap files
    resumed = tmp_path / "resumed"
    shutil.copytree(run_dir, resumed)
    shutil.rmtree(resumed / "step00000006")
    cfg2 = launch.write_config(
        tmp_path / "n2.yaml", run_dir=resumed, shards=shards, ds_config=str(ds_file), steps=6, ckpt_interval=3
    )
    out = launch.run(cfg2)
    assert out.returncode != 0 and "offloads the optimizer to NVMe" in out.stdout + out.stderr, out.stderr[-3000:]


def test_resume_refuses_other_data(zero_runs: dict[int, Path], tmp_path: Path, tokenized: Path) -> None:
    from pipeline.data import shard as shard_stage
    from pipeline.data.config import ShardConfig

    other = tmp_path / "other"
    shard_stage.run(
        ShardConfig(
            sources=((str(tokenized), 1.0),),
            output=str(other),
            seq_len=64,
            split=(80.0, 10.0, 10.0),
            seed=99,
            progress=False,
        )
    )
    cfg = launch.write_config(
        tmp_path / "r.yaml", run_dir=zero_runs[2], shards=other, ds_config="zero2.json", steps=STEPS + 2
    )
    out = launch.run(cfg)  # the ranks' own check (a launch with `deepspeed` directly): rank 0 decides, says it once
    text = out.stderr + out.stdout
    assert out.returncode == 2 and text.count("cannot resume") == 1, text[-3000:]
    assert "data.path holds other shards than the checkpoint was trained on" in text


def test_planner_written_configs_train(shards: Path, tmp_path: Path) -> None:
    """`deepspeed_config: auto` (the planner chooses for this machine) and a `pipeline plan --write-ds-config`
    file both train through the launcher. The auto run plans for an emulated card (train.gpu_memory_cap_gib,
    computed from the planner between its smallest untiled and tiled configurations) that only a tiled MLP fits:
    the launched run tiles, and its log, config.yaml and environment.json say so; what was priced is what trains."""
    from click.testing import CliRunner

    from pipeline.cli import main
    from pipeline.train.setup.config import from_dict
    from pipeline.train.setup.prepare import prepare
    from tests.unit.train.setup.test_prepare import TILES_MODEL, tiles_only_cap

    written = tmp_path / "planned.json"
    r = CliRunner().invoke(
        main,
        [
            "plan",
            "--model",
            "70b",
            "--hostfile",
            str(launch.ROOT / "hostfiles/8node"),
            "--write-ds-config",
            str(written),
        ],
    )
    assert r.exit_code == 0, r.output
    # the written file with what the command says to set beside it (its choice offloads checkpointed activations)
    assert "train.activation_checkpointing: true" in r.output
    checkpointing = "train.activation_checkpointing=true"
    raw = {
        "model": {"shape": TILES_MODEL},
        "data": {"path": str(shards)},
        "batch": {"micro_batch_size": 2, "global_batch_size": 8},
        "train": {"max_steps": 3, "deepspeed_config": "auto", "loss_chunk_tokens": 48},
    }
    cap = tiles_only_cap(prepare(from_dict(raw), 2, local_size=2))
    tiles_model = "{shape: {" + ", ".join(f"{k}: {v}" for k, v in TILES_MODEL.items()) + "}}"
    for name, sets, model in (
        ("auto", ["train.deepspeed_config=auto", f"train.gpu_memory_cap_gib={cap!r}"], tiles_model),
        ("written", [f"train.deepspeed_config={written}", checkpointing], "{preset: tiny}"),
    ):
        run_dir = tmp_path / name
        cfg = launch.write_config(
            tmp_path / f"{name}.yaml",
            run_dir=run_dir,
            shards=shards,
            ds_config="zero1.json",
            steps=3,
            ckpt_interval=3,
            model=model,
        )
        if name == "auto":  # as a user starts it: `pipeline pretrain` plans, then launches the ranks
            out = subprocess.run(
                [str(Path(sys.executable).parent / "pipeline"), "pretrain", "--config", str(cfg), "--num-gpus", "2"]
                + ["--master-port", str(launch.free_port()), *(a for s in sets for a in ("--set", s))],
                env=launch.env(),
                capture_output=True,
                text=True,
                timeout=900,
                cwd=launch.ROOT,
            )
        else:
            out = launch.run(cfg, sets=tuple(sets))
        log = out.stdout + out.stderr
        assert out.returncode == 0, log[-3000:]
        assert ckpt.latest_complete(run_dir) == "step00000003"
        assert json.loads((run_dir / "ds_config.json").read_text())["train_batch_size"] == 8
        if name == "auto":
            assert "tiled MLP: each layer's MLP in 4 tiles along the sequence" in log
            env = json.loads((run_dir / "environment.json").read_text())
            assert env["long_context"]["tiled_mlp"] == 4
            # searched once, by the command that launched the ranks, not again on each rank
            assert env.get("planned_by") == "pipeline pretrain, before the launch" and "--planned <the layout" in log, (
                log[-6000:]
            )
            assert "tiled_mlp: 4" in (run_dir / "config.yaml").read_text()


@pytest.mark.parametrize("stage, optimizer", [(1, "BF16_Optimizer"), (3, "DeepSpeedZeroOptimizer_Stage3")])
def test_bf16_runs_accumulate_gradients_in_fp32_train_resume_and_evaluate(
    shards: Path, tmp_path: Path, stage: int, optimizer: str
) -> None:
    """With gradient accumulation (micro 2 x 2 ranks x GA 2) a bf16 run sums its micro-step gradients in fp32
    (data_types.grad_accum_dtype), which under ZeRO-1 is DeepSpeed's BF16_Optimizer: it trains, resumes from its
    checkpoint with the uninterrupted losses, and evaluates."""
    import shutil

    from pipeline.evaluate.inputs import EvalConfig
    from pipeline.evaluate.run import run as evaluate_run

    run_dir = tmp_path / "run"
    cfg = launch.write_config(
        tmp_path / "b.yaml", run_dir=run_dir, shards=shards, ds_config=f"zero{stage}.json", steps=6, ckpt_interval=3
    )
    sets = ("train.precision=bf16",)
    out = launch.run(cfg, sets=sets)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    ds = json.loads((run_dir / "ds_config.json").read_text())
    env = json.loads((run_dir / "environment.json").read_text())
    assert ds["gradient_accumulation_steps"] == 2 and ds["data_types"]["grad_accum_dtype"] == "fp32"
    assert env["optimizer"] == optimizer and env["grad_accum_dtype"] == "fp32", env
    got = launch.losses(run_dir)
    assert got[6] < got[1] - 0.2, got
    resumed = tmp_path / "resumed"
    shutil.copytree(run_dir, resumed)
    shutil.rmtree(resumed / "step00000006")
    cfg2 = launch.write_config(
        tmp_path / "b2.yaml", run_dir=resumed, shards=shards, ds_config=f"zero{stage}.json", steps=6, ckpt_interval=3
    )
    out = launch.run(cfg2, sets=sets)
    assert out.returncode == 0 and "resumed from" in out.stdout + out.stderr, out.stderr[-3000:]
    again = launch.losses(resumed)
    assert [again[s] for s in (4, 5, 6)] == [got[s] for s in (4, 5, 6)]
    res = evaluate_run(
        EvalConfig(checkpoint=str(run_dir), max_batches=2, max_new_tokens=4, output=str(tmp_path / "e.json"))
    )
    assert res["tokens"] > 0 and res["loss"] < got[1]


def test_validation_on_a_blend_logs_each_sources_loss(two_sources: Path, tmp_path: Path) -> None:
    """On shards of two sources every validation also logs each source's loss over its own samples
    (`val_loss/first`, `val_loss/second` in metrics.jsonl and TensorBoard, both on the log line); the total lies
    between them, as a token-weighted mean does."""
    run_dir = tmp_path / "run"
    cfg = launch.write_config(
        tmp_path / "c.yaml", run_dir=run_dir, shards=two_sources, ds_config="zero2.json", steps=4, ckpt_interval=100
    )
    out = launch.run(cfg, sets=("eval.interval=2", "eval.batches=3"))
    assert out.returncode == 0, out.stderr[-3000:]
    val = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if "val_loss" in x]
    assert [v["step"] for v in val] == [2, 4]
    for v in val:
        first, second = v["val_loss/first"], v["val_loss/second"]
        assert first != second and min(first, second) <= v["val_loss"] <= max(first, second), v
    assert "val loss" in out.stdout + out.stderr and " | first " in out.stdout + out.stderr
