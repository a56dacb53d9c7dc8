"""GPU benchmark in one call on a lent GPU (under 8 minutes on one H200, JIT op builds included and timed):

  plain_eager, plain_compiled  the reference: transformers' Llama through a plain PyTorch loop (bf16 autocast,
                               fused AdamW), eager and with torch.compile, on the same model and batch as:
  pipeline_1b_zero2            the `1b` preset (TinyLlama geometry), seq 2048, ZeRO-2 bf16, through
                               pipeline/pretrain.py and the real launcher;
  70b_{2,4}layers_offload      Llama-2-70B geometry with 2 and 4 layers, ZeRO-3 + CPU offload, seq 4096, memory
                               capped at 23 GiB (what an RTX 4090D leaves usable), each beside the planner's
                               prediction of peak allocated memory and step time.

Each case runs in its own process group, is killed whole on timeout, and its result is written as soon as it ends;
no case writes a checkpoint. MFU is given by the PaLM count the trainer logs (6N + 12·L·h·s per token, as TinyLlama
and torchtitan count) and by the causal-attention count (6N + 6·L·h·s).

Output: OUT/<gpu>-<date>.json and a markdown table (OUT defaults to $OUT, else bench/results).
`--smoke` runs every case's code path on the CPU with the tiny preset in a few minutes (a test runs it, so the
script cannot rot between GPU runs).

Usage: python bench/gpu_bench.py [--smoke] [--out DIR] [--only CASE ...]"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run from a checkout without an install (a carried tree on a lent GPU)
    sys.path.insert(0, str(ROOT))


@dataclass
class Case:
    name: str
    kind: str  # plain | pipeline
    preset: str
    seq_len: int
    micro_batch_size: int
    steps: int
    layers: int | None = None
    ds_config: str = "zero2.json"
    activation_checkpointing: bool = False
    memory_cap_gib: float | None = None
    compile: bool = False
    timeout_s: int = 240
    plan: dict[str, Any] = field(default_factory=dict)  # stage, offload_optimizer, offload_param, buckets


def cases(smoke: bool) -> list[Case]:
    if smoke:  # the same code paths, at CPU size
        offload = {"stage": 3, "offload_optimizer": "cpu", "offload_param": "cpu"}
        return [
            Case("plain_eager", "plain", "tiny", 128, 4, 6),
            Case("plain_compiled", "plain", "tiny", 128, 4, 6, compile=True),
            Case("pipeline_1b_zero2", "pipeline", "tiny", 128, 4, 6, plan={"stage": 2}),
            Case(
                "70b_2layers_offload",
                "pipeline",
                "tiny",
                128,
                1,
                4,
                layers=2,
                ds_config="zero3_offload.json",
                activation_checkpointing=True,
                plan=offload,
            ),
        ]
    offload = {
        "stage": 3,
        "offload_optimizer": "cpu",
        "offload_param": "cpu",
        "reduce_bucket": 1e8,
        "prefetch_bucket": 1e8,
        "max_live": 3e8,
        "sub_group": 1e8,
    }
    return [
        Case("plain_eager", "plain", "1b", 2048, 8, 14, timeout_s=150),
        Case("plain_compiled", "plain", "1b", 2048, 8, 14, compile=True, timeout_s=200),
        Case("pipeline_1b_zero2", "pipeline", "1b", 2048, 8, 14, plan={"stage": 2}, timeout_s=200),
        *[
            Case(
                f"70b_{n}layers_offload",
                "pipeline",
                "70b",
                4096,
                1,
                6,
                layers=n,
                ds_config="zero3_offload.json",
                activation_checkpointing=True,
                memory_cap_gib=23.0,
                plan=offload,
                timeout_s=200,
            )
            for n in (2, 4)
        ],
    ]


def synthetic_shards(work: Path, seq_len: int, vocab: int) -> Path:
    out = work / f"shards{seq_len}"
    if out.exists():
        return out
    import numpy as np

    from pipeline.atomic import write_json
    from pipeline.data import shard as shard_stage
    from pipeline.data.config import ShardConfig
    from pipeline.data.indexed import IndexedWriter

    prefix = work / f"corpus{vocab}"
    if not Path(str(prefix) + ".manifest.json").exists():
        rng = np.random.default_rng(0)
        w = IndexedWriter(Path(str(prefix) + ".bin"), np.dtype(np.uint16))
        lengths = rng.integers(200, 4000, 1000).astype(np.int32)
        w.add_many(lengths, rng.integers(4, vocab, int(lengths.sum())).astype(np.uint16))
        w.finish(Path(str(prefix) + ".idx"))
        write_json(
            str(prefix) + ".manifest.json",
            {
                "tokenizer": {
                    "path": "synthetic",
                    "sha256": "0" * 64,
                    "kind": "none",
                    "vocab_size": vocab,
                    "eos_id": 2,
                    "bos_id": 1,
                    "pad_id": 3,
                },
                "dtype": "uint16",
                "totals": {"documents": w.documents, "tokens": w.tokens},
            },
        )
    shard_stage.run(
        ShardConfig(
            sources=((str(prefix), 1.0),), output=str(out), seq_len=seq_len, split=(98.0, 1.0, 1.0), progress=False
        )
    )
    return out


def shape_of(case: Case, vocab: int) -> Any:
    from pipeline.model import resolve_shape

    shape = resolve_shape(case.preset, {"num_layers": case.layers} if case.layers else {}, vocab)
    return replace(shape, max_seq_len=max(shape.max_seq_len, case.seq_len))


# ---- the plain PyTorch reference, run in a child process (`--child-plain CASE.json`) ----


def plain_child(spec: dict[str, Any]) -> dict[str, Any]:
    import torch

    from pipeline.data.loader import ShardedDataset, collate_samples, rank_batches
    from pipeline.model import ModelShape, build_model
    from pipeline.train.engine import param_groups
    from pipeline.train.step import lm_loss

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    torch.manual_seed(0)
    model = build_model(ModelShape(**spec["shape"])).to(device)
    opt = torch.optim.AdamW(param_groups(model, 0.1), lr=1e-4, fused=cuda)
    fwd = torch.compile(model, backend="inductor" if cuda else "aot_eager") if spec["compile"] else model
    data = ShardedDataset(spec["shards"], "train")
    batches = rank_batches(len(data), 1234, spec["micro_batch_size"], 1, 0)
    times = []
    for _ in range(spec["steps"]):
        batch = collate_samples(data, next(batches))
        t0 = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
            logits = fwd(input_ids=batch["input_ids"].to(device, non_blocking=True)).logits
        loss, _, _ = lm_loss(logits, batch["labels"])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    steady = times[len(times) // 2 :]  # the first half holds compilation and warm-up
    step_s = sum(steady) / len(steady)
    return {
        "step_time_s": step_s,
        "tokens_per_s": spec["micro_batch_size"] * spec["seq_len"] / step_s,
        "peak_allocated_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
        "first_step_s": times[0],
    }


# ---- the cases, each in its own process group ----


def run_group(cmd: list[str], env: dict[str, str], timeout: int, log: Path) -> tuple[int | None, float]:
    """Run `cmd` in a new session; on timeout kill the whole group (ranks, workers, compile workers)."""
    t0 = time.perf_counter()
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True)
        try:
            code: int | None = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            code = None
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
    return code, time.perf_counter() - t0


def child_env(smoke: bool) -> dict[str, str]:
    env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p),
    }
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    if smoke:
        env["DS_ACCELERATOR"] = "cpu"
        env.setdefault("OMP_NUM_THREADS", "1")
        env.setdefault("TORCH_EXTENSIONS_DIR", str(Path(sys.prefix) / "torch_extensions"))
    return env


def run_plain(case: Case, shards: Path, work: Path, vocab: int, smoke: bool) -> dict[str, Any]:
    spec = {
        "shape": shape_of(case, vocab).as_dict(),
        "compile": case.compile,
        "shards": str(shards),
        "micro_batch_size": case.micro_batch_size,
        "seq_len": case.seq_len,
        "steps": case.steps,
    }
    spec_path, result_path = work / f"{case.name}.spec.json", work / f"{case.name}.result.json"
    spec_path.write_text(json.dumps(spec))
    code, wall = run_group(
        [sys.executable, __file__, "--child-plain", str(spec_path), str(result_path)],
        child_env(smoke),
        case.timeout_s,
        work / f"{case.name}.log",
    )
    if code != 0 or not result_path.exists():
        return {"error": _failure(code, case, work)}
    return {**json.loads(result_path.read_text()), "wall_s": wall}


def run_pipeline(case: Case, shards: Path, work: Path, smoke: bool) -> dict[str, Any]:
    run_dir = work / case.name
    shape_overrides = {"num_layers": case.layers} if case.layers else {}
    config = {
        "run_dir": str(run_dir),
        "model": {"preset": case.preset, "shape": shape_overrides},
        "data": {"path": str(shards), "num_workers": 2, "verify": False},
        "batch": {"micro_batch_size": case.micro_batch_size, "global_batch_size": case.micro_batch_size},
        "optim": {"lr": 1e-4, "min_lr": 1e-5, "warmup_steps": 2},
        "train": {
            "max_steps": case.steps,
            "precision": "fp32" if smoke else "bf16",
            "activation_checkpointing": case.activation_checkpointing,
            "deepspeed_config": str(ROOT / "ds_configs" / case.ds_config),
            "gpu_memory_cap_gib": case.memory_cap_gib,
        },
        "eval": {"interval": 10**6, "batches": 0},
        "checkpoint": {"enabled": False},
        "log": {"interval": 1, "tensorboard": False},
    }
    cfg_path = work / f"{case.name}.yaml"
    cfg_path.write_text(yaml.safe_dump(config))
    cmd = [
        sys.executable,
        "-m",
        "deepspeed.launcher.runner",
        "--num_gpus",
        "1",
        "--master_port",
        str(free_port()),
        str(ROOT / "pipeline" / "pretrain.py"),
        "--config",
        str(cfg_path),
    ]
    code, wall = run_group(cmd, child_env(smoke), case.timeout_s, work / f"{case.name}.log")
    metrics = run_dir / "metrics.jsonl"
    rows = [json.loads(x) for x in metrics.read_text().splitlines()] if metrics.exists() else []
    rows = [r for r in rows if "tokens_per_s" in r]
    if code != 0 or not rows:
        return {"error": _failure(code, case, work)}
    steady = rows[len(rows) // 2 :]  # the first steps hold warm-up (and JIT op loading)
    tps = len(steady) / sum(1 / r["tokens_per_s"] for r in steady)
    return {
        "tokens_per_s": tps,
        "step_time_s": case.micro_batch_size * case.seq_len / tps,
        "peak_allocated_gib": max(r["mem_gib"] for r in rows) if not smoke else None,
        "first_step_s": None,
        "wall_s": wall,
    }


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _failure(code: int | None, case: Case, work: Path) -> str:
    tail = (work / f"{case.name}.log").read_text()[-1500:] if (work / f"{case.name}.log").exists() else ""
    return (f"timed out after {case.timeout_s}s" if code is None else f"exit code {code}") + ": " + tail


def planned(case: Case, vocab: int, card: Any) -> dict[str, Any]:
    """The planner's prediction for exactly this case (one GPU, host RAM as on the lent machine)."""
    from pipeline.plan.cluster import Candidate, Cluster
    from pipeline.plan.search import estimate

    if case.kind != "pipeline":
        return {}
    p = case.plan
    kw = {k: p[k] for k in ("reduce_bucket", "prefetch_bucket", "max_live", "sub_group") if k in p}
    cand = Candidate(
        p["stage"],
        p.get("offload_optimizer", "none"),
        p.get("offload_param", "none"),
        case.activation_checkpointing,
        case.micro_batch_size,
        1,
        **kw,
    )
    if case.memory_cap_gib:
        card = replace(card, memory_gib=case.memory_cap_gib)
    e = estimate(shape_of(case, vocab), case.seq_len, Cluster(1, 1, card, 125 * 10**9, cpu_cores=16), cand)
    return {
        "plan_tokens_per_s": e.tokens_per_s,
        "plan_step_time_s": e.step_time_s,
        "plan_step_time_range_s": list(e.step_time_range_s),
        "plan_peak_allocated_gib": e.gpu["peak_allocated"] / 2**30,  # beside torch.cuda.max_memory_allocated
        "plan_reserved_gib": e.gpu["reserved"] / 2**30,
    }


