"""Rendering of a plan for people (`pipeline plan`), and hostfile parsing."""

from __future__ import annotations

import re
from pathlib import Path

from pipeline.errors import PipelineError
from pipeline.plan.search import Estimate, GiB, Plan, activation_bytes


def _days(tokens: float, tps: float) -> str:
    d = tokens / tps / 86400
    return f"{d / 365:.1f} years" if d > 365 else f"{d:.1f} days" if d >= 1 else f"{d * 24:.1f} hours"


def render(p: Plan, token_budget: float | None = None) -> str:
    c, s = p.cluster, p.shape
    lines = [f"model {s.num_params() / 1e9:.2f}B parameters (h {s.hidden_size}, {s.num_layers} layers, ffn "
             f"{s.ffn_hidden_size}, {s.num_heads} heads / {s.num_kv_heads} kv, vocab {s.vocab_size}), seq {p.seq_len}",
             f"cluster {c.nodes} node(s) x {c.gpus_per_node} {c.gpu.name} ({c.gpu.memory_gib:.1f} GiB, "
             f"{c.gpu.bf16_tflops:g} TF bf16 dense, PCIe {c.gpu.pcie_gen}, P2P {'yes' if c.gpu.p2p else 'no'}), "
             f"{c.cpu_mem_bytes / 1e9:.0f} GB RAM/node, {c.network_gbps:g} Gbps"
             + (f", NVMe {c.nvme_bytes / 1e12:.1f} TB/node" if c.nvme_bytes else ", no NVMe")]
    if p.best is None:
        lines.append("\nNOTHING FITS. Closest rejected configurations:")
        shown: set[str] = set()
        def overshoot(e: Estimate) -> float:  # how far over its worst limit a configuration is
            ratios = (e.gpu["total"] / (c.gpu.memory_gib * GiB), e.host["total"] / (0.8 * c.cpu_mem_bytes),
                      e.nvme_bytes / c.nvme_bytes if c.nvme_bytes else (2.0 if e.nvme_bytes else 0.0))
            return sum(max(0.0, r - 1.0) for r in ratios)

        for e in sorted(p.rejected, key=overshoot):
            if e.candidate.label() not in shown and len(shown) < 5:
                shown.add(e.candidate.label())
                lines.append(f"  {e.candidate.label():62s} {'; '.join(e.why_not)}")
        lines.append("What would fit:")
        lines += [f"  - {a}" for a in p.advice]
        return "\n".join(lines)
    e, cand = p.best, p.best.candidate
    gb = cand.micro_batch_size * cand.grad_accum * c.world
    lines += [f"\nchosen: {cand.label()}",
              f"  global batch {gb} sequences x {p.seq_len} = {gb * p.seq_len / 1e6:.2f}M tokens per step; "
              f"buckets: reduce {cand.reduce_bucket:.0e}, prefetch {cand.prefetch_bucket:.0e}, "
              f"max live {cand.max_live:.0e}, sub-group {cand.sub_group:.0e}",
              "\nper GPU memory                    GiB"]
    names = {"params": "parameters", "grads": "gradients", "optimizer": "optimizer states",
             "working_layer": "gathered largest layer (ZeRO-3)", "ds_buffers": "DeepSpeed buckets",
             "activations": "activations" + (" (checkpointed)" if cand.activation_checkpointing else ""),
             "logits": "logits + loss", "cuda_context": "CUDA context", "fragmentation": "allocator slack (10%)"}
    for k, label in names.items():
        lines.append(f"  {label:31s} {e.gpu[k] / GiB:7.2f}")
    act_other = activation_bytes(s, p.seq_len, cand.micro_batch_size, not cand.activation_checkpointing)["layers"]
    lines += [f"  {'total':31s} {e.gpu['total'] / GiB:7.2f} of {c.gpu.memory_gib:.1f}",
              f"  (activations {'without' if cand.activation_checkpointing else 'with'} checkpointing would be "
              f"{act_other / GiB:.2f} GiB; DeepSpeed's model-state estimator: "
              f"{e.gpu['model_states_deepspeed'] / GiB:.2f} GiB)",
              f"\nper node host RAM: pinned {e.host['pinned'] / 1e9:.0f} GB + pageable {e.host['pageable'] / 1e9:.0f} GB"
              f" = {e.host['total'] / 1e9:.0f} GB of {c.cpu_mem_bytes / 1e9:.0f} GB (limit 80%); "
              f"NVMe {e.nvme_bytes / 1e12:.2f} TB",
              f"\nstep time {e.step_time_s:,.1f} s: compute {e.time['compute']:,.1f} s (at {p.mfu_assumed:.0%} MFU"
              f"{', +1/3 recompute' if cand.activation_checkpointing else ''}), network {e.time['network']:,.1f} s, "
              f"PCIe {e.time['pcie']:,.1f} s, optimizer {e.time['optimizer']:,.1f} s, "
              f"collective latency {e.time['collective_latency']:,.1f} s (compute/network/PCIe overlap partly)",
              f"throughput {e.tokens_per_s:,.0f} tokens/s (physical ceiling at 100% of peak: "
              f"{e.ceiling_tokens_per_s:,.0f} tokens/s), MFU {e.mfu:.1%}"]
    budget = token_budget or 1e9
    lines.append(f"time to {budget / 1e9:g}B tokens: {_days(budget, e.tokens_per_s)}; to 20 tokens/parameter "
                 f"({20 * s.num_params() / 1e9:,.0f}B tokens): {_days(20 * s.num_params(), e.tokens_per_s)}")
    if p.ranked[1:]:
        lines.append("\nrunners-up                                                        tok/s   GPU GiB  host GB")
        seen = {cand.label()}
        for r in p.ranked[1:]:
            if r.candidate.label() in seen:
                continue
            seen.add(r.candidate.label())
            lines.append(f"  {r.candidate.label():62s} {r.tokens_per_s:7,.0f} {r.gpu['total'] / GiB:8.1f} "
                         f"{r.host['total'] / 1e9:8.0f}")
            if len(seen) > 5:
                break
    lines.append("\nrejected (each family at its smallest micro-batch)")
    best_of: dict[tuple, Estimate] = {}
    for r in p.rejected:
        key = (r.candidate.stage, r.candidate.offload_optimizer, r.candidate.offload_param,
               r.candidate.activation_checkpointing)
        if key not in best_of or r.gpu["total"] < best_of[key].gpu["total"]:
            best_of[key] = r
    for r in sorted(best_of.values(), key=lambda r: r.gpu["total"])[:8]:
        lines.append(f"  {r.candidate.label():62s} {'; '.join(r.why_not)}")
    return "\n".join(lines)


