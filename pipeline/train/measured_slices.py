"""The slices `pipeline probe --config` measured on a node (pipeline.launch.slices): what makes two configs' slices
the same measurement (`slice_key`), and the figures `pipeline plan --config` puts beside its own for the same ranks
(`beside_plan`): measured on this card, extrapolated by the slope from 2 and 4 layers, with the planner's figures
for exactly that setup and the ratio between them."""

from __future__ import annotations

import hashlib
import json
from dataclasses import replace
from pathlib import Path
from typing import Any

from pipeline.errors import PipelineError
from pipeline.plan.cluster import Cluster
from pipeline.plan.gpus import lookup
from pipeline.train.setup.prepare import Prepared

GiB = 2**30
SWITCHES = (
    "precision",
    "activation_checkpointing",
    "compile",
    "attention",
    "kernels",
    "fp8",
    "tiled_mlp",
    "loss_chunk_tokens",
    "gpu_memory_cap_gib",
)


def slice_key(prepared: Prepared) -> dict[str, Any]:
    """What makes two configs' slices the same measurement: the model, the tokens per micro-step, the DeepSpeed
    JSON as written and the switches the trainer resolves (not the run's length, data or folder)."""
    cfg, shape = prepared.cfg, prepared.shape.as_dict()
    shape.pop("hf_config", None)
    ds = Path(cfg.train.deepspeed_config)
    return {
        "shape": shape,
        "family": prepared.shape.family,
        "seq_len": prepared.plan.seq_len,
        "micro_batch_size": prepared.plan.micro_batch_size,
        "sequence_parallel": prepared.plan.sequence_parallel,
        "deepspeed_config": hashlib.sha256(ds.read_bytes()).hexdigest()[:16] if ds.is_file() else str(ds),
        "optimizer": cfg.optim.name,
        "train": {k: getattr(cfg.train, k) for k in SWITCHES},
    }


def read_slices(probe: Path) -> dict[str, Any] | None:
    """The slices a probe file holds (None: it holds none)."""
    try:
        doc = json.loads(probe.read_text())
    except (OSError, ValueError) as e:
        raise PipelineError(f"{probe}: cannot read the probe ({e}); run `pipeline probe` again") from None
    slices = doc.get("slices")
    return {**slices, "gpu": doc.get("gpu")} if slices else None


def beside_plan(
    config: str, sets: list[str], probe: Path | None, cluster: Cluster, mfu: float | None
) -> tuple[list[str], dict[str, Any] | None]:
    """The lines `pipeline plan --config` prints about the slices measured for this config (none when the probe
    holds no slices), and the same as JSON (None when they do not apply)."""
    from pipeline.train.forecast import forecast_config
    from pipeline.train.setup.config import load
    from pipeline.train.setup.prepare import prepare

    s = read_slices(probe) if probe is not None and probe.exists() else None
    if s is None:
        return [], None
    ranks = int(s["ranks"])
    try:
        prepared = prepare(load(config, sets), ranks, ranks)
    except PipelineError as e:
        return [f"the slices in {probe} are not compared: this config on {ranks} rank(s): {e}"], None
    key = slice_key(prepared)
    if key != s["key"]:
        differs = sorted(k for k in key if key[k] != s["key"].get(k))
        return [
            f"the slices in {probe} were measured for another configuration ({', '.join(differs)} differ): "
            f"`pipeline probe --config {config}` on a node measures this one"
        ], None
    full = s["full"]
    one = full["micro_step_s"] + full["optimizer_s"]
    depths = " and ".join(str(m["layers"]) for m in s["slices"])
    got: dict[str, Any] = {
        "when": s["when"],
        "device": s["device"],
        "gpu": s["gpu"],
        "ranks": ranks,
        "slices": s["slices"],
        "layers": full["layers"],
        "micro_step_s": full["micro_step_s"],
        "optimizer_s": full["optimizer_s"],
        "step_s_one_micro_step": one,
        "peak_gib": full["peak_gib"],
    }
    lines = [
        f"measured on this node by `pipeline probe --config` ({s['when']}; {ranks} {s['device']} rank(s)"
        + (f", {s['gpu']}" if s["gpu"] else "")
        + f"): slices of {depths} layers extrapolated to {full['layers']}: a step of one micro-step {one:.3f} s "
        f"(micro-step {full['micro_step_s']:.3f} + optimizer step {full['optimizer_s']:.3f}), peak "
        f"{full['peak_gib']:.2f} GiB per rank"
    ]
    if s["device"] != "cuda" or not s["gpu"]:
        lines.append("  (CPU ranks: a test of the mechanism, not a GPU's figures; no ratio to the plan)")
        return lines, got
    try:
        same_card = lookup(s["gpu"]).name == cluster.gpu.name
    except KeyError:
        same_card = False
    if not same_card:
        lines.append(f"  (measured on {s['gpu']}; this plan is for {cluster.gpu.name}: no ratio to the plan)")
        return lines, got
    p = prepared.plan
    one_micro = [f"batch.global_batch_size={p.micro_batch_size * p.data_parallel_size}"]
    here = forecast_config(
        config,
        [*sets, "batch.global_batch_tokens=null", *one_micro],
        replace(cluster, nodes=1, gpus_per_node=ranks),
        seq_len=None,
        layers=None,
        vocab_size=32000,
        mfu=mfu,
    ).yours
    planned_peak = here.gpu["peak_allocated"] / GiB
    got["planned"] = {"step_s_one_micro_step": here.step_time_s, "peak_gib": planned_peak}
    got["ratio"] = {"step_s": one / here.step_time_s, "peak": full["peak_gib"] / planned_peak}
    lines.append(
        f"  the plan for the same {ranks} rank(s), one micro-step per step: {here.step_time_s:.3f} s, peak "
        f"{planned_peak:.2f} GiB: measured/planned {got['ratio']['step_s']:.2f}x in time, "
        f"{got['ratio']['peak']:.2f}x in memory"
    )
    return lines, got
