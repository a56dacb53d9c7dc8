"""The GPU benchmark: one prepared call for a lent GPU, sized for a 15-minute lease (one H200 capped at a 4090D's
24 GiB where the case is about 24 GB cards). One process orders the steps and keeps a deadline (`--budget`):

  0. preflight     every import the cases need, the versions, nvidia-smi; stops at once if one is missing
  1. warm-up       DeepSpeed's ops built in parallel while the GPU times a bf16 matmul and finds which SDPA
                   backend serves causal attention; the weights init on the GPU RNG against the CPU's (ratio)
  2. the cases, in order of value; a case whose timeout no longer fits the budget is skipped, never the first:
     1b_zero2           the 1b preset (TinyLlama geometry), seq 2048, micro 8, ZeRO-2 bf16, through
                        pipeline/pretrain.py and the real launcher: the headline tokens/s and MFU
     70b_2layers, 70b_4layers   the Llama-2-70B geometry with 2 and 4 layers at configs/70b_8node.yaml's micro-batch
                        2, seq 4096, ZeRO-3 + CPU offload + checkpointing, capped at 23 GiB: the per-layer slope
                        of peak memory and step time gives the 80-layer verdict for 24 GB cards
     1b_compile         the first case with train.compile
     plain_eager        the same model and batch in a plain PyTorch loop (bf16 autocast, fused AdamW): our overhead
     7b_2layers_offload the 7B geometry, 2 layers, micro 8, seq 4096, ZeRO-3 + CPU offload, capped (the fits-table plan)
     70b_2layers_memory the 2-layer slice again with the allocator's history: the live blocks at the peak, by site
     70b_4layers_actoffload  activation offload (activation_checkpointing.cpu_checkpointing) at micro 4: the
                        planner's 70B choice, beside 70b_4layers at micro 2
     7b_2layers_bf16states, 7b_2layers_zenflow   the opt-in features on the 7B slice (bf16 master weights and
                        optimizer states; ZenFlow on ZeRO-2), each beside 7b_2layers_offload and the planner
     1b_slices          `pipeline probe --config` on 1b_default's config: 2 and 4 layers extrapolated to 22,
                        beside 1b_default measured whole (the ratio)
     llama31_70b_2layers_32k, ..._documents_dense, ..._documents_varlen   a 2-layer slice of Llama-3.1-70B's real
                        config at 32K (the planner's layout: ZeRO-3 + CPU offload, MLP in 4 tiles, offloaded
                        checkpoints), capped: packed samples, then whole-document samples on SDPA's dense mask and
                        on the varlen path (FlashAttention-2 where flash_attn is installed; the run records the path)
     7b_2layers_32k_liger   the 2-layer 7B slice at 32K under Liger's modules beside 7b_2layers_32k, with the
                        allocator's live blocks at the peak: Liger's layer against the CPU count that prices it
     eval_7b_128k       a 2-layer 7B slice trained one step at 128K and saved, then one card's `pipeline evaluate`
                        at --batch-size 8 under the 23 GiB cap: the batch it chooses and whether it runs (sequence
                        parallelism needs two cards: this one-card run measures the rest)

Each result lands in OUT/results.json as its case ends, with the planner's prediction beside it, and each case's
whole log in OUT/logs/. MFU is given by the PaLM count the trainer logs (6N + 12*L*h*s FLOPs per token, as TinyLlama
and torchtitan count) and by the causal-attention count (6N + 6*L*h*s). No case writes a checkpoint.

`--smoke` runs every step and case's code path on the CPU at a tiny size (a test runs it, so the script cannot rot
between leases); a case whose CPU run would repeat an earlier one's (the GPU-only switches fall back there, and
layers and micro-batch change sizes, not code) names that case instead of running it again. A smoke run has no
deadline unless `--budget` is given, and its cases three times their GPU timeout: it checks code paths, and a
machine busy with other work must not skip them.
Usage: python bench/gpu_bench.py [--smoke] [--out DIR] [--logs DIR] [--budget SECONDS] [--only CASE ...]"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import platform
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run from a carried checkout without an install (a lent GPU)
    sys.path.insert(0, str(ROOT))

CAP_GIB = 23.0  # what an RTX 4090D leaves usable, as the planner plans it
LLAMA31_70B = "configs/hf/llama-3.1-70b.json"
"""Llama-3.1-70B's own config.json: the 70B users continue at 32K (the 70b preset is Llama-2's geometry)."""
PROBE = "host.probe.json"  # the warm-up's `pipeline probe` of the lent machine, beside results.json


@dataclass
class Case:
    name: str
    kind: str  # pipeline | plain | stage4 | slices | eval
    preset: str
    seq_len: int
    micro_batch_size: int
    steps: int
    layers: int | None = None
    ds_config: str = "zero2.json"
    ds_overrides: dict[str, Any] = field(default_factory=dict)
    """Merged into the zero_optimization / bf16 sections of ds_config (the offload features)."""
    activation_checkpointing: bool = False
    memory_cap_gib: float | None = None
    compile: bool | None = False
    """train.compile: None is the trainer's default (auto)."""
    attention: str = "torch"
    """train.attention (pipeline.model.kernels.ATTENTION); torch: torch's own SDPA choice, as before the switch."""
    kernels: str = "torch"
    """train.kernels (pipeline.model.kernels.KERNELS)."""
    tiled_mlp: int = 0
    """train.tiled_mlp (0: off)."""
    optimizer: str = "adamw"
    """optim.name (pipeline.train.setup.optimizers.OPTIMIZERS)."""
    fp8: bool = False
    """train.fp8: the decoder's matmuls in float8 (torchao)."""
    architecture: str | None = None
    """A Hugging Face config.json (model.architecture, fresh weights) instead of `preset`, sliced to `layers`."""
    whole_documents: bool = False
    """Shards of whole documents (`pipeline shard --whole-documents`): positions restart at each document."""
    document_attention: str = "auto"
    """train.document_attention (pipeline.model.varlen): auto, varlen or dense."""
    eval_batch: int | None = None
    """kind "eval": after training (saved), one card's `pipeline evaluate --batch-size N` under the case's cap."""
    memory_at_peak: bool = False
    """Record the allocator's history and summarise the live blocks at the peak (PIPELINE_MEMORY_SNAPSHOT)."""
    timeout_s: int = 150
    """What the deadline reserves for the case."""
    note: str = ""


