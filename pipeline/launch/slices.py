"""`pipeline probe --config CONFIG`: the run's own model measured on this node's card(s) at two small depths (2 and
4 layers by default), through the trainer and DeepSpeed's launcher, with the config's DeepSpeed JSON, precision,
micro-batch, sequence length and speed switches; one micro-step per optimizer step, so that a slice takes seconds
whatever the global batch (a continued model, `model.init_from`, is sliced in its architecture with fresh
weights). Per depth: the steady micro-step and optimizer-step times and the peak memory; by the slope (per layer,
plus the fixed part: embeddings, the output layer, the loss, the engine) the same at the model's full depth. This
is how the bench showed a 70B fits a 24 GB card (7.57 and 7.82 GiB at 2 and 4 layers: 17.3 at 80). The result
goes into the node's probe file, where `pipeline plan --config` finds it by the config's key and puts it beside its
own figures for the same ranks."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeline.errors import PipelineError
from pipeline.launch.command import PACKAGE, node_launcher_command
from pipeline.plan.probe import extrapolate
from pipeline.train.measured_slices import slice_key

if TYPE_CHECKING:
    from pipeline.train.setup.prepare import Prepared

LAYERS = (2, 4)
QUIET = [
    "checkpoint.enabled=false",
    "checkpoint.branch_from=null",
    "eval.interval=1000000000",
    "log.interval=1",
    "log.tensorboard=false",
    "log.wandb_project=null",
    "log.mlflow_tracking_uri=null",
    "data.verify=false",
    "train.max_tokens=null",
]
"""What a slice leaves out of the run: checkpoints, evaluation, trackers, the shards' hashing."""


def _shape_sets(prepared: Prepared, layers: int) -> list[str]:
    """The model at `layers` layers: a preset's or an explicit shape's depth overridden; a continued model
    (`model.init_from`) is built in its architecture (a Hugging Face folder's: `model.architecture`; a preset
    loading a safetensors file: that preset) with fresh weights, which time and hold what its own do."""
    model = prepared.cfg.model
    sets = [f"model.shape.num_layers={layers}"]
    if model.init_from:
        sets.append("model.init_from=null")
        if model.preset is None:
            sets.append(f"model.architecture={model.init_from}")
    return sets


