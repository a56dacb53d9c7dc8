"""What DeepSpeed 0.19's offload features that change the numerics cost in quality: the demo's model and data
(3.4M-parameter Llama, Shakespeare, seq 256, 16 sequences per step, 540 steps) trained in bf16 with ZeRO-2 and the
optimizer offloaded to CPU Adam, once per arm, on 2 CPU ranks through `pipeline pretrain`, and the loss curves
side by side:

  fp32-states   fp32 master weights, gradients and Adam moments (DeepSpeed's default): the reference
  bf16-master   bf16.bf16_master_weights_and_grads
  bf16-states   bf16.bf16_master_weights_and_grads + bf16.bf16_optimizer_states
  zenflow       ZenFlow (topk_ratio 0.1; the other columns every 2 steps) at micro 4 x 2 ranks, 1080 steps of 8
                sequences: the same tokens, and 16 sequences per full update like the reference's steps

Then continued pretraining, the case these clusters run: the reference's model exported, trained on for
--continue-steps at a continued run's learning rate (2e-5 to 2e-6, as configs/continue_qwen2.5-7b.yaml) with fp32
states, bf16 master weights, and bf16 master weights and states. There an update is a far smaller share of its
weight than in the first phase, which is where a bf16 master weight (8 bits of mantissa) can drop it.

Writes bench/results/offload-quality-<date>.json (or --out) and prints a table: the validation loss at each
evaluation and the final one, each beside the reference's. The arms differ only in the numerics (CPU ranks run
every feature's arithmetic; their speed is a GPU question, bench/gpu_bench.py). Usage:
python bench/offload_quality.py [--steps 540] [--arms fp32-states bf16-states ...] [--out FILE]"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
SHARDS = ROOT / "data" / "shards-256"
ZENFLOW = {
    "topk_ratio": 0.1,
    "select_strategy": "step",
    "select_interval": 2,
    "update_interval": 2,
    "overlap_step": False,
    "full_warm_up_rounds": 0,
}
ARMS: dict[str, dict[str, Any]] = {
    "fp32-states": {},
    "bf16-master": {"bf16": {"bf16_master_weights_and_grads": True}},
    "bf16-states": {"bf16": {"bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}},
    "zenflow": {"zero_optimization": {"zenflow": ZENFLOW}},
}


def arm_config(name: str, steps: int, work: Path, init_from: Path | None = None) -> Path:
    """The demo's config in bf16 with ZeRO-2 + CPU optimizer offload and the arm's DeepSpeed sections; with
    `init_from`, continued pretraining of that model at a continued run's learning rate (run `cont-NAME`)."""
    ds = json.loads((ROOT / "ds_configs" / "zero2.json").read_text())
    ds["zero_optimization"]["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    for section, values in ARMS[name].items():
        ds.setdefault(section, {}).update(values)
    if init_from is not None:
        name = f"cont-{name}"
    ds_path = work / f"{name}.ds.json"
    ds_path.write_text(json.dumps(ds, indent=2))
    cfg = yaml.safe_load((ROOT / "configs" / "demo.yaml").read_text())
    cfg["run_dir"] = str(work / name)
    cfg["data"]["path"] = str(SHARDS)
    cfg["train"].update({"precision": "bf16", "deepspeed_config": str(ds_path), "max_steps": steps})
    cfg["eval"] = {"interval": steps // 6, "batches": 8}
    cfg["checkpoint"] = {"enabled": name == "fp32-states", "interval": steps, "keep_last": 1}  # the base model
    cfg["log"] = {"interval": 10, "tensorboard": False}
    if init_from is not None:
        cfg["model"] = {"init_from": str(init_from)}
        cfg["optim"].update({"lr": 2e-5, "min_lr": 2e-6, "warmup_steps": 10})
        cfg["checkpoint"] = {"enabled": False}
    if name == "zenflow":  # one micro-step per step: twice the steps of half the sequences, the same tokens
        cfg["batch"] = {"micro_batch_size": 4, "global_batch_size": 8}
        cfg["train"]["max_steps"] = 2 * steps
        cfg["optim"]["warmup_steps"] = 2 * cfg["optim"]["warmup_steps"]
        cfg["eval"]["interval"] = 2 * cfg["eval"]["interval"]
    path = work / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def run_arm(name: str, steps: int, work: Path, init_from: Path | None = None) -> dict[str, Any]:
    cfg = arm_config(name, steps, work, init_from)
    if init_from is not None:
        name = f"cont-{name}"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", "PYTHONUNBUFFERED": "1"}
    pipeline = str(Path(sys.executable).parent / "pipeline")
    t0 = time.perf_counter()
    with open(work / f"{name}.log", "w") as log:
        code = subprocess.call(
            [pipeline, "pretrain", "--config", str(cfg), "--num-gpus", "2"], env=env, stdout=log, stderr=log
        )
    wall = time.perf_counter() - t0
    if code != 0:
        return {"error": f"exit code {code}: " + (work / f"{name}.log").read_text()[-2000:]}
    records = [json.loads(x) for x in (work / name / "metrics.jsonl").read_text().splitlines()]
    scale = 2 if name == "zenflow" else 1  # its steps are half steps: report them at the reference's step
    train = {r["step"] // scale: r["loss"] for r in records if "loss" in r and r["step"] % scale == 0}
    val = {r["step"] // scale: r["val_loss"] for r in records if "val_loss" in r}
    return {"train_loss": train, "val_loss": val, "final_val_loss": val[max(val)], "wall_s": wall}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=540)
    ap.add_argument("--arms", nargs="+", choices=sorted(ARMS), default=list(ARMS))
    ap.add_argument("--continue-steps", type=int, default=240, help="0: no continued-pretraining phase")
    ap.add_argument("--out", default=None)
    ap.add_argument("--work", default=str(ROOT / "runs" / "bench-offload-quality"))
    args = ap.parse_args(argv)
    if not (SHARDS / "manifest.json").exists():  # the demo's data, as `make demo` makes it
        subprocess.check_call(["make", "-C", str(ROOT), "data/shards-256/manifest.json"])
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    results = {}
    for name in args.arms:
        print(f"{name}: training {args.steps} steps ...", flush=True)
        results[name] = run_arm(name, args.steps, work)
        print(f"  {json.dumps({k: v for k, v in results[name].items() if k in ('final_val_loss', 'wall_s', 'error')})}")
    if args.continue_steps and "error" not in results.get("fp32-states", {"error": "not run"}):
        base = work / "base-export"
        pipeline = str(Path(sys.executable).parent / "pipeline")
        subprocess.check_call([pipeline, "export", "--checkpoint", str(work / "fp32-states"), "--output", str(base)])
        for name in ("fp32-states", "bf16-master", "bf16-states"):
            print(f"cont-{name}: continued pretraining, {args.continue_steps} steps at lr 2e-5 ...", flush=True)
            results[f"cont-{name}"] = run_arm(name, args.continue_steps, work, init_from=base)
    lines = []
    for phase, ref_name in (("", "fp32-states"), ("cont-", "cont-fp32-states")):
        arms = {k: v for k, v in results.items() if k.startswith("cont-") == bool(phase)}
        if not arms:
            continue
        ref = results.get(ref_name, {}).get("val_loss", {})
        lines.append(f"{'arm':18s} {'final val loss':>14s} {'vs ' + ref_name:>20s}   val loss at steps {sorted(ref)}")
        for name, r in arms.items():
            if "error" in r:
                lines.append(f"{name:18s} failed: {r['error'][:200]}")
                continue
            delta = r["final_val_loss"] - ref[max(ref)] if ref else float("nan")
            curve = " ".join(f"{r['val_loss'][s]:.4f}" for s in sorted(r["val_loss"]))
            lines.append(f"{name:18s} {r['final_val_loss']:14.4f} {delta:+20.4f}   {curve}")
    print("\n".join(lines))
    doc = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores (CPU ranks: the numerics, not the speed)",
        "setup": "demo model and data, bf16, ZeRO-2 + CPU optimizer offload, 2 CPU ranks, 16 sequences x 256 tokens "
        f"per step (zenflow: 8 per step, 16 per full update), {args.steps} steps; continued: fp32-states' model, "
        f"{args.continue_steps} steps at lr 2e-5 -> 2e-6",
        "arms": results,
        "table": lines,
    }
    out = Path(args.out or ROOT / "bench" / "results" / f"offload-quality-{doc['date']}.json")
    out.write_text(json.dumps(doc, indent=1))
    print(f"wrote {out}")
    return 0 if all("error" not in r for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