def parse_hostfile(path: str) -> tuple[int, int]:
    """(nodes, GPUs per node) from a DeepSpeed hostfile (`host slots=N` lines, # comments)."""
    slots = hostfile_slots(path)
    if len(set(slots)) > 1:
        raise PipelineError(f"--hostfile {path}: hosts with different slot counts ({', '.join(map(str, slots))}); "
                            "the planner assumes identical nodes: plan a hostfile of the smaller nodes")
    return len(slots), slots[0]


def hostfile_slots(path: str) -> list[int]:
    """The slots of each host of a DeepSpeed hostfile, in order."""
    p = Path(path)
    if not p.is_file():
        raise PipelineError(f"--hostfile {path}: {'is a folder' if p.is_dir() else 'no such file'} (see hostfiles/)")
    slots = []
    with open(path) as f:
        for n, line in enumerate(f, start=1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            m = re.match(r"^(\S+)\s+slots=(\d+)", line)
            if not m:
                raise PipelineError(f"{path}:{n}: expected 'HOST slots=N', got {line!r}")
            if int(m.group(2)) < 1:
                raise PipelineError(f"{path}:{n}: slots={m.group(2)}; a host needs 1 slot or more")
            slots.append(int(m.group(2)))
    if not slots:
        raise PipelineError(f"{path}: no hosts")
    return slots