def mfu(result: dict[str, Any], case: Case, vocab: int, peak_tflops: float | None) -> dict[str, Any]:
    if "tokens_per_s" not in result or not peak_tflops:
        return {"mfu_palm": None, "mfu_causal": None}
    shape = shape_of(case, vocab)
    tps = result["tokens_per_s"]
    return {
        "mfu_palm": tps * shape.flops_per_token(case.seq_len) / (peak_tflops * 1e12),
        "mfu_causal": tps * shape.flops_per_token(case.seq_len, causal=True) / (peak_tflops * 1e12),
    }


def warm_ops(smoke: bool, work: Path) -> dict[str, Any]:
    """Build (or load from cache) DeepSpeed's JIT ops once, timed, so the cases do not pay for it."""
    script = (
        "import time, json\nfrom deepspeed.ops.op_builder import CPUAdamBuilder, FusedAdamBuilder\nout = {}\n"
        "for b in (FusedAdamBuilder(), CPUAdamBuilder()):\n    t = time.perf_counter(); b.load()\n"
        "    out[b.name] = round(time.perf_counter() - t, 1)\nprint(json.dumps(out))\n"
    )
    log = work / "ops.log"
    code, wall = run_group([sys.executable, "-c", script], child_env(smoke), 400, log)
    lines = log.read_text().strip().splitlines() if log.exists() else []
    try:
        return {"op_build_s": json.loads(lines[-1]), "wall_s": round(wall, 1)}
    except (IndexError, json.JSONDecodeError):
        return {"error": f"op build failed ({code}): " + "\n".join(lines[-20:])}