def run_slice(
    config: str, sets: list[str], prepared: Prepared, layers: int, *, num_gpus: int, steps: int, work: Path
) -> dict[str, Any]:
    """One depth through the real launcher: {layers, micro_step_s, optimizer_s, step_s, peak_gib, steps}."""
    from pipeline.doctor.cluster import rendezvous_port

    run_dir = work / f"layers{layers}"
    global_batch = prepared.plan.micro_batch_size * prepared.plan.data_parallel_size
    more = [
        f"run_dir={run_dir}",
        f"train.max_steps={steps}",
        "batch.global_batch_tokens=null",
        f"batch.global_batch_size={global_batch}",
        *QUIET,
        *_shape_sets(prepared, layers),
    ]
    args = ["--config", config, *(a for s in [*sets, *more] for a in ("--set", s))]
    cmd = node_launcher_command(PACKAGE / "pretrain.py", *args, num_gpus=num_gpus, port=rendezvous_port())
    work.mkdir(parents=True, exist_ok=True)
    log = work / f"layers{layers}.log"
    with open(log, "w") as f:
        code = subprocess.call(cmd, stdout=f, stderr=subprocess.STDOUT, env=os.environ.copy())
    rows = []
    if (metrics := run_dir / "metrics.jsonl").exists():
        rows = [r for r in map(json.loads, metrics.read_text().splitlines()) if "step_s" in r]
    if code != 0 or len(rows) < 2:
        tail = "".join(log.read_text().splitlines(keepends=True)[-15:])
        raise PipelineError(f"the {layers}-layer slice failed (exit code {code}); its last lines:\n{tail}")
    # CPU ranks are timed in the rank's CPU seconds, which a second job on the machine does not inflate (its wall
    # seconds would be that job's too); a GPU's step in wall seconds, synchronised
    step, opt = ("step_cpu_s", "optimizer_cpu_s") if "step_cpu_s" in rows[0] else ("step_s", "optimizer_s")
    # The later half: the first steps hold warm-up, compilation and the attention timing. Its fastest step, as a
    # microbenchmark takes its best run: another job on the node slows a step, nothing makes one faster.
    steady = rows[len(rows) // 2 :]
    best = min(steady, key=lambda r: r[step])
    optimizer_s = best.get(opt) or 0.0
    return {
        "layers": layers,
        "steps": len(rows),
        "timed_in": "CPU seconds" if step == "step_cpu_s" else "wall seconds",
        "step_s": best[step],
        "optimizer_s": optimizer_s,
        "micro_step_s": best[step] - optimizer_s,
        "median_step_s": statistics.median(r[step] for r in steady),
        "peak_gib": max(r["mem_gib"] for r in rows),
    }


def measure(
    config: str,
    sets: list[str],
    *,
    num_gpus: int,
    layers: tuple[int, ...] = LAYERS,
    steps: int = 8,
    repeats: int = 1,
    say: Callable[[str], None] = print,
) -> dict[str, Any]:
    """The slices of `config` on this node's `num_gpus` ranks, and the full depth extrapolated from them: the
    document `pipeline probe` writes under "slices". `repeats`: each depth run that many times, in turn, its
    fastest kept (a shared or noisy node)."""
    from pipeline.launch.start import build_ops_ahead
    from pipeline.train.runtime.dist import accelerator_name
    from pipeline.train.setup.config import load
    from pipeline.train.setup.prepare import prepare

    prepared = prepare(load(config, sets), num_gpus, num_gpus)
    build_ops_ahead(prepared.layout, num_gpus, num_gpus)  # once here, not by every slice's ranks
    full = prepared.shape.num_layers
    if len(set(layers)) < 2 or min(layers) < 1:
        raise PipelineError(f"--slice-layers {','.join(map(str, layers))}: give two or more different depths")
    best: dict[int, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="slices-") as tmp:
        for attempt in range(repeats):  # in turn, so that a slow minute of the node slows each depth once at most
            for n in sorted(set(layers)):
                t0 = time.monotonic()
                say(
                    f"  slice of {n} layers on {num_gpus} rank(s), {steps} steps"
                    + (f", run {attempt + 1}" * (repeats > 1))
                )
                m = run_slice(config, sets, prepared, n, num_gpus=num_gpus, steps=steps, work=Path(tmp) / str(attempt))
                say(
                    f"    micro-step {m['micro_step_s']:.3f} s, optimizer step {m['optimizer_s']:.3f} s, peak "
                    f"{m['peak_gib']:.2f} GiB ({time.monotonic() - t0:.0f} s)"
                )
                if n not in best or m["step_s"] < best[n]["step_s"]:
                    best[n] = m
    measured = [best[n] for n in sorted(best)]
    depths = [m["layers"] for m in measured]
    full_figures = {k: extrapolate(depths, [m[k] for m in measured], full) for k in ("micro_step_s", "optimizer_s")}
    full_figures["peak_gib"] = extrapolate(depths, [m["peak_gib"] for m in measured], full)
    p = prepared.plan
    micro_steps = p.global_batch_size // (p.micro_batch_size * p.data_parallel_size)
    return {
        "config": str(Path(config).resolve()),
        "sets": list(sets),
        "key": slice_key(prepared),
        "device": accelerator_name(),
        "ranks": num_gpus,
        "when": time.strftime("%Y-%m-%d %H:%M:%S %z"),
        "python": sys.version.split()[0],
        "repeats": repeats,
        "slices": measured,
        "full": {"layers": full, **full_figures},
        "micro_steps_here": micro_steps,
        "step_s_here": micro_steps * full_figures["micro_step_s"] + full_figures["optimizer_s"],
    }
