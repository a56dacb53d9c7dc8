"""GPU benchmark, one script for a short lease (under 8 minutes on one H200):
  (1) the `1b` preset, seq 2048, ZeRO-2 bf16 on one GPU through pipeline/pretrain.py: tokens/s, MFU, peak memory;
  (2) Llama-2-70B geometry with 2 and 4 layers, ZeRO-3 with CPU offload, seq 4096, memory capped at 24 GiB
      (an RTX 4090D): peak memory and tokens/s;
each beside the planner's prediction for the same configuration. Anchors measured on the same H200: transformers'
Llama 1.1B at seq 2048, micro-batch 8: eager 48.6k tok/s, DeepSpeed ZeRO-2 as a user sets it up 46.1k; 70B
geometry, 4 layers, capped at 24 GiB: 1,769 tok/s at 5.9 GiB.
Usage (CUDA machine): python bench/gpu_bench.py [--out DIR]"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))


def run_case(name: str, shards: Path, work: Path, yaml: str, timeout: int) -> dict:
    cfg = work / f"{name}.yaml"
    cfg.write_text(yaml.format(run_dir=work / name, shards=shards, root=ROOT))
    cmd = [str(Path(sys.executable).parent / "deepspeed"), "--num_gpus", "1", "--master_port", "29611",
           str(ROOT / "pipeline/pretrain.py"), "--config", str(cfg)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    (work / f"{name}.log").write_text(res.stdout + res.stderr)
    rows = [json.loads(x) for x in (work / name / "metrics.jsonl").read_text().splitlines()] \
        if (work / name / "metrics.jsonl").exists() else []
    rows = [r for r in rows if "tokens_per_s" in r]
    if res.returncode != 0 or not rows:
        return {"name": name, "error": (res.stdout + res.stderr)[-1500:]}
    steady = rows[1:] or rows  # the first interval includes warm-up
    return {"name": name, "tokens_per_s": sum(r["tokens_per_s"] for r in steady) / len(steady),
            "mfu": steady[-1]["mfu"], "peak_gib": max(r["mem_gib"] for r in rows)}


BASE = """run_dir: {run_dir}
model: {{preset: PRESET, shape: SHAPE}}
data: {{path: {shards}, num_workers: 2, verify: false}}
batch: {{micro_batch_size: MICRO, global_batch_size: MICRO}}
optim: {{lr: 1.0e-4, min_lr: 1.0e-5, warmup_steps: 2}}
train: {{max_steps: STEPS, precision: bf16, activation_checkpointing: CKPT, deepspeed_config: {root}/ds_configs/DS,
        gpu_memory_cap_gib: CAP}}
eval: {{interval: 100000, batches: 0}}
checkpoint: {{interval: 100000, keep_last: 1}}
log: {{interval: 2, tensorboard: false}}
"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    from data_bench import synthetic_prefix

    from pipeline.data import shard as shard_stage
    from pipeline.data.config import ShardConfig
    from pipeline.model import PRESETS
    from pipeline.plan.gpus import GPUS
    from pipeline.plan.search import Candidate, Cluster, estimate

    work = Path(tempfile.mkdtemp(prefix="gpubench-"))
    prefix = synthetic_prefix(work, 3_000_000)
    shards = {}
    for seq in (2048, 4096):
        shards[seq] = work / f"shards{seq}"
        shard_stage.run(ShardConfig(sources=((str(prefix), 1.0),), output=str(shards[seq]), seq_len=seq,
                                    split=(98.0, 1.0, 1.0), progress=False))
    h200 = GPUS["h200"]
    cases = [("1b_zero2", 2048, "1b", "{}", 8, 12, "false", "zero2.json", "null", h200, 2, "none", "none", False)]
    for layers in (2, 4):
        cases.append((f"70b_{layers}layers_offload_24gib", 4096, "70b", f"{{num_layers: {layers}}}", 1, 8, "true",
                      "zero3_offload.json", "24", replace(h200, memory_gib=24.0), 3, "cpu", "cpu", True))
    results = []
    for name, seq, preset, shape, micro, steps, ckpt, dsf, cap, card, stage, oo, op, ck in cases:
        yaml = (BASE.replace("PRESET", preset).replace("SHAPE", shape).replace("MICRO", str(micro))
                .replace("STEPS", str(steps)).replace("CKPT", ckpt).replace("DS", dsf).replace("CAP", cap))
        r = run_case(name, shards[seq], work, yaml, timeout=200)
        s = replace(PRESETS[preset], vocab_size=32000)
        if "num_layers" in shape:
            s = replace(s, num_layers=int(shape.split(":")[1].strip(" }")))
        rb, pb, ml = (1e8, 1e8, 3e8) if stage == 3 else (5e8, 5e7, 1e9)
        e = estimate(s, seq, Cluster(1, 1, card, 125 * 10**9), Candidate(stage, oo, op, ck, micro, 1, rb, pb, ml, 1e8))
        r.update({"plan_tokens_per_s": e.tokens_per_s, "plan_peak_gib": e.gpu["total"] / 2**30})
        results.append(r)
        print(json.dumps(r), flush=True)
    print("| case | tokens/s | planned | peak GiB | planned GiB | MFU |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in results:
        if "error" in r:
            print(f"| {r['name']} | failed | | | | |")
            continue
        mfu = f"{r['mfu']:.1%}" if r.get("mfu") else "n/a"
        print(f"| {r['name']} | {r['tokens_per_s']:,.0f} | {r['plan_tokens_per_s']:,.0f} | {r['peak_gib']:.2f} | "
              f"{r['plan_peak_gib']:.2f} | {mfu} |")
    Path(args.out, "gpu_bench.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
