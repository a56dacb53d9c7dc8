"""pipeline.train.forecast: `pipeline plan --config` (the run about to launch) and `--from-run RUN` (the rates a
run measured come back out of its own files; the next plan for that cluster runs at them). The run folders are
written the way the trainer writes them for a GPU run whose true rates are known; a real CPU run's folder is in
tests/multiproc/test_plan_measured.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from pipeline.atomic import write_json, write_text
from pipeline.cli import main
from pipeline.model import PRESETS
from pipeline.plan.cluster import Stack
from pipeline.plan.search import search
from pipeline.plan.timing import (
    Rates,
    net_efficiency,
    offload_rate,
    step_time,
)
from pipeline.train import forecast
from pipeline.train.setup.config import dump, from_dict
from pipeline.train.setup.ds_config import batch_plan, load_ds_config, resolve

ROOT = Path(__file__).resolve().parents[3]


def test_a_configs_plan_says_what_each_offload_feature_would_bring_and_takes_opt_in() -> None:
    """`plan --config` on the Qwen recipe for the rented 4 x 4 cluster: the feature lines stand under the search's
    choice, and --opt-in lets that choice use bf16 states."""
    args = ["plan", "--config", str(ROOT / "configs/continue_qwen2.5-7b.yaml"), "--set"]
    args += ["model.init_from=" + str(ROOT / "configs/hf/qwen2.5-7b.json"), "--set", "batch.micro_batch_size=2"]
    args += ["--seq-len", "4096", "--hostfile", str(ROOT / "hostfiles/4node4gpu")]
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 0 and "bf16-states: not chosen; --opt-in bf16-states allows it" in r.output
    r = CliRunner().invoke(main, [*args, "--opt-in", "bf16-states"])
    # ZeRO-2's start-up (4 ranks each building the whole model in host memory) is over the nodes' RAM: ZeRO-3
    assert "the search would choose: ZeRO-3 + cpu offload (opt, params) + ckpt (offloaded) + bf16 master/states" in (
        r.output
    )


def test_plan_config_evaluates_the_run_about_to_launch(tmp_path) -> None:
    r = CliRunner().invoke(
        main, ["plan", "--config", "configs/70b_8node.yaml", "--hostfile", "hostfiles/8node", "--seq-len", "4096"]
    )
    assert r.exit_code == 0, r.output
    assert "your config: ZeRO-3 + cpu offload (opt, params) + ckpt (offloaded), micro 4 x GA 30" in r.output
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
    assert d["yours"]["config"]["max_live"] == 1e9 and d["search_best"]["fits"]


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


GPU_ENV = {
    "world_size": 1,
    "ranks_per_node": 1,
    "nodes": 1,
    "device": "NVIDIA GeForce RTX 4090 D",
    "device_memory_bytes": int(23.6 * 2**30),
    "host_ram_bytes": 512 * 10**9,
    "cpu_cores": 128,
}


def write_run(run_dir: Path, shards: Path, env: dict, rows: list[dict], micro: int = 32) -> None:
    world = env["world_size"]
    cfg = from_dict(
        {
            "run_dir": str(run_dir),
            "model": {"preset": "7b"},
            "data": {"path": str(shards)},
            "batch": {"micro_batch_size": micro, "global_batch_size": 512},
            "train": {
                "max_steps": 40,
                "activation_checkpointing": True,
                "deepspeed_config": str(ROOT / "ds_configs/plan-7b-8node.json"),
            },
        }
    )
    ds = resolve(cfg, load_ds_config(cfg.train.deepspeed_config), batch_plan(cfg, world, 64), accelerator="cuda")
    run_dir.mkdir(parents=True, exist_ok=True)
    write_text(run_dir / "config.yaml", dump(cfg))
    write_json(run_dir / "ds_config.json", ds)
    write_json(run_dir / "environment.json", env)
    write_text(run_dir / "metrics.jsonl", "".join(json.dumps(r) + "\n" for r in rows))


def rows_at(step_s: float, optimizer_s: float, n: int = 5) -> list[dict]:
    """Log lines as StepLogger writes them every 8 steps (512 sequences of 64 tokens each); the first (warm-up)
    is slower and left out."""
    tokens = 512 * 64
    out = []
    for i in range(n):
        s = step_s * (3.0 if i == 0 else 1.0)
        out.append(
            {"step": 8 * (i + 1), "loss": 5.0, "tokens_per_s": tokens / s, "mem_gib": 10.0}
            | {"step_s": s, "optimizer_s": optimizer_s * (3.0 if i == 0 else 1.0)}
        )
    return out


@pytest.fixture
def gpu_run(tmp_path: Path, shards: Path) -> tuple[Path, forecast.Forecast, float, float]:
    """7B on one RTX 4090D (ZeRO-3, optimizer and parameters offloaded, micro 32, as S1 of the published runs)
    whose true compute efficiency is 0.7x the fitted curve's (fetch likewise) and whose CPU Adam runs at 1.5e9
    parameters/s: the step and optimizer times those rates give."""
    run_dir = tmp_path / "runs/7b"
    write_run(run_dir, shards, GPU_ENV, rows_at(1.0, 1.0))
    f, _, _ = forecast.forecast_run(str(run_dir), None, mfu=None)
    c, cand = f.cluster, f.yours.layout
    fetch = 0.7 * offload_rate(c, Rates(), cand.pin_memory) / 1e9
    truth = Rates(efficiency_scale=0.7, offload_node_gbs=fetch, cpu_adam_params_per_s=1.5e9)
    t = step_time(f.shape, f.seq_len, c, cand, f.stack.resolved(f.shape, cand), truth, net_efficiency(c)[1])
    write_run(run_dir, shards, GPU_ENV, rows_at(t["total"], t["optimizer"]))
    return run_dir, f, t["total"], t["optimizer"]


def test_the_rates_a_run_measured_come_back_out_of_its_files(gpu_run) -> None:
    run_dir, f, step_s, opt_s = gpu_run
    r = CliRunner().invoke(main, ["plan", "--from-run", str(run_dir), "--json"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.output)
    assert d["step_time_s"]["measured"] == pytest.approx(step_s)  # the median of step_s, warm-up left out
    rates = d["measured_rates"]
    assert rates["efficiency_scale"] == pytest.approx(0.7, rel=1e-3)
    assert rates["cpu_adam_params_per_s"] == pytest.approx(1.5e9, rel=1e-3)
    assert "optimizer step" in rates["sources"]["CPU Adam"] and "run " in rates["sources"]["compute efficiency"]
    text = CliRunner().invoke(main, ["plan", "--from-run", str(run_dir)]).output
    assert "rates this run measured" in text and "the fitted curve x0.70" in text and "--model NAME" in text


def test_the_next_plan_for_that_cluster_runs_at_the_measured_rates(gpu_run) -> None:
    run_dir, f, _, _ = gpu_run
    r = CliRunner().invoke(main, ["plan", "--from-run", str(run_dir), "--model", "13b", "--seq-len", "4096", "--json"])
    assert r.exit_code == 0, r.output
    best = json.loads(r.output)["best"]
    sources = {a["figure"]: a["source"] for a in best["assumed"]}
    assert sources["compute efficiency"].startswith("measured: run") and "optimizer step" in sources["CPU Adam"]
    fitted = search(PRESETS["13b"], 4096, f.cluster).best
    assert fitted is not None
    # A slower card and slower CPU Adam than fitted: the calibrated plan is slower, never faster.
    assert best["tokens_per_s"] < fitted.tokens_per_s
    text = CliRunner().invoke(main, ["plan", "--from-run", str(run_dir), "--model", "13b"]).output
    assert "rates and cluster measured by --from-run" in text and "measured: run" in text


def test_measured_rates_are_refused_for_another_card_and_for_cpu_runs(gpu_run, tmp_path: Path, shards: Path) -> None:
    run_dir, _, _, _ = gpu_run
    r = CliRunner().invoke(main, ["plan", "--from-run", str(run_dir), "--model", "13b", "--gpu", "h100"])
    assert r.exit_code == 2 and "measured RTX 4090D; this plan is for H100 SXM" in r.output
    r = CliRunner().invoke(main, ["plan", "--from-run", str(run_dir), "--model", "13b", "--mfu", "0.4"])
    assert r.exit_code == 2 and "one of --mfu and --from-run" in r.output
    cpu_run = tmp_path / "runs/cpu"
    write_run(cpu_run, shards, GPU_ENV | {"device": "cpu", "device_memory_bytes": None}, rows_at(1.0, 0.1))
    r = CliRunner().invoke(main, ["plan", "--from-run", str(cpu_run), "--model", "13b"])
    assert r.exit_code == 2 and "a CPU run measures no GPU rates" in r.output


def test_a_run_from_before_optimizer_times_were_logged_keeps_the_fitted_cpu_adam(gpu_run, shards: Path) -> None:
    run_dir, _, step_s, _ = gpu_run
    rows = [{k: v for k, v in row.items() if k != "optimizer_s"} for row in rows_at(step_s, 0.0)]
    write_run(run_dir, shards, GPU_ENV, rows)
    d = json.loads(CliRunner().invoke(main, ["plan", "--from-run", str(run_dir), "--json"]).output)
    assert d["measured_rates"]["cpu_adam_params_per_s"] is None
    assert any("no optimizer_s" in n for n in d["notes"])


def test_a_run_whose_step_is_set_by_its_network_does_not_pretend_to_measure_compute(tmp_path, shards) -> None:
    """8 nodes at 512 tokens per micro-step: ZeRO-3's gathers over 100 Gbps are most of the step, so its time
    says next to nothing of the card's efficiency; the fitted curve is kept, and the report says why."""
    run_dir = tmp_path / "runs/net"
    eight = GPU_ENV | {"world_size": 8, "nodes": 8}
    write_run(run_dir, shards, eight, rows_at(1.0, 1.0), micro=8)
    f, _, _ = forecast.forecast_run(str(run_dir), None, mfu=None)
    t = step_time(
        f.shape,
        f.seq_len,
        f.cluster,
        f.yours.layout,
        Stack(),
        Rates(efficiency_scale=0.7),
        net_efficiency(f.cluster)[1],
    )
    write_run(run_dir, shards, eight, rows_at(t["total"], t["optimizer"]), micro=8)
    d = json.loads(CliRunner().invoke(main, ["plan", "--from-run", str(run_dir), "--json"]).output)
    assert d["measured_rates"]["efficiency_scale"] == 1.0 and "compute efficiency" not in d["measured_rates"]["sources"]
    assert any("set by its network" in n for n in d["notes"])
