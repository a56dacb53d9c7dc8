"""CPU training throughput of `pipeline pretrain` beside a plain PyTorch loop on the same model and batch, in one
run: the `tiny` preset, vocabulary 4,000, micro-batch 16, seq 128, fp32, ZeRO-1, through the real launcher.

Prints a table and writes bench/results/cpu-<date>.json. Usage: python bench/cpu_bench.py [--steps 60]
Ratios, not absolute figures, are what carry from machine to machine."""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from pipeline.atomic import write_json
from pipeline.data import shard as shard_stage
from pipeline.data.config import ShardConfig
from pipeline.data.indexed import IndexedWriter
from pipeline.data.loader import ShardedDataset, collate_samples, rank_batches
from pipeline.model import build_model, resolve_shape
from pipeline.train.engine import param_groups
from pipeline.train.step import lm_loss

ROOT = Path(__file__).resolve().parents[1]
VOCAB, SEQ, MICRO = 4000, 128, 16


def synthetic_shards(work: Path, tokens: int = 3_000_000) -> Path:
    rng = np.random.default_rng(0)
    prefix = work / "corpus"
    w = IndexedWriter(Path(str(prefix) + ".bin"), np.dtype(np.uint16))
    lengths = rng.integers(100, 2000, tokens // 1000).astype(np.int32)
    w.add_many(lengths, rng.integers(4, VOCAB, int(lengths.sum())).astype(np.uint16))
    w.finish(Path(str(prefix) + ".idx"))
    write_json(
        str(prefix) + ".manifest.json",
        {
            "tokenizer": {
                "path": "synthetic",
                "sha256": "0" * 64,
                "kind": "none",
                "vocab_size": VOCAB,
                "eos_id": 2,
                "bos_id": 1,
                "pad_id": 3,
            },
            "dtype": "uint16",
            "totals": {"documents": w.documents, "tokens": w.tokens},
        },
    )
    out = work / "shards"
    shard_stage.run(
        ShardConfig(sources=((str(prefix), 1.0),), output=str(out), seq_len=SEQ, split=(98.0, 1.0, 1.0), progress=False)
    )
    return out


def plain_pytorch(shards: Path, steps: int, warmup: int) -> float:
    """Tokens/s of a plain loop: same model, batch and data, torch AdamW, one process (as many threads as a rank)."""
    torch.manual_seed(0)
    model = build_model(resolve_shape("tiny", {}, VOCAB))
    opt = torch.optim.AdamW(param_groups(model, 0.1), lr=1e-3)
    ds = ShardedDataset(shards, "train")
    it = rank_batches(len(ds), 1234, MICRO, 1, 0)
    t0 = 0.0
    for step in range(steps):
        if step == warmup:
            t0 = time.perf_counter()
        batch = collate_samples(ds, next(it))
        loss, _, _ = lm_loss(model(input_ids=batch["input_ids"]).logits, batch["labels"])
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    return (steps - warmup) * MICRO * SEQ / (time.perf_counter() - t0)


def pipeline_run(shards: Path, work: Path, ranks: int, steps: int, warmup: int) -> float:
    """Tokens/s over all ranks after `warmup` steps, from the run's own metrics.jsonl (one line per step)."""
    run_dir = work / f"run{ranks}"
    cfg = work / f"run{ranks}.yaml"
    cfg.write_text(f"""run_dir: {run_dir}
model: {{preset: tiny}}
data: {{path: {shards}, num_workers: 1, verify: false}}
batch: {{micro_batch_size: {MICRO}, global_batch_size: {MICRO * ranks}}}
optim: {{lr: 1.0e-3, warmup_steps: 5}}
train: {{max_steps: {steps}, precision: fp32, deepspeed_config: {ROOT / "ds_configs" / "zero1.json"}}}
eval: {{interval: 100000, batches: 0}}
checkpoint: {{interval: 100000, keep_last: 1}}
log: {{interval: 1, tensorboard: false}}
""")
    env = {
        **os.environ,
        "DS_ACCELERATOR": "cpu",
        "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 2) // ranks)),
        "PATH": str(Path(sys.executable).parent) + os.pathsep + os.environ.get("PATH", ""),
    }
    cmd = [
        str(Path(sys.executable).parent / "deepspeed"),
        "--num_gpus",
        str(ranks),
        "--master_port",
        str(29700 + ranks),
        str(ROOT / "pipeline" / "pretrain.py"),
        "--config",
        str(cfg),
    ]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=ROOT)
    if out.returncode:
        raise SystemExit(f"pipeline run with {ranks} rank(s) failed:\n{out.stdout[-3000:]}{out.stderr[-3000:]}")
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rates = [r["tokens_per_s"] for r in recs if "tokens_per_s" in r and r["step"] > warmup and r["step"] < steps]
    # The harmonic mean of per-step rates is total tokens over total time.
    return len(rates) / sum(1 / r for r in rates)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--warmup", type=int, default=10)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="cpubench-") as tmp:
        work = Path(tmp)
        shards = synthetic_shards(work)
        threads = torch.get_num_threads()
        plain = plain_pytorch(shards, args.steps, args.warmup)
        one = pipeline_run(shards, work, 1, args.steps, args.warmup)
        two = pipeline_run(shards, work, 2, args.steps, args.warmup)
    rows = [
        ("plain PyTorch AdamW loop, 1 process", plain, 1.0),
        ("pipeline pretrain, ZeRO-1, 1 rank", one, one / plain),
        ("pipeline pretrain, ZeRO-1, 2 ranks (total)", two, two / plain),
    ]
    print(f"| run (tiny, vocab {VOCAB}, micro {MICRO}, seq {SEQ}, fp32) | tokens/s | x plain |")
    print("|---|---|---|")
    for name, tps, ratio in rows:
        print(f"| {name} | {tps:,.0f} | {ratio:.2f} |")
    print(f"2 ranks / 1 rank: {two / one:.2f}x")
    result = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
        "torch_threads_plain": threads,
        "steps": args.steps,
        "warmup": args.warmup,
        "plain_tokens_per_s": plain,
        "pipeline_1rank_tokens_per_s": one,
        "pipeline_2rank_tokens_per_s": two,
        "ratio_1rank_vs_plain": one / plain,
        "ratio_2rank_vs_1rank": two / one,
    }
    out = ROOT / "bench" / "results" / f"cpu-{result['date']}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    write_json(out, result)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