def table(results: list[dict[str, Any]]) -> str:
    def f(v: Any, fmt: str) -> str:
        return format(v, fmt) if isinstance(v, (int, float)) else ""

    rows = [
        "| case | tokens/s | step s | planned step s | peak alloc GiB | planned peak GiB | MFU (PaLM) | MFU (causal) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        if "error" in r:
            rows.append(f"| {r['name']} | failed: {r['error'][:60]!r} | | | | | | |")
            continue
        rows.append(
            f"| {r['name']} | {f(r['tokens_per_s'], ',.0f')} | {f(r['step_time_s'], '.3f')} | "
            f"{f(r.get('plan_step_time_s'), '.3f')} | {f(r.get('peak_allocated_gib'), '.2f')} | "
            f"{f(r.get('plan_peak_allocated_gib'), '.2f')} | {f(r.get('mfu_palm'), '.1%')} | "
            f"{f(r.get('mfu_causal'), '.1%')} |"
        )
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="Every case's code path on the CPU, tiny preset.")
    ap.add_argument("--out", default=os.environ.get("OUT") or str(ROOT / "bench" / "results"))
    ap.add_argument("--only", nargs="*", default=None, help="Run only these cases.")
    ap.add_argument("--child-plain", nargs=2, metavar=("SPEC", "RESULT"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child_plain:
        spec = json.loads(Path(args.child_plain[0]).read_text())
        Path(args.child_plain[1]).write_text(json.dumps(plain_child(spec)))
        return

    import torch

    from pipeline.plan.gpus import GPU, lookup

    cuda = torch.cuda.is_available() and not args.smoke
    if not cuda and not args.smoke:
        raise SystemExit("no CUDA device: run with --smoke to check the code paths on the CPU")
    gpu_name = torch.cuda.get_device_name(0) if cuda else "cpu-smoke"
    card: GPU = lookup(gpu_name) if cuda else GPU("CPU", 20.0, 1.0, 20.0, 0, 10.0, True)
    vocab = 32000 if cuda else 4000
    date = time.strftime("%Y-%m-%d")
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    out = out_dir / f"{gpu_name.replace(' ', '_').replace('/', '_')}-{date}.json"
    doc: dict[str, Any] = {
        "date": date,
        "gpu": gpu_name,
        "smoke": args.smoke,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "mfu_convention": "PaLM: 6N + 12*L*h*s per token (N without the input embedding); causal: 6N + 6*L*h*s",
        "peak_bf16_tflops": card.bf16_tflops if cuda else None,
        "cases": [],
    }
    with tempfile.TemporaryDirectory(prefix="gpubench-") as tmp:
        work = Path(tmp)
        doc["ops"] = warm_ops(args.smoke, work)
        for case in cases(args.smoke):
            if args.only and case.name not in args.only:
                continue
            shards = synthetic_shards(work, case.seq_len, vocab)
            result = (
                run_plain(case, shards, work, vocab, args.smoke)
                if case.kind == "plain"
                else run_pipeline(case, shards, work, args.smoke)
            )
            result = {
                "name": case.name,
                **result,
                **planned(case, vocab, card),
                **mfu(result, case, vocab, card.bf16_tflops if cuda else None),
            }
            doc["cases"].append(result)
            out.write_text(json.dumps(doc, indent=2))  # after every case: a later timeout loses nothing
            print(json.dumps(result)[:400], flush=True)
    md = table(doc["cases"])
    out.with_suffix(".md").write_text(md + "\n")
    print(md)
    print(f"wrote {out}")
    if any("error" in r for r in doc["cases"]):
        sys.exit(1)


if __name__ == "__main__":
    main()
