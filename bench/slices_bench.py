"""How well `pipeline probe --config`'s slices predict the whole model's step, on this node's CPU ranks: a model of
6 layers (hidden 256, ffn 768, 4 heads, vocabulary 4,000, micro-batch 8, seq 128, fp32, ZeRO-2) measured at 2, 4
and 6 layers through the trainer and the real launcher (pipeline.launch.slices.run_slice, what the probe runs), in
turns (2, 4, 6, then again) so that a slow minute of the node falls on every depth alike. The 2- and 4-layer
slices extrapolated to 6 (pipeline.plan.probe.extrapolate) beside the 6 layers measured: the ratio, from each
depth's fastest run and round by round, and the runs' spread, which says how noisy the node was.

On a GPU the same figure is gpu_bench.py's 1b_slices case beside 1b_default. This is the CPU mechanism's check: a
test cannot hold it (a VM's CPU seconds vary by up to 1.4x from one launch to the next, and the extrapolation
doubles a slice's error), so it is measured here, as a ratio.

Writes bench/results/cpu-slices-<date>.json. Usage: python bench/slices_bench.py [--rounds 5] [--steps 10]"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

from pipeline.atomic import write_json
from pipeline.launch.slices import run_slice
from pipeline.plan.probe import extrapolate
from pipeline.train.setup.config import load
from pipeline.train.setup.prepare import prepare

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cpu_bench import synthetic_shards  # noqa: E402  (bench scripts are not a package)

ROOT = Path(__file__).resolve().parents[1]
DEPTHS, FULL = (2, 4), 6
MODEL = "{preset: null, shape: {hidden_size: 256, num_layers: 6, ffn_hidden_size: 768, num_heads: 4, num_kv_heads: 4}}"


def config(work: Path, shards: Path) -> Path:
    path = work / "slices.yaml"
    path.write_text(f"""run_dir: {work / "run"}
model: {MODEL}
data: {{path: {shards}, num_workers: 1, verify: false}}
batch: {{micro_batch_size: 8, global_batch_size: 8}}
optim: {{lr: 1.0e-3, warmup_steps: 3}}
train: {{max_steps: 10, precision: fp32, deepspeed_config: {ROOT / "ds_configs" / "zero2.json"}}}
""")
    return path


def predicted(best: dict[int, dict]) -> float:
    """The step (one micro-step and the optimizer step) at FULL layers by the slope of the DEPTHS slices."""
    return sum(extrapolate(list(DEPTHS), [best[n][k] for n in DEPTHS], FULL) for k in ("micro_step_s", "optimizer_s"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5, help="turns of 2, 4 and 6 layers")
    ap.add_argument("--steps", type=int, default=10, help="steps per run (the later half is timed)")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = ap.parse_args()
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ["PATH"] = str(Path(sys.executable).parent) + os.pathsep + os.environ.get("PATH", "")
    runs: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="slices-bench-") as tmp:
        work = Path(tmp)
        cfg = config(work, synthetic_shards(work, tokens=400_000))
        prepared = prepare(load(cfg), 1, 1)
        for r in range(args.rounds):
            for n in (*DEPTHS, FULL):
                m = run_slice(str(cfg), [], prepared, n, num_gpus=1, steps=args.steps, work=work / f"round{r}")
                runs.append({"round": r, **m})
                print(
                    f"round {r + 1}/{args.rounds}, {n} layers: step {m['step_s']:.3f} s ({m['timed_in']})", flush=True
                )
    by_round = [{m["layers"]: m for m in runs if m["round"] == r} for r in range(args.rounds)]
    best = {n: min((m for m in runs if m["layers"] == n), key=lambda m: m["step_s"]) for n in (*DEPTHS, FULL)}
    per_round = [predicted(b) / b[FULL]["step_s"] for b in by_round]
    spread = {n: max(m["step_s"] for m in runs if m["layers"] == n) / best[n]["step_s"] for n in best}
    doc = {
        "when": time.strftime("%Y-%m-%d %H:%M:%S %z"),
        "machine": {"cpus": os.cpu_count(), "processor": platform.processor(), "python": platform.python_version()},
        "model": MODEL,
        "rounds": args.rounds,
        "steps": args.steps,
        "predicted_over_measured": predicted(best) / best[FULL]["step_s"],
        "predicted_over_measured_by_round": per_round,
        "peak_predicted_over_measured": extrapolate(list(DEPTHS), [best[n]["peak_gib"] for n in DEPTHS], FULL)
        / best[FULL]["peak_gib"],
        "slowest_over_fastest_run": spread,
        "runs": runs,
    }
    out = args.out / f"cpu-slices-{time.strftime('%Y-%m-%d')}.json"
    write_json(out, doc)
    print(
        f"slices of {', '.join(map(str, DEPTHS))} layers extrapolated to {FULL} over the {FULL} measured: "
        f"{doc['predicted_over_measured']:.3f} from each depth's fastest of {args.rounds} runs; round by round "
        f"{min(per_round):.2f}-{max(per_round):.2f}; a depth's slowest run over its fastest: "
        + ", ".join(f"{n} layers {s:.2f}x" for n, s in spread.items())
        + f"; peak memory {doc['peak_predicted_over_measured']:.3f}\n-> {out}"
    )


if __name__ == "__main__":
    main()