def cases(smoke: bool) -> list[Case]:
    """The cases in order of value (the order they run in); smoke: the same code paths at CPU size."""
    offload = dict(ds_config="zero3_offload.json", activation_checkpointing=True, memory_cap_gib=CAP_GIB)
    default = dict(compile=None, attention="auto", kernels="auto")  # what pretrain.py does unless told otherwise
    liger = dict(compile=None, attention="auto", kernels="liger")
    full = [
        Case("1b_zero2", "pipeline", "1b", 2048, 8, 14, timeout_s=80, note="the 2026-12-04 baseline: all eager"),
        Case("plain_eager", "plain", "1b", 2048, 8, 14, timeout_s=50, note="the reference loop"),
        Case("1b_default", "pipeline", "1b", 2048, 8, 14, timeout_s=90, note="pretrain.py's GPU default", **default),
        Case("1b_liger", "pipeline", "1b", 2048, 8, 14, timeout_s=90, note="+ Liger kernels, fused loss", **liger),
        Case("7b_2layers_offload", "pipeline", "7b", 4096, 8, 6, layers=2, timeout_s=80, **offload),
        Case(
            "7b_2layers_offload_liger",
            "pipeline",
            "7b",
            4096,
            8,
            6,
            layers=2,
            timeout_s=80,
            note="offload with the measured attention and Liger's module kernels (ZeRO-3 keeps the chunked loss)",
            attention="auto",
            kernels="liger",
            **offload,
        ),
        Case(
            "1b_stage4",
            "stage4",
            "1b",
            2048,
            8,
            4,
            timeout_s=150,
            note="tokenize, shard, train 4 steps and save, evaluate, export, reload in transformers, on the GPU",
            **default,
        ),
        Case("1b_liger_micro16", "pipeline", "1b", 2048, 16, 12, timeout_s=90, note="fused loss's memory", **liger),
        Case("1b_liger_eager", "pipeline", "1b", 2048, 8, 14, timeout_s=75, attention="auto", kernels="liger"),
        Case("1b_compile", "pipeline", "1b", 2048, 8, 14, compile=True, timeout_s=80, note="compile alone"),
        Case("1b_default_zero1", "pipeline", "1b", 2048, 8, 14, ds_config="zero1.json", timeout_s=90, **default),
        Case("70b_2layers", "pipeline", "70b", 4096, 2, 6, layers=2, timeout_s=110, **offload),
        Case("70b_4layers", "pipeline", "70b", 4096, 2, 6, layers=4, timeout_s=140, **offload),
        # the 70B slices hold 1.37 GiB beyond every planned term (the same at 2 and 4 layers): what it is, by who
        # allocated it (its own case: recording the allocator's history slows the steps the case above times)
        Case(
            "70b_2layers_memory",
            "pipeline",
            "70b",
            4096,
            2,
            4,
            layers=2,
            timeout_s=110,
            memory_at_peak=True,
            note="the live blocks at the peak, by site",
            **offload,
        ),
        # DeepSpeed 0.19's offload features, each beside its plain case above and the planner
        Case(
            "70b_4layers_actoffload",
            "pipeline",
            "70b",
            4096,
            4,
            6,
            layers=4,
            timeout_s=150,
            ds_overrides={"activation_checkpointing": {"cpu_checkpointing": True}},
            note="the planner's 70B choice: activation offload lets micro 4 fit (70b_4layers: micro 2)",
            **offload,
        ),
        Case(
            "7b_2layers_bf16states",
            "pipeline",
            "7b",
            4096,
            8,
            6,
            layers=2,
            timeout_s=100,
            ds_overrides={"bf16": {"bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}},
            note="opt-in: bf16 master weights and Adam moments in host memory",
            **offload,
        ),
        Case(
            "7b_2layers_zenflow",
            "pipeline",
            "7b",
            4096,
            8,
            16,  # four update periods of 4: a steady state, not the first full update alone
            layers=2,
            ds_config="zero2.json",
            activation_checkpointing=True,
            memory_cap_gib=CAP_GIB,
            timeout_s=150,
            ds_overrides={
                "zero_optimization": {
                    "offload_optimizer": {"device": "cpu", "pin_memory": True},
                    "zenflow": {
                        "topk_ratio": 0.1,
                        "select_strategy": "step",
                        "select_interval": 4,
                        "update_interval": 4,
                        "overlap_step": True,
                        "full_warm_up_rounds": 0,
                    },
                }
            },
            note="opt-in: ZenFlow on ZeRO-2, CPU Adam every 4 steps behind the GPU's work",
        ),
        # Long context on one 24 GiB card (the planner's 70B-at-32K choice tiles the MLP and offloads the
        # checkpointed layer inputs): a 2-layer 7B slice at 32K and 64K, plain, tiled, tiled + activation offload.
        # Which of them fits says the longest sequence a card holds; tokens/s what it costs.
        Case("7b_2layers_32k", "pipeline", "7b", 32768, 1, 4, layers=2, timeout_s=150, **offload),
        *(
            Case(
                f"7b_2layers_{k}k_tiled_actoffload",
                "pipeline",
                "7b",
                k * 1024,
                1,
                4,
                layers=2,
                tiled_mlp=k // 4,
                timeout_s=150 + 2 * k,
                ds_overrides={"activation_checkpointing": {"cpu_checkpointing": True}},
                note=f"{k}K with the MLP in {k // 4} tiles and the checkpointed layer inputs in host memory",
                **offload,
            )
            for k in (32, 64)
        ),
        # Muon against 1b_zero2 (AdamW, the same eager ZeRO-2 run): peak memory (4 bytes of state a matrix
        # parameter instead of 8) and step time (Newton-Schulz on every matrix at each step)
        Case("1b_muon", "pipeline", "1b", 2048, 8, 14, optimizer="muon", timeout_s=90, note="Muon beside 1b_zero2"),
        # FP8 matmuls beside 1b_default (compiled bf16): tokens/s and the first steps' losses; an H100/H200 is an
        # upper reference for a 4090's FP8, not its measurement
        Case("1b_fp8", "pipeline", "1b", 2048, 8, 14, fp8=True, timeout_s=100, note="fp8 beside 1b_default", **default),
        # `pipeline probe --config` on 1b_default's config: slices of 2 and 4 layers extrapolated to 22, beside
        # what 1b_default measured whole (the same one micro-step per step): does the slope predict the model?
        Case("1b_slices", "slices", "1b", 2048, 8, 10, timeout_s=120, note="slices beside 1b_default", **default),
        # Long context at first contact: the model users continue at 32K (Llama-3.1-70B's own config: 128K
        # vocabulary) in the planner's layout, packed and with whole documents on each attention path
        *(
            Case(
                f"llama31_70b_2layers_32k{suffix}",
                "pipeline",
                "llama31-70b",
                32768,
                1,
                4,
                layers=2,
                architecture=LLAMA31_70B,
                tiled_mlp=4,
                whole_documents=bool(suffix),
                document_attention=path,
                timeout_s=200,
                ds_overrides={"activation_checkpointing": {"cpu_checkpointing": True}},
                note=note,
                **offload,
            )
            for suffix, path, note in (
                ("", "auto", "packed samples: the planner's Llama-3.1-70B-at-32K layout"),
                ("_documents_dense", "dense", "whole documents on SDPA's (seq x seq) mask (planned: 3 GiB more)"),
                ("_documents_varlen", "varlen", "whole documents on the varlen path (dense where flash_attn is not)"),
            )
        ),
        # The layer's activation terms as the planner counts them on the CPU (tests/unit/plan/test_memory_graphs.py):
        # the 2-layer 7B slice at 32K beside 7b_2layers_32k (transformers' modules) under Liger's, with the
        # allocator's history at the peak, to say what Liger's kernels hold that the CPU count of its contract
        # prices 1.45x over at 4K (7b_2layers_offload_liger)
        Case(
            "7b_2layers_32k_liger",
            "pipeline",
            "7b",
            32768,
            1,
            4,
            layers=2,
            timeout_s=150,
            memory_at_peak=True,
            note="Liger's layer at 32K beside 7b_2layers_32k, with the live blocks at the peak",
            **offload,
            **liger,
        ),
        Case(
            "eval_7b_128k",
            "eval",
            "7b",
            131072,
            1,
            1,
            layers=2,
            tiled_mlp=32,
            eval_batch=8,
            timeout_s=240,
            ds_overrides={"activation_checkpointing": {"cpu_checkpointing": True}},
            note="one card's evaluation batch at 128K (asked 8), after one saved training step",
            **offload,
        ),
    ]
    if not smoke:
        return full
    small = {"1b": "tiny", "70b": "tiny", "7b": "tiny", "llama31-70b": "llama31-70b"}
    return [
        replace(
            c,
            preset=small[c.preset],
            seq_len=128,
            micro_batch_size=min(c.micro_batch_size, 4),
            steps=max(4, c.steps // 4) if c.name == "7b_2layers_zenflow" else 4,
            memory_cap_gib=None,
            timeout_s=240,
        )
        for c in full
    ]


# ---- 0. preflight --------------------------------------------------------------------------------------------


def preflight(out: Path) -> dict[str, Any]:
    """Every import the cases need and the versions; the first missing one stops the run (no half measurement)."""
    import importlib

    needed = [
        "torch",
        "deepspeed",
        "transformers",
        "ninja",
        "psutil",
        "cpuinfo",
        "msgpack",
        "einops",
        "hjson",
        "pydantic",
        "sentencepiece",
        "safetensors",
        "yaml",
    ]
    missing = []
    versions: dict[str, str] = {}
    for name in needed:
        try:
            versions[name] = str(getattr(importlib.import_module(name), "__version__", "?"))
        except Exception as e:  # noqa: BLE001 - reported, then the run stops
            missing.append(f"{name} ({type(e).__name__}: {e})")
    for name in ("liger_kernel", "triton", "torchao"):  # optional: the cases that need them fail alone, and say so
        try:
            module = importlib.import_module(name)
            versions[name] = str(getattr(module, "__version__", "installed"))
        except Exception as e:  # noqa: BLE001
            versions[name] = f"missing ({type(e).__name__})"
    from pipeline.model import transformers_helper

    for module, helper in (
        ("transformers.initialization", "no_init_weights"),
        ("transformers.integrations.deepspeed", "prevent_arange_dtype_change"),
    ):
        try:
            transformers_helper(module, helper)
        except Exception as e:  # noqa: BLE001
            missing.append(f"{module}.{helper} ({e})")
    if shutil.which("nvidia-smi"):
        smi = subprocess.run(["nvidia-smi"], capture_output=True, text=True).stdout
        (out / "nvidia-smi.txt").write_text(smi)
    return {"versions": versions, "missing": missing, "python": platform.python_version()}


# ---- 1. warm-up: op builds in parallel with the GPU ceilings --------------------------------------------------


def warm_up(smoke: bool, out: Path) -> dict[str, Any]:
    from pipeline.plan.probe import gemm_rates, probe_node, write_probe
    from pipeline.train.runtime.ops import build

    built: list[Any] = []
    builder = threading.Thread(target=lambda: built.extend(build(["fused_adam", "cpu_adam"], jobs=2)), daemon=True)
    builder.start()
    doc: dict[str, Any] = {"matmul": matmul_ceiling(smoke), "sdpa": sdpa_backend(smoke), "init": init_speed(smoke)}
    doc["gemm_1b"] = gemm_rates(2048, 5632, 16384)  # the 1b preset's projections at micro 8 x seq 2048
    builder.join()
    doc["op_builds"] = {name: {"seconds": round(s, 1), "error": err} for name, s, err in built}
    try:  # what `pipeline probe` measures, where planned() reads it: CPU Adam needs its op, built above
        doc["host"] = probe_node(smoke)
        write_probe(doc["host"], out / PROBE)
    except Exception as e:  # noqa: BLE001 - a probe that fails is reported; the cases are planned without it
        doc["host"] = {"error": f"{type(e).__name__}: {e}"}
    return doc


def matmul_ceiling(smoke: bool) -> dict[str, float]:
    """bf16 matmul TFLOP/s at 8192^3 (the achievable ceiling beside the datasheet's dense peak)."""
    import torch

    cuda = torch.cuda.is_available() and not smoke
    n, dev, dtype = (8192, "cuda", torch.bfloat16) if cuda else (512, "cpu", torch.float32)
    a, b = torch.randn(n, n, device=dev, dtype=dtype), torch.randn(n, n, device=dev, dtype=dtype)
    for _ in range(3):
        a @ b
    if cuda:
        torch.cuda.synchronize()
    t0, iters = time.perf_counter(), 20 if cuda else 3
    for _ in range(iters):
        a @ b
    if cuda:
        torch.cuda.synchronize()
    seconds = (time.perf_counter() - t0) / iters
    return {"n": n, "tflops": 2 * n**3 / seconds / 1e12}


def sdpa_backend(smoke: bool) -> dict[str, Any]:
    """Which SDPA backend serves causal bf16 attention at (8, 32, 2048, 64), and each backend's time."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if smoke or not torch.cuda.is_available():
        return {"skipped": "no GPU"}
    q = torch.randn(8, 32, 2048, 64, device="cuda", dtype=torch.bfloat16)
    times = {}
    for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION):
        try:
            with sdpa_kernel(backend):
                torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                for _ in range(10):
                    torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
                torch.cuda.synchronize()
            times[backend.name] = (time.perf_counter() - t0) / 10
        except RuntimeError as e:
            times[backend.name] = f"unavailable: {str(e).splitlines()[0][:80]}"
    return times


def init_speed(smoke: bool) -> dict[str, Any]:
    """The initial weights of one 70B-geometry MLP matrix (8192 x 28672) drawn the trainer's way on the GPU and with
    a one-thread CPU generator (rank 0 did that for the whole model: about 10 minutes for 70B)."""
    import torch

    shape = (1024, 1024) if smoke else (8192, 28672)
    out = {}
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() and not smoke else [])
    for dev in devices:
        g = torch.Generator(device=dev).manual_seed(1)
        t0 = time.perf_counter()
        torch.empty(shape, device=dev).normal_(0.0, 0.02, generator=g)
        if dev == "cuda":
            torch.cuda.synchronize()
        out[f"{dev}_values_per_s"] = shape[0] * shape[1] / (time.perf_counter() - t0)
    if "cuda_values_per_s" in out:
        out["gpu_over_cpu"] = out["cuda_values_per_s"] / out["cpu_values_per_s"]
    return out


# ---- 2. the cases --------------------------------------------------------------------------------------------


def synthetic_shards(
    work: Path, seq_len: int, vocab: int, whole_documents: bool = False, eos: int = 2, bos: int = 1
) -> Path:
    """Random tokens in documents of 200-4000 tokens (each ending with `eos`), packed into samples of `seq_len`,
    or with `whole_documents` each document whole in one sample, several to a sample."""
    out = work / f"shards{seq_len}-{vocab}{'-whole' if whole_documents else ''}"
    if out.exists():
        return out
    import numpy as np

    from pipeline.atomic import write_json
    from pipeline.data import shard as shard_stage
    from pipeline.data.config import ShardConfig
    from pipeline.data.indexed import IndexedWriter, token_dtype

    dtype = token_dtype(vocab)
    prefix = work / f"corpus{vocab}"
    if not Path(str(prefix) + ".manifest.json").exists():
        rng = np.random.default_rng(0)
        w = IndexedWriter(Path(str(prefix) + ".bin"), dtype)
        lengths = rng.integers(200, 4000, 1000).astype(np.int32)
        tokens = rng.integers(4, min(vocab, 2**16), int(lengths.sum())).astype(dtype)
        tokens[np.cumsum(lengths) - 1] = eos  # every document ends with the end-of-sequence token
        w.add_many(lengths, tokens)
        w.finish(Path(str(prefix) + ".idx"))
        tokenizer = {
            "path": "synthetic",
            "sha256": "0" * 64,
            "kind": "none",
            "vocab_size": vocab,
            "eos_id": eos,
            "bos_id": bos,
            "pad_id": 3,
        }
        write_json(
            str(prefix) + ".manifest.json",
            {"tokenizer": tokenizer, "dtype": dtype.name, "totals": {"documents": w.documents, "tokens": w.tokens}},
        )
    documents = {"cross_document": False, "whole_documents": True} if whole_documents else {}
    shard_stage.run(
        ShardConfig(
            sources=((str(prefix), 1.0),),
            output=str(out),
            seq_len=seq_len,
            split=(98.0, 1.0, 1.0),
            progress=False,
            **documents,
        )
    )
    return out


def architecture_of(case: Case, work: Path, smoke: bool) -> Path | None:
    """The case's config.json: its own, or on the CPU (smoke) the same architecture at a tiny width (its real
    vocabulary and special ids, so the data path is the GPU run's)."""
    if case.architecture is None:
        return None
    path = ROOT / case.architecture
    if not smoke:
        return path
    raw = json.loads(path.read_text())
    raw.update(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    tiny = work / f"tiny-{path.name}"
    tiny.write_text(json.dumps(raw))
    return tiny


def case_vocab(case: Case, default: int) -> tuple[int, int, int]:
    """(vocabulary, eos, bos) of the case's data: its architecture's own, else the preset's synthetic ones."""
    if case.architecture is None:
        return default, 2, 1
    raw = json.loads((ROOT / case.architecture).read_text())
    eos = raw["eos_token_id"][0] if isinstance(raw["eos_token_id"], list) else raw["eos_token_id"]
    return int(raw["vocab_size"]), int(eos), int(raw["bos_token_id"])


def shape_of(case: Case, vocab: int, work: Path | None = None, smoke: bool = False) -> Any:
    from pipeline.model import resolve_shape, with_seq_len
    from pipeline.model.families import model_shape

    if case.architecture is not None and work is not None:
        arch = architecture_of(case, work, smoke)
        overrides = {"num_layers": case.layers} if case.layers else {}
        return model_shape(None, overrides, None, None, case.seq_len, architecture=str(arch))
    shape = resolve_shape(case.preset, {"num_layers": case.layers} if case.layers else {}, vocab)
    return with_seq_len(shape, case.seq_len)


def ds_json(case: Case, work: Path) -> Path:
    """The case's DeepSpeed JSON: a project config with the case's features merged in."""
    ds = json.loads((ROOT / "ds_configs" / case.ds_config).read_text())
    for section, values in case.ds_overrides.items():
        ds.setdefault(section, {}).update(values)
    path = work / f"{case.name}.ds.json"
    path.write_text(json.dumps(ds, indent=2))
    return path


def child_env(smoke: bool) -> dict[str, str]:
    env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p),
    }
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env.setdefault("TORCH_EXTENSIONS_DIR", str(Path(sys.prefix) / "torch_extensions"))
    if smoke:
        env["DS_ACCELERATOR"] = "cpu"
        env.setdefault("OMP_NUM_THREADS", "1")
    return env


def run_group(cmd: list[str], env: dict[str, str], timeout: float, log: Path) -> tuple[int | None, float]:
    """`cmd` in its own session, its output in `log`; on timeout the whole group is killed (ranks, workers)."""
    t0 = time.perf_counter()
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True)
        try:
            code: int | None = proc.wait(timeout=max(1.0, timeout))
        except subprocess.TimeoutExpired:
            code = None
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
    return code, time.perf_counter() - t0


def pipeline_config(case: Case, shards: Path, work: Path, smoke: bool, save: bool = False) -> Path:
    """The case's pretrain config (its run folder under `work`), written to WORK/CASE.yaml."""
    run_dir = work / case.name
    config = {
        "run_dir": str(run_dir),
        "model": (
            {"architecture": str(architecture_of(case, work, smoke))} if case.architecture else {"preset": case.preset}
        )
        | {"shape": {"num_layers": case.layers} if case.layers else {}},
        "data": {"path": str(shards), "num_workers": 2, "verify": False},
        "batch": {"micro_batch_size": case.micro_batch_size, "global_batch_size": case.micro_batch_size},
        "optim": {"lr": 1e-4, "min_lr": 1e-5, "warmup_steps": 2, "name": case.optimizer},
        "train": {
            "max_steps": case.steps,
            "precision": "bf16" if not smoke or "bf16" in case.ds_overrides or case.fp8 else "fp32",
            "fp8": case.fp8,
            "compile": case.compile,
            "attention": case.attention,
            "kernels": case.kernels,
            "activation_checkpointing": case.activation_checkpointing,
            "tiled_mlp": case.tiled_mlp,
            "document_attention": case.document_attention,
            "deepspeed_config": str(ds_json(case, work)),
            "gpu_memory_cap_gib": case.memory_cap_gib,
        },
        "eval": {"interval": 10**6, "batches": 0},
        "checkpoint": {"enabled": save, "interval": 10**6, "keep_last": 1},
        "log": {"interval": 1, "tensorboard": False},
    }
    cfg_path = work / f"{case.name}.yaml"
    cfg_path.write_text(yaml.safe_dump(config))
    return cfg_path


def run_pipeline(
    case: Case, shards: Path, work: Path, logs: Path, smoke: bool, timeout: float, save: bool = False
) -> dict[str, Any]:
    """The case through pipeline/pretrain.py and the real launcher; `save`: a checkpoint at the end (stage 4)."""
    run_dir = work / case.name
    cfg_path = pipeline_config(case, shards, work, smoke, save)
    from pipeline.launch.command import node_launcher_command  # one rank, without the front end's start: 3 s a case

    cmd = node_launcher_command(
        ROOT / "pipeline" / "pretrain.py", "--config", str(cfg_path), num_gpus=1, port=free_port()
    )
    log = logs / f"{case.name}.log"
    env = child_env(smoke)
    peak_file = work / f"{case.name}.memory.json"
    if case.memory_at_peak:  # after the last step (CUDA only: nothing is written on the CPU)
        env["PIPELINE_MEMORY_SNAPSHOT"] = f"{peak_file}:{case.steps}"
    code, wall = run_group(cmd, env, timeout, log)
    metrics = run_dir / "metrics.jsonl"
    rows = [json.loads(x) for x in metrics.read_text().splitlines()] if metrics.exists() else []
    rows = [r for r in rows if "tokens_per_s" in r]
    if code != 0 or not rows:
        return {"error": failure(code, timeout, log)}
    steady = rows[len(rows) // 2 :]  # the first steps hold warm-up and compilation
    tps = len(steady) / sum(1 / r["tokens_per_s"] for r in steady)
    environment = run_dir / "environment.json"
    return {
        "tokens_per_s": tps,
        "step_time_s": case.micro_batch_size * case.seq_len / tps,
        "first_step_s": case.micro_batch_size * case.seq_len / rows[0]["tokens_per_s"],
        "peak_allocated_gib": max(r["mem_gib"] for r in rows) if not smoke else None,
        "losses": [round(r["loss"], 4) for r in rows[:6]],  # beside the eager case's: what a lever did to numerics
        "speed": json.loads(environment.read_text()).get("speed") if environment.exists() else None,
        "wall_s": wall,
    } | ({"memory_at_peak": json.loads(peak_file.read_text())} if peak_file.exists() else {})


def run_slices(case: Case, shards: Path, work: Path, logs: Path, smoke: bool, timeout: float) -> dict[str, Any]:
    """`pipeline probe --config` on the case's config, one GPU: its model at 2 and 4 layers through the trainer,
    extrapolated to the full depth (pipeline.launch.slices), as a user runs it before a launch."""
    cfg_path = pipeline_config(case, shards, work, smoke)
    probe = work / f"{case.name}.probe.json"
    cmd = [sys.executable, "-m", "pipeline.cli", "probe", "--config", str(cfg_path), "--quick", "--num-gpus", "1"]
    cmd += ["--slice-steps", str(case.steps), "--out", str(probe)]
    log = logs / f"{case.name}.log"
    code, wall = run_group(cmd, child_env(smoke), timeout, log)
    if code != 0 or not probe.exists():
        return {"error": failure(code, timeout, log)}
    s = json.loads(probe.read_text())["slices"]
    full = s["full"]
    step = full["micro_step_s"] + full["optimizer_s"]
    return {
        "tokens_per_s": case.micro_batch_size * case.seq_len / step,
        "step_time_s": step,
        "peak_allocated_gib": full["peak_gib"] if not smoke else None,
        "extrapolated_to_layers": full["layers"],
        "slices": s["slices"],
        "wall_s": wall,
    }


def beside_whole(result: dict[str, Any], whole: dict[str, Any] | None) -> dict[str, Any]:
    """A slices case against the same model measured whole in this run (1b_default): the ratios."""
    if not whole or "step_time_s" not in whole or "step_time_s" not in result:
        return {}
    ratio = {"case": whole["name"], "step_time": result["step_time_s"] / whole["step_time_s"]}
    if result.get("peak_allocated_gib") and whole.get("peak_allocated_gib"):
        ratio["peak_allocated"] = result["peak_allocated_gib"] / whole["peak_allocated_gib"]
    return {"extrapolated_over_whole": ratio}


def plain_child(spec: dict[str, Any]) -> dict[str, Any]:
    """The reference: transformers' model in a plain PyTorch loop (bf16 autocast, fused AdamW), same batch."""
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
    data = ShardedDataset(spec["shards"], "train")
    batches = rank_batches(len(data), 1234, spec["micro_batch_size"], 1, 0)
    times = []
    for _ in range(spec["steps"]):
        batch = collate_samples(data, next(batches))
        t0 = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
            logits = model(input_ids=batch["input_ids"].to(device, non_blocking=True)).logits
        loss, _, _ = lm_loss(logits, batch["labels"])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        print(f"step {len(times)}/{spec['steps']} | loss {loss.item():.4f} | {times[-1]:.3f} s", flush=True)
    steady = times[len(times) // 2 :]
    step_s = sum(steady) / len(steady)
    return {
        "step_time_s": step_s,
        "tokens_per_s": spec["micro_batch_size"] * spec["seq_len"] / step_s,
        "peak_allocated_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
    }


def run_plain(case: Case, shards: Path, work: Path, logs: Path, vocab: int, smoke: bool, timeout: float) -> dict:
    spec = {
        "shape": shape_of(case, vocab).as_dict(),
        "shards": str(shards),
        "micro_batch_size": case.micro_batch_size,
        "seq_len": case.seq_len,
        "steps": case.steps,
    }
    spec_path, result_path = work / f"{case.name}.spec.json", work / f"{case.name}.result.json"
    spec_path.write_text(json.dumps(spec))
    log = logs / f"{case.name}.log"
    cmd = [sys.executable, __file__, "--child-plain", str(spec_path), str(result_path)]
    code, wall = run_group(cmd, child_env(smoke), timeout, log)
    if code != 0 or not result_path.exists():
        return {"error": failure(code, timeout, log)}
    return {**json.loads(result_path.read_text()), "wall_s": wall}


def stage4_shards(work: Path, seq_len: int, smoke: bool) -> Path:
    """Stages 1-2 on this machine: a generated corpus (a few thousand documents of words drawn from a fixed
    vocabulary with a Zipf law, so a tokenizer has something to learn), a sentencepiece tokenizer trained on it,
    shards split 90/5/5."""
    import numpy as np

    from pipeline.data import shard as shard_stage
    from pipeline.data import tokenize as tokenize_stage
    from pipeline.data.config import ShardConfig, TokenizeConfig

    out = work / f"stage4-shards{seq_len}"
    if (out / "manifest.json").exists():
        return out
    rng = np.random.default_rng(0)
    syllables = ["ka", "to", "ri", "men", "sal", "or", "un", "the", "as", "pe", "lo", "dra", "vi", "qu", "est"]
    words = ["".join(rng.choice(syllables, size=rng.integers(1, 4))) for _ in range(3000)]
    weights = 1.0 / np.arange(1, len(words) + 1)
    docs = 300 if smoke else 3000
    corpus = work / "stage4-corpus.jsonl"
    with open(corpus, "w") as f:
        for _ in range(docs):
            text = " ".join(rng.choice(words, size=int(rng.integers(100, 400)), p=weights / weights.sum()))
            f.write(json.dumps({"text": text.capitalize() + "."}) + "\n")
    prefix = work / "stage4"
    tokenize_stage.run(
        TokenizeConfig(
            inputs=(str(corpus),),
            output_prefix=str(prefix),
            train_tokenizer=True,
            vocab_size=1000 if smoke else 4096,
            workers=2 if smoke else 8,
            progress=False,
        )
    )
    shard_stage.run(
        ShardConfig(
            sources=((str(prefix), 1.0),), output=str(out), seq_len=seq_len, split=(90.0, 5.0, 5.0), progress=False
        )
    )
    return out


def run_stage4(case: Case, work: Path, logs: Path, smoke: bool, timeout: float) -> dict[str, Any]:
    """The whole path on this machine: stages 1-2 (stage4_shards), the case trained through the launcher with a
    checkpoint saved at its end, then `pipeline evaluate` and `pipeline export` of that checkpoint, and the
    export loaded back by transformers' own AutoModelForCausalLM, which generates from it."""
    started = time.monotonic()
    shards = stage4_shards(work, case.seq_len, smoke)
    prepared_s = time.monotonic() - started
    trained = run_pipeline(case, shards, work, logs, smoke, timeout - prepared_s, save=True)
    if "error" in trained:
        return trained
    run_dir, export_dir = work / case.name, work / f"{case.name}-export"
    cli = [sys.executable, "-c", "from pipeline.cli import main; main()"]
    steps: list[tuple[str, list[str]]] = [
        (
            "evaluate",
            [
                *cli,
                "evaluate",
                "--checkpoint",
                str(run_dir),
                "--max-batches",
                "4",
                "--max-new-tokens",
                "16",
                "--output",
                str(work / "stage4-eval.json"),
            ],
        ),
        ("export", [*cli, "export", "--checkpoint", str(run_dir), "--output", str(export_dir)]),
        (
            "reload",
            [
                sys.executable,
                "-c",
                "import sys, torch; from transformers import AutoModelForCausalLM, AutoTokenizer; "
                "d = sys.argv[1]; dev = 'cuda' if torch.cuda.is_available() else 'cpu'; "
                "m = AutoModelForCausalLM.from_pretrained(d, dtype=torch.bfloat16).to(dev); "
                "t = AutoTokenizer.from_pretrained(d); ids = t('Kato rimen', return_tensors='pt').input_ids.to(dev); "
                "print(type(m).__name__, sum(p.numel() for p in m.parameters()), "
                "repr(t.decode(m.generate(ids, max_new_tokens=8, do_sample=False)[0])))",
                str(export_dir),
            ],
        ),
    ]
    result: dict[str, Any] = {**trained, "stage12_s": prepared_s}
    for name, cmd in steps:
        log = logs / f"{case.name}_{name}.log"
        code, seconds = run_group(cmd, child_env(smoke), max(10.0, timeout - (time.monotonic() - started)), log)
        result[f"{name}_s"] = seconds
        if code != 0:
            return {**result, "error": f"{name}: " + failure(code, timeout, log)}
    evaluation = json.loads((work / "stage4-eval.json").read_text())
    result["eval_loss"] = evaluation.get("loss")
    result["reload"] = (logs / f"{case.name}_reload.log").read_text().strip().splitlines()[-1][:200]
    return result


EVAL_CAPPED = (
    "import sys, torch\n"
    "cap = float(sys.argv.pop(1)) * 2**30\n"
    "if torch.cuda.is_available():  # a 24 GB card on a larger one: the cap, and the free memory it leaves\n"
    "    torch.cuda.set_per_process_memory_fraction(cap / torch.cuda.get_device_properties(0).total_memory)\n"
    "    torch.cuda.mem_get_info = lambda device=None: (int(cap - torch.cuda.memory_reserved()), int(cap))\n"
    "from pipeline.cli import main\n"
    "main()\n"
)
"""`pipeline evaluate` as one card of the case's cap would run it (evaluate has no cap of its own)."""


def run_eval(case: Case, work: Path, logs: Path, smoke: bool, timeout: float) -> dict[str, Any]:
    """The case trained and saved through the launcher on stage 4's shards (a real tokenizer: evaluate prompts
    with it), then one card's `pipeline evaluate --batch-size N` of it on the training split (the held-out ones
    hold no sample this long) under the case's cap: the batch evaluate chose (its warning) or its one-line
    refusal, and the loss."""
    started = time.monotonic()
    shards = stage4_shards(work, case.seq_len, smoke)
    trained = run_pipeline(case, shards, work, logs, smoke, timeout - (time.monotonic() - started), save=True)
    if "error" in trained:
        return trained
    out = work / f"{case.name}-eval.json"
    cap = str(case.memory_cap_gib or 10**6)
    cmd = [sys.executable, "-c", EVAL_CAPPED, cap, "evaluate", "--checkpoint", str(work / case.name)]
    cmd += ["--split", "train", "--batch-size", str(case.eval_batch or 8), "--max-batches", "1"]
    cmd += ["--max-new-tokens", "4"]
    cmd += ["--output", str(out)]
    log = logs / f"{case.name}_evaluate.log"
    code, seconds = run_group(cmd, child_env(smoke), max(10.0, timeout - (time.monotonic() - started)), log)
    text = log.read_text() if log.exists() else ""
    chosen = [line for line in text.splitlines() if "evaluating with batch" in line or "evaluate across" in line]
    result = {**trained, "evaluate_s": seconds, "eval_batch_asked": case.eval_batch, "eval_said": chosen[-1:]}
    if code != 0:
        return result | (
            {"eval_refused": chosen[-1]} if chosen else {"error": "evaluate: " + failure(code, timeout, log)}
        )
    return result | {"eval_loss": json.loads(out.read_text()).get("loss")}


def free_port() -> int:
    from pipeline.doctor.cluster import rendezvous_port

    return rendezvous_port()


def failure(code: int | None, timeout: float, log: Path) -> str:
    tail = log.read_text()[-1500:] if log.exists() else ""
    return (f"timed out after {timeout:.0f} s" if code is None else f"exit code {code}") + ": " + tail


def cpu_path(case: Case) -> tuple[Any, ...]:
    """What a smoke case runs on the CPU, where compile is off unless asked for and the GPU-only attention and
    kernel choices fall back to torch's (pipeline.model.kernels): two cases with the same key run the same code.
    Sizes (layers, micro-batch) change what the GPU measures, not which code runs, so they are not in the key."""
    overrides = json.dumps(case.ds_overrides, sort_keys=True)
    return (
        case.preset,
        case.seq_len,
        case.ds_config,
        case.activation_checkpointing,
        overrides,
        bool(case.compile),
        case.tiled_mlp > 1,
        case.optimizer,
        case.fp8,
        case.architecture,
        case.whole_documents,
        case.document_attention,
    )


@dataclass(frozen=True)
class Host:
    """The lent machine's facts a plan reads besides its card and probe (recorded in results.json as `host`)."""

    ram_bytes: int
    cores: int

    @staticmethod
    def here() -> Host:
        import psutil

        return Host(int(psutil.virtual_memory().total), psutil.cpu_count(logical=False) or 1)


LEASE_HOST = Host(128 * 2**30, 16)
"""The lent machines of 2026-12-04 (one H200, 16 cores, 128 GiB, as the lease described them): their results
predate the `host` record."""


def planned(
    case: Case,
    vocab: int,
    card: Any,
    work: Path,
    probe: Path,
    host: Host | None = None,
    smoke: bool = False,
    packages: frozenset[str] | None = None,
) -> dict[str, Any]:
    """The planner's prediction for exactly this case: its DeepSpeed JSON on one GPU capped as the case is, the
    lent machine's RAM and cores (`host`, default this machine's), and what `pipeline probe` measured on it in the
    warm-up (`probe`), as a user's plan with a probed hostfile would be; the kernel packages the probe found there
    (`packages` where it kept none; else those installed here), whole documents on the attention path the case
    asks for."""
    from pipeline.model import loss_chunk_tokens
    from pipeline.plan.cluster import Cluster, trainer_stack
    from pipeline.plan.command import varlen_on_cluster
    from pipeline.plan.ds_json import layout_from_ds
    from pipeline.plan.estimate import estimate
    from pipeline.plan.facts import with_probe
    from pipeline.plan.gpus import capped
    from pipeline.train.setup.optimizers import OPTIMIZERS

    if case.kind == "eval":  # the batch one card's evaluate should choose under the case's cap
        from pipeline.plan.memory import evaluation_batch

        shape = shape_of(case, 1000 if smoke else 4096)  # stage 4's tokenizer
        cap = capped(card, case.memory_cap_gib).memory_gib * 2**30
        batch, need = evaluation_batch(
            shape, case.seq_len, case.eval_batch or 8, 1, cap, loss_chunk_tokens(shape.vocab_size)
        )
        return {"plan_eval_batch": batch, "plan_eval_gib": need / 2**30}
    if case.kind not in ("pipeline", "slices"):  # slices: planned as the whole model they extrapolate to
        return {}
    host = host or Host.here()
    ds = json.loads(ds_json(case, work).read_text())
    cand = replace(
        layout_from_ds(ds, case.micro_batch_size, 1, case.activation_checkpointing),
        tiled_mlp=case.tiled_mlp,
        moment_bytes=OPTIMIZERS[case.optimizer].moment_bytes,
    )
    cluster = Cluster(1, 1, capped(card, case.memory_cap_gib), host.ram_bytes, cpu_cores=host.cores)
    if probe.exists():
        cluster, _ = with_probe(cluster, probe, set())
    shape = shape_of(case, vocab, work, smoke)
    packages = cluster.packages if cluster.packages is not None else packages
    varlen = varlen_on_cluster(case.document_attention, packages)
    stack = trainer_stack(case.compile, case.kernels, case.fp8, case.whole_documents, varlen, packages)
    e = estimate(shape, case.seq_len, cluster, cand, loss_chunk_tokens=loss_chunk_tokens(shape.vocab_size), stack=stack)
    return {
        "plan_tokens_per_s": e.tokens_per_s,
        "plan_step_time_s": e.step_time_s,
        "plan_step_time_range_s": list(e.step_time_range_s),
        "plan_fits": e.fits,
        "plan_peak_allocated_gib": e.gpu["peak_allocated"] / 2**30,  # beside torch.cuda.max_memory_allocated
        "plan_reserved_gib": e.gpu["reserved"] / 2**30,
        "plan_document_mask_gib": e.gpu["document_mask"] / 2**30,
        "plan_assumed": [{"figure": f, "value": v, "source": src} for f, v, src in e.assumed],
    }


def lease_packages(doc: dict[str, Any]) -> frozenset[str]:
    """The kernel packages a stored GPU run had, from what its cases ran with (runs before the probe said so):
    liger-kernel where a case ran Liger's kernels, flash-attn where one took the varlen path."""
    speeds = [c["speed"] for c in doc.get("cases", []) if isinstance(c.get("speed"), dict)]
    return frozenset(
        name
        for name, key, value in (("liger-kernel", "kernels", "liger"), ("flash-attn", "attention_masks", "varlen"))
        if any(s.get(key) == value for s in speeds)
    )


def replanned(results: Path, probe_doc: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """Today's planner on every case a stored GPU run measured (`results`: a results.json): per case its measured
    step time and peak allocated beside the plan's, planned with the run's own host probe (`probe_doc` where the
    run kept none: another lease's of the same machine) and host facts. How the planner is held to the GPU."""
    import tempfile

    from pipeline.plan.gpus import lookup

    doc = json.loads(results.read_text())
    probe_doc = doc.get("warm_up", {}).get("host") or probe_doc
    host = Host(**doc["host"]) if doc.get("host") else LEASE_HOST
    by_name = {c.name: c for c in cases(False)}
    packages = lease_packages(doc)
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        work, probe = Path(tmp), Path(tmp) / PROBE
        if probe_doc and "error" not in probe_doc:
            probe.write_text(
                json.dumps({"host": "the lent machine", "when": doc["date"], "gpu": doc["gpu"], **probe_doc})
            )
        for r in doc["cases"]:
            case = by_name.get(r["name"])
            if case is None or case.kind != "pipeline" or "step_time_s" not in r:
                continue
            out.append(
                {
                    "name": case.name,
                    "step_time_s": r["step_time_s"],
                    "peak_allocated_gib": r["peak_allocated_gib"],
                    **planned(case, 32000, lookup(doc["gpu"]), work, probe, host, packages=packages),
                }
            )
    return out


def mfu(
    result: dict[str, Any], case: Case, vocab: int, peak_tflops: float | None, work: Path | None = None
) -> dict[str, Any]:
    if "tokens_per_s" not in result or not peak_tflops:
        return {"mfu_palm": None, "mfu_causal": None}
    shape = shape_of(case, vocab, work)
    tps = result["tokens_per_s"]
    return {
        "mfu_palm": tps * shape.flops_per_token(case.seq_len) / (peak_tflops * 1e12),
        "mfu_causal": tps * shape.flops_per_token(case.seq_len, causal=True) / (peak_tflops * 1e12),
    }


def slope_verdict(results: dict[str, dict[str, Any]], card_gib: float) -> dict[str, Any] | None:
    """From the 2- and 4-layer 70B cases: the per-layer slope of peak memory and step time, projected to 80
    layers (configs/70b_8node.yaml on one card)."""
    two, four = results.get("70b_2layers"), results.get("70b_4layers")
    if not two or not four or "error" in two or "error" in four or two.get("peak_allocated_gib") is None:
        return None
    per_layer = (four["peak_allocated_gib"] - two["peak_allocated_gib"]) / 2
    peak80 = two["peak_allocated_gib"] + 78 * per_layer
    step_per_layer = (four["step_time_s"] - two["step_time_s"]) / 2
    return {
        "peak_per_layer_gib": per_layer,
        "peak_80_layers_gib": peak80,
        "fits_24gb": peak80 <= card_gib,
        "step_per_layer_s": step_per_layer,
        "step_80_layers_s": two["step_time_s"] + 78 * step_per_layer,
    }


def table(results: list[dict[str, Any]]) -> str:
    def f(v: Any, fmt: str) -> str:
        return format(v, fmt) if isinstance(v, (int, float)) and not isinstance(v, bool) else ""

    def speed(r: dict[str, Any]) -> str:
        s = r.get("speed") or {}
        if not s:
            return ""
        masks = f", {s['attention_masks']} masks" if s.get("attention_masks") not in (None, "sdpa") else ""
        return f"{'compile, ' if s.get('compile') else ''}{s.get('attention')}, {s.get('kernels')}{masks}"

    head = (
        "| case | switches used | tokens/s | step s | planned step s | peak alloc GiB | planned peak GiB | MFU (PaLM) "
        "| MFU (causal) |"
    )
    rows = [head, "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        if "same_cpu_path_as" in r:
            rows.append(f"| {r['name']} | | smoke: the CPU path of {r['same_cpu_path_as']} | | | | | | |")
            continue
        if "error" in r or "skipped" in r:
            why = r.get("skipped") or r["error"][:60]
            rows.append(f"| {r['name']} | | {'skipped' if 'skipped' in r else 'failed'}: {why!r} | | | | | | |")
            continue
        rows.append(
            f"| {r['name']} | {speed(r)} | {f(r['tokens_per_s'], ',.0f')} | {f(r['step_time_s'], '.3f')} | "
            f"{f(r.get('plan_step_time_s'), '.3f')} | {f(r.get('peak_allocated_gib'), '.2f')} | "
            f"{f(r.get('plan_peak_allocated_gib'), '.2f')} | {f(r.get('mfu_palm'), '.1%')} | "
            f"{f(r.get('mfu_causal'), '.1%')} |"
        )
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="Every case's code path on the CPU, tiny preset.")
    ap.add_argument(
        "--out",
        default=os.environ.get("OUT"),
        help="Folder for results.json, results.md and logs/ (default: $OUT, else bench/results/GPU-DATE)",
    )
    ap.add_argument(
        "--budget",
        type=float,
        default=None,
        help="Seconds for everything; later cases are skipped (default: 540 on a GPU, none with --smoke).",
    )
    ap.add_argument("--logs", default=None, help="Folder for each case's log (default: OUT/logs).")
    ap.add_argument("--only", nargs="*", default=None, help="Run only these cases.")
    ap.add_argument("--child-plain", nargs=2, metavar=("SPEC", "RESULT"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child_plain:
        spec = json.loads(Path(args.child_plain[0]).read_text())
        Path(args.child_plain[1]).write_text(json.dumps(plain_child(spec)))
        return
    started = time.monotonic()
    budget = args.budget if args.budget is not None else (None if args.smoke else 540.0)
    out_dir = Path(
        args.out or ROOT / "bench" / "results" / f"{'cpu-smoke' if args.smoke else 'gpu'}-{time.strftime('%Y-%m-%d')}"
    )
    logs = Path(args.logs) if args.logs else out_dir / "logs"
    for folder in (out_dir, logs):
        folder.mkdir(parents=True, exist_ok=True)
    doc: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d"),
        "smoke": args.smoke,
        "budget_s": budget,  # None: no deadline (a smoke run)
        "mfu_convention": "PaLM: 6N + 12*L*h*s per token (N without the input embedding); causal: 6N + 6*L*h*s",
        "cases": [],
    }
    results_path = out_dir / "results.json"

    def save() -> None:
        doc["elapsed_s"] = round(time.monotonic() - started, 1)
        results_path.write_text(json.dumps(doc, indent=2))  # after every step: a later timeout loses nothing

    doc["preflight"] = preflight(out_dir)
    save()
    if doc["preflight"]["missing"]:
        raise SystemExit(f"missing: {'; '.join(doc['preflight']['missing'])} (see {results_path})")
    import torch

    from pipeline.plan.gpus import GPU, lookup

    cuda = torch.cuda.is_available() and not args.smoke
    if not cuda and not args.smoke:
        raise SystemExit("no CUDA device: run with --smoke to check the code paths on the CPU")
    gpu_name = torch.cuda.get_device_name(0) if cuda else "cpu-smoke"
    card: GPU = lookup(gpu_name) if cuda else GPU("CPU", 20.0, 1.0, 20.0, 0, 10.0, True)
    vocab = 32000 if cuda else 4000
    doc.update(gpu=gpu_name, torch=torch.__version__, peak_bf16_tflops=card.bf16_tflops if cuda else None)
    doc["warm_up"] = warm_up(args.smoke, out_dir)
    save()
    print(json.dumps(doc["warm_up"])[:600], flush=True)
    doc["host"] = dataclasses.asdict(Host.here()) if cuda else None
    work = out_dir / ".work"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir()
    try:
        selected = [c for c in cases(args.smoke) if not args.only or c.name in args.only]
        by_name: dict[str, dict[str, Any]] = {}
        ran_on_cpu: dict[tuple[Any, ...], str] = {}
        twin_of: dict[str, str] = {}
        for i, case in enumerate(selected):
            if args.smoke and case.kind == "pipeline":  # on the CPU the GPU switches fall back: one run per path
                twin = ran_on_cpu.setdefault(cpu_path(case), case.name)
                twin_of[case.name] = twin
                if twin != case.name:
                    doc["cases"].append({"name": case.name, "same_cpu_path_as": twin})
                    save()  # a twin may be the last case: results.json must hold it too
                    continue
            left = (math.inf if budget is None else budget) - (time.monotonic() - started)
            if i and case.timeout_s > left:
                doc["cases"].append({"name": case.name, "skipped": f"{case.timeout_s} s needed, {left:.0f} s left"})
                save()
                continue
            case_vocab_size, eos, bos = case_vocab(case, vocab)
            shards = synthetic_shards(work, case.seq_len, case_vocab_size, case.whole_documents, eos, bos)
            timeout = min(case.timeout_s * (3 if args.smoke else 1), max(30.0, left))
            if case.kind == "plain":
                result = run_plain(case, shards, work, logs, vocab, args.smoke, timeout)
            elif case.kind == "stage4":
                result = run_stage4(case, work, logs, args.smoke, timeout)
            elif case.kind == "eval":
                result = run_eval(case, work, logs, args.smoke, timeout)
            elif case.kind == "slices":
                result = run_slices(case, shards, work, logs, args.smoke, timeout)
                whole = by_name.get("1b_default") or by_name.get(twin_of.get("1b_default", ""))
                result |= beside_whole(result, whole)
            else:
                result = run_pipeline(case, shards, work, logs, args.smoke, timeout)
            result = {
                "name": case.name,
                "note": case.note,
                **result,
                **planned(case, vocab, card, work, out_dir / PROBE, smoke=args.smoke),
                **mfu(result, case, vocab, card.bf16_tflops if cuda else None, work),
            }
            by_name[case.name] = result
            doc["cases"].append(result)
            doc["verdict_70b_80_layers"] = slope_verdict(by_name, CAP_GIB)
            save()
            print(json.dumps(result)[:400], flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)  # run folders hold no checkpoint; the logs stay in OUT/logs
    md = table(doc["cases"])
    (out_dir / "results.md").write_text(md + "\n")
    print(md)
    print(f"wrote {results_path}")
    if any("error" in r for r in doc["cases"]):
        sys.exit(1)


if __name__ == "__main__":
    main()
