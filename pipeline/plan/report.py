"""Rendering of a plan for people (`pipeline plan`), and the table of what fits each reference cluster
(docs/planning.md).

One job: words and tables of a plan, for the terminal, the JSON and the docs; nothing here prices anything."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pipeline
from pipeline.model import PRESET_GEOMETRY, preset_note, resolve_shape
from pipeline.plan.cluster import TRAINER, Cluster, Layout
from pipeline.plan.estimate import FITTED, Estimate
from pipeline.plan.facts import cluster_from_flags
from pipeline.plan.memory import GiB
from pipeline.plan.search import LONG_SEQ, THIN_GIB, Plan, free_gib, search
from pipeline.plan.timing import ASSUMED_SPREAD, MEASURED_SPREAD, RANGE


def _days(tokens: float, tps: float) -> str:
    d = tokens / tps / 86400
    return f"{d / 365:.1f} years" if d > 365 else f"{d:.1f} days" if d >= 1 else f"{d * 24:.1f} hours"


def header(p: Plan) -> list[str]:
    c, s = p.cluster, p.shape
    preset = preset_note(s)
    return [
        f"model {s.num_params() / 1e9:.2f}B parameters (h {s.hidden_size}, {s.num_layers} layers, ffn "
        f"{s.ffn_hidden_size}, {s.num_heads} heads / {s.num_kv_heads} kv, vocab {s.vocab_size}), seq {p.seq_len}"
        + (f"; {preset}" if preset else ""),
        f"cluster {c.nodes} node(s) x {c.gpus_per_node} {c.gpu.name} ({c.gpu.memory_gib:.1f} GiB, "
        f"{c.gpu.bf16_tflops:g} TF bf16 dense, PCIe {c.gpu.pcie_gen}, P2P {'yes' if c.gpu.p2p else 'no'}), "
        f"{c.cpu_mem_bytes / 1e9:.0f} GB RAM and {c.cpu_cores} cores/node, {c.network_gbps:g} Gbps"
        + (f", NVMe {c.nvme_bytes / 1e12:.1f} TB/node" if c.nvme_bytes else ", no NVMe"),
    ]


def provenance(e: Estimate) -> str:
    """One line: which of the plan's rates were measured (by `pipeline probe`, a run, a GPU bench) and which are
    assumed (fitted to published runs on other hosts), as the estimate's `assumed` list says."""
    measured = [f for f, _, src in e.assumed if not src.startswith(FITTED)]
    assumed = [f for f, _, src in e.assumed if src.startswith(FITTED)]
    return f"figures: measured: {', '.join(measured) or 'none'}; assumed: {', '.join(assumed) or 'none'}" + (
        " (`pipeline probe` on a node measures CPU Adam and the GEMMs; the range says how far assumed ones go)"
    ) * bool(assumed)


def render(p: Plan, token_budget: float | None = None) -> str:
    c = p.cluster
    lines = ([provenance(p.best)] if p.best is not None else []) + header(p)
    if p.best is None:
        lines.append("\nNOTHING FITS. Closest rejected configurations:")
        shown: set[str] = set()

        def overshoot(e: Estimate) -> float:  # how far over its worst limit a configuration is
            ratios = (
                (e.gpu["reserved"] + e.gpu["margin"]) / (c.gpu.memory_gib * GiB),
                e.host["total"] / (0.8 * c.cpu_mem_bytes),
                e.nvme_bytes / c.nvme_bytes if c.nvme_bytes else (2.0 if e.nvme_bytes else 0.0),
            )
            return sum(max(0.0, r - 1.0) for r in ratios)

        for e in sorted(p.rejected, key=overshoot):
            if e.layout.label() not in shown and len(shown) < 5:
                shown.add(e.layout.label())
                lines.append(f"  {e.layout.label():62s} {'; '.join(e.why_not)}")
        lines.append("What would fit:")
        lines += [f"  - {a}" for a in p.advice]
        return "\n".join(lines)
    e = p.best
    lines += describe_estimate(p, e, token_budget)
    if notes := p.feature_notes():
        lines.append("\nDeepSpeed 0.19 offload features (each against the choice; planned, not measured):")
        lines += [f"  {n}" for n in notes]
    if p.ranked[1:]:
        w = label_width(p.ranked[1:8])
        lines.append(f"\n{'runners-up':{w + 2}s} {'tok/s':>7s} {'GPU GiB':>8s} {'host GB':>8s}")
        seen = {row_label(e.layout)}
        for r in p.ranked[1:]:
            if row_label(r.layout) in seen:
                continue
            seen.add(row_label(r.layout))
            lines.append(
                f"  {row_label(r.layout):{w}s} {r.tokens_per_s:7,.0f} {r.gpu['reserved'] / GiB:8.1f} "
                f"{r.host['total'] / 1e9:8.0f}"
            )
            if len(seen) > 5:
                break
    lines.append("\nrejected (each family at its smallest micro-batch)")
    best_of: dict[tuple, Estimate] = {}
    for r in p.rejected:
        key = (
            r.layout.stage,
            r.layout.offload_optimizer,
            r.layout.offload_param,
            r.layout.activation_checkpointing,
        )
        if key not in best_of or r.gpu["reserved"] < best_of[key].gpu["reserved"]:
            best_of[key] = r
    rejected = sorted(best_of.values(), key=lambda r: r.gpu["reserved"])[:8]
    w = label_width(rejected)
    for r in rejected:
        lines.append(f"  {row_label(r.layout):{w}s} {'; '.join(r.why_not)}")
    return "\n".join(lines)


def _verdict(e: Estimate) -> str:
    """Why a configuration does not run, in two words: the trainer refuses it, or it does not fit."""
    return "REFUSED" if any(w.startswith("refused: ") for w in e.why_not) else "DOES NOT FIT"


def label_width(rows: list[Estimate]) -> int:
    """The column the rows' labels fill: 74 characters, or the longest label (with the offload-feature names)."""
    return max([74] + [len(row_label(r.layout)) for r in rows])


def range_line(c: Cluster, e: Estimate | None = None) -> str:
    """What the printed range spans: every rate's factors, narrower for what `pipeline probe` measured, wider for
    the host rates real hosts spread over when assumed (ASSUMED_SPREAD, where the configuration uses them), and the
    network's efficiency."""
    measured = (
        f" ({', '.join(sorted(c.measured))}, measured: x{RANGE[0] ** MEASURED_SPREAD:.2f}-x"
        f"{RANGE[1] ** MEASURED_SPREAD:.2f})"
        if c.measured
        else ""
    )
    used = set()
    if e is not None:
        used |= {"cpu_adam"} if e.layout.offload_optimizer != "none" else set()
        used |= {"param_fetch"} if e.layout.offload_param != "none" else set()
    names = {"cpu_adam": "CPU Adam", "param_fetch": "the parameter fetch"}
    wide = [
        f"{names[k]} x{lo:g}-x{hi:g}" for k, (lo, hi) in ASSUMED_SPREAD.items() if k in used and k not in c.measured
    ]
    assumed = (
        f"; assumed host rates as real hosts spread: {', '.join(wide)} (`pipeline probe` measures CPU Adam)"
        if wide
        else ""
    )
    network = "6-12 GB/s per 100 Gbps (sockets: no GPUDirect RDMA)" if not c.gpu.gpudirect else "90-98% of line rate"
    return f"  the range: every rate x{RANGE[0]:g}-x{RANGE[1]:g}{measured}{assumed} and the network's {network}"


def describe_estimate(p: Plan, e: Estimate, token_budget: float | None = None, title: str = "chosen") -> list[str]:
    """One configuration's memory, host RAM, step time (point and range) and throughput, for people."""
    return [
        *_configuration_lines(p, e, title),
        *_gpu_lines(p, e),
        *_host_lines(p, e),
        *_time_lines(p, e, token_budget or 1e9),
    ]


def _configuration_lines(p: Plan, e: Estimate, title: str) -> list[str]:
    """What the configuration is: its label and fit, the global batch, the long-context levers, its warnings."""
    c, cand = p.cluster, e.layout
    gb = cand.micro_batch_size * cand.grad_accum * c.world // cand.sequence_parallel
    unsaved = any(w.startswith("checkpoint disk") for w in e.warnings)
    lines = [
        f"\n{title}: {cand.label()}"
        + ("" if e.fits else f"  -- {_verdict(e)}: " + "; ".join(w.removeprefix("refused: ") for w in e.why_not))
        + ("  -- BUT ITS CHECKPOINTS DO NOT FIT THE DISK (below)" if e.fits and unsaved else ""),
        f"  global batch {gb} sequences x {p.seq_len} = {gb * p.seq_len / 1e6:.2f}M tokens per step; "
        f"buckets: reduce {cand.reduce_bucket:.0e}, prefetch {cand.prefetch_bucket:.0e}, "
        f"max live {cand.max_live:.0e}, sub-group {cand.sub_group:.0e}",
    ]
    if p.global_batch_tokens and abs(gb * p.seq_len - p.global_batch_tokens) > 0.01 * p.global_batch_tokens:
        lines.append(
            f"  note: {p.global_batch_tokens:,} tokens per step were asked for; whole micro-batches on "
            f"{c.world} GPUs give {gb * p.seq_len:,}"
        )
    if cand.sequence_parallel > 1 or cand.tiled_mlp > 1 or p.seq_len > 8192:
        n, tiles = cand.sequence_parallel, cand.tiled_mlp
        lines.append(
            f"  long context: sequence parallel {n} ({n} rank(s) share each sample, {p.seq_len // n:,} tokens each; "
            f"train.sequence_parallel: {n}), "
            + (f"MLP in {tiles} tiles (train.tiled_mlp: {tiles})" if tiles > 1 else "MLP untiled")
        )
    if p.stack is not None and p.stack.whole_documents:
        lines.append(
            "  documents: whole, kept apart by FlashAttention-2's varlen kernel from their positions (no mask)"
            if p.stack.varlen
            else f"  documents: whole, kept apart by SDPA's dense mask ({e.gpu['document_mask'] / GiB:.2f} GiB priced: "
            "the boolean mask and the bias each kept layer makes of it; no sequence parallelism). With flash_attn on "
            "the cluster (pip install -e '.[flash]'; --document-attention varlen) no mask is needed"
        )
    if p.stack is not None and p.stack.packages is not None:
        lines.append("  " + _kernels_line(p, e))
    return lines + [f"  {w}" for w in e.warnings]


def _kernels_line(p: Plan, e: Estimate) -> str:
    """Which modules the plan priced, and the kernel packages it took as installed on the nodes (and from where)."""
    assert p.stack is not None and p.stack.packages is not None
    sw = p.stack.resolved(p.shape, e.layout).switches
    used = f"{sw.kernels} kernels" if sw and sw.kernels != "torch" else "transformers' modules"
    used += ", compiled" if sw and sw.compiled else ""
    if p.cluster.packages is None:
        known = (
            "no kernel package known installed on the nodes; --packages liger-kernel,flash-attn, or `pipeline probe` "
            "on a node, says which are"
        )
    else:
        known = f"packages on the nodes: {', '.join(sorted(p.cluster.packages)) or 'none'}"
    return f"kernels priced: {used}; {known}"


def _gpu_lines(p: Plan, e: Estimate) -> list[str]:
    """Per GPU memory, part by part, then the peak, what the card must hold and the margin."""
    lines = ["\nper GPU memory                    GiB"]
    names = {
        "params": "parameters",
        "grads": "gradients",
        "optimizer": "optimizer states",
        "working_layer": "gathered largest layer (ZeRO-3)",
        "ds_buffers": "DeepSpeed buckets",
        "activations": "activations" + (" (checkpointed)" if e.layout.activation_checkpointing else ""),
        "logits": "loss (logits, one chunk)" if e.gpu["logits"] else "loss",
        **({"document_mask": "documents' dense mask and bias"} if e.gpu.get("document_mask") else {}),
    }
    for k, label in names.items():
        lines.append(f"  {label:31s} {e.gpu[k] / GiB:7.2f}")
    g = e.gpu
    card = p.cluster.gpu.memory_gib
    return lines + [
        f"  {'peak allocated':31s} {g['peak_allocated'] / GiB:7.2f}   (torch.cuda.max_memory_allocated; at the "
        f"{'end' if g['peak_phase_backward'] else 'start'} of the backward)",
        f"  {'reserved':31s} {g['reserved'] / GiB:7.2f}   (+{g['fragmentation'] / GiB:.2f} allocator slack on "
        f"transients, +{g['cuda_context'] / GiB:.1f} CUDA context: what the card must hold)",
        f"  {'margin kept':31s} {g['margin'] / GiB:7.2f}   (max(1.5 GiB, 7%)); card {card:.1f}, "
        f"free after all: {card - (g['reserved'] + g['margin']) / GiB:.2f}",
        *thin_note(p, e),
    ]


def thin_note(p: Plan, e: Estimate) -> list[str]:
    """At LONG_SEQ tokens and more, a fitting plan with less than THIN_GIB free after the margin says so, and what
    would leave that much (the fastest such configuration the search found, or that none does); a plan chosen for
    its room (pipeline.plan.search.roomy_first) names the faster one it passed over."""
    if not e.fits or p.seq_len < LONG_SEQ:
        return []
    if (free := free_gib(p.cluster, e)) >= THIN_GIB:
        fastest = max(p.ranked, key=lambda r: r.tokens_per_s)
        if fastest.tokens_per_s <= e.tokens_per_s:
            return []
        return [
            f"  room: chosen for the {free:.2f} GiB it leaves after the margin at {p.seq_len:,} tokens; the fastest "
            f"that fits, {fastest.layout.label()}, leaves {free_gib(p.cluster, fastest):.2f} GiB at "
            f"{fastest.tokens_per_s / e.tokens_per_s:.2f}x"
        ]
    roomy = next((r for r in p.ranked if free_gib(p.cluster, r) >= THIN_GIB), None)
    head = (
        f"  thin: {free:.2f} GiB free after the margin at {p.seq_len:,} tokens, where single activations are "
        "GiB-sized and the long-context terms are counted on the CPU, not yet measured on a GPU; "
    )
    if roomy is None:
        return [head + f"no configuration here leaves {THIN_GIB} GiB: one more node, or a shorter seq_len"]
    return [
        head + f"{roomy.layout.label()} leaves {free_gib(p.cluster, roomy):.2f} GiB at "
        f"{roomy.tokens_per_s:,.0f} tokens/s ({roomy.tokens_per_s / e.tokens_per_s:.2f}x)"
    ]


def _host_lines(p: Plan, e: Estimate) -> list[str]:
    """Host RAM per node and the checkpoint's bytes on disk."""
    c, h, ck = p.cluster, e.host, e.checkpoint
    return [
        f"\nper node host RAM: pinned {h['pinned'] / 1e9:.0f} GB (as torch rounds it) + pageable "
        f"{h['pageable'] / 1e9:.0f} GB = {h['itemized'] / 1e9:.0f} GB"
        + (f" (DeepSpeed's estimator: {h['deepspeed_estimate'] / 1e9:.0f} GB)" if h["deepspeed_estimate"] else "")
        + f"; limit 80% of {c.cpu_mem_bytes / 1e9:.0f} GB; NVMe {e.nvme_bytes / 1e12:.2f} TB",
        f"checkpoint: {ck['per_node'] / 1e9:,.1f} GB on the first node ({ck['total'] / 1e9:,.0f} GB in all; "
        f"weights only {ck['weights_only'] / 1e9:,.1f} GB)"
        + (f"; disk {c.disk_bytes / 1e9:,.0f} GB per node" if c.disk_bytes else "; disk not given (--disk)"),
    ]


def _time_lines(p: Plan, e: Estimate, budget: float) -> list[str]:
    """Step time by part, throughput beside the ceiling, what was assumed, and the time to a token budget."""
    t, s = e.time, p.shape
    lo, hi = e.step_time_range_s
    tlo, thi = e.tokens_per_s_range
    return [
        f"\nstep time {e.step_time_s:,.2f} s (range {lo:,.2f}-{hi:,.2f} s): compute {t['compute']:,.2f} s "
        f"(at {t['efficiency']:.0%} of peak{', +1/3 recompute' if e.layout.activation_checkpointing else ''}), "
        f"network {t['network']:,.2f} s, host copies {t['host_copies']:,.2f} s, parameter fetch "
        f"{t['param_fetch']:,.2f} s, optimizer {t['optimizer']:,.2f} s, collective latency "
        f"{t['collective_latency']:,.2f} s, "
        + (f"sequence-parallel all-to-all {t['sequence_all_to_all']:,.2f} s, " if t.get("sequence_all_to_all") else "")
        + f"overhead {t['overhead']:,.2f} s (the parts of a micro-step overlap partly)",
        f"throughput {e.tokens_per_s:,.0f} tokens/s (range {tlo:,.0f}-{thi:,.0f}; physical ceiling at 100% of "
        f"peak: {e.ceiling_tokens_per_s:,.0f}), MFU {e.mfu:.1%} (PaLM count: 6N + 12*L*h*s per token)",
        range_line(p.cluster, e),
        "assumed:",
        *(f"  {figure} {value} ({source})" for figure, value, source in e.assumed),
        f"time to {budget / 1e9:g}B tokens: {_days(budget, e.tokens_per_s)} (range "
        f"{_days(budget, thi)} to {_days(budget, tlo)}); to 20 tokens/parameter "
        f"({20 * s.num_params() / 1e9:,.0f}B tokens): {_days(20 * s.num_params(), e.tokens_per_s)}",
    ]


def fits_table(rows: list[tuple[str, str, Plan]], token_budget: float = 1e9) -> str:
    """Markdown: for each (preset, hostfile, plan), what fits, how fast, and what it needs per node."""
    out = [
        "| model | cluster | fits | tokens/s | days per 1B tokens | host RAM per node | checkpoint per node |",
        "|---|---|---|---:|---:|---:|---:|",
    ]
    for preset, hostfile, p in rows:
        c = p.cluster
        where = f"{Path(hostfile).name} ({c.nodes}x{c.gpus_per_node}, {c.cpu_mem_bytes / 1e9:.0f} GB)"
        e = p.best
        if e is None:
            closest = min(p.rejected, key=lambda r: len(r.why_not))
            reason = "; ".join(a for a in p.advice if "largest preset" not in a) or closest.why_not[0]
            out.append(f"| {preset} | {where} | no: {reason} | | | | |")
            continue
        lo, hi = e.tokens_per_s_range
        days = f"{token_budget / hi / 86400:.2f}-{token_budget / lo / 86400:.2f}"
        note = " (a safe save does not fit the disk)" if any("checkpoint disk" in w for w in e.warnings) else ""
        out.append(
            f"| {preset} | {where} | {e.layout.label()} | {lo:,.0f}-{hi:,.0f} | {days} | "
            f"{e.host['total'] / 1e9:,.0f} GB | {e.checkpoint['per_node'] / 1e9:,.0f} GB{note} |"
        )
    presets = sorted({preset for preset, _, _ in rows if preset in PRESET_GEOMETRY}, key=list(PRESET_GEOMETRY).index)
    if presets:
        out += ["", "Presets: " + "; ".join(f"{name}, {PRESET_GEOMETRY[name]}" for name in presets) + "."]
    return "\n".join(out)


REFERENCE_HOSTFILES = ("8node", "4node4gpu")
"""The clusters users name, as hostfiles/ describes them: the rows of docs/planning.md's "what fits where" table."""


def reference_fits_table(
    flags: dict[str, str | None],
    vocab_size: int,
    seq_len: int,
    global_batch_tokens: int,
    mfu: float | None,
    budget: float,
) -> str:
    """`plan --fits-table`: docs/planning.md's table of presets 1b-70b on each reference hostfile."""

    hostfiles = Path(pipeline.__file__).resolve().parents[1] / "hostfiles"
    rows = []
    for hf in REFERENCE_HOSTFILES:
        c, _ = cluster_from_flags(str(hostfiles / hf), 1, 1, flags)
        for name in ("1b", "7b", "13b", "70b"):
            shape = resolve_shape(name, {}, vocab_size)
            stack = replace(TRAINER, packages=c.installed)
            rows.append((name, f"hostfiles/{hf}", search(shape, seq_len, c, global_batch_tokens, mfu, stack=stack)))
    return fits_table(rows, budget)


def row_label(c: Layout) -> str:
    """A candidate in the runners-up and rejected lists: ZeRO-3's differ by their bucket set too."""
    return c.label() + (f", buckets {c.reduce_bucket:.0e}" if c.stage == 3 or c.reduce_bucket != 5e8 else "")


LONG_CONTEXT_PLANS = (
    ("Llama-3.1-70B at 32K", "configs/hf/llama-3.1-70b.json", 32768, "8node", None),
    ("the same, whole documents on the varlen path", "configs/hf/llama-3.1-70b.json", 32768, "8node", "varlen"),
    ("the same, whole documents on SDPA's dense mask", "configs/hf/llama-3.1-70b.json", 32768, "8node", "dense"),
    ("the 70b preset (Llama-2-70B's geometry) at 32K", "70b", 32768, "8node", None),
    ("7B at 128K", "7b", 131072, "4node4gpu", None),
)
"""docs/long-context.md's plans: (row, model, seq_len, reference hostfile, whole documents on which path)."""


def long_context_table(flags: dict[str, str | None], global_batch_tokens: int, mfu: float | None) -> str:
    """`plan --long-context-table`: docs/long-context.md's table, each headline plan as the planner makes it."""

    from pipeline.plan.search import planned_shape

    hostfiles = Path(pipeline.__file__).resolve().parents[1] / "hostfiles"
    root = hostfiles.parent
    out = [
        "| model, sequence | cluster | chosen | tokens/s | free after the margin |",
        "|---|---|---|---:|---:|",
    ]
    for label, model, seq_len, hf, documents in LONG_CONTEXT_PLANS:
        c, _ = cluster_from_flags(str(hostfiles / hf), 1, 1, flags)
        where = f"{hf} ({c.nodes}x{c.gpus_per_node} {c.gpu.name})"
        path = str(root / model) if model.endswith(".json") else model
        shape, _ = planned_shape(path, None, 32000, seq_len)
        stack = replace(
            TRAINER, whole_documents=documents is not None, varlen=documents == "varlen", packages=c.installed
        )
        p = search(shape, seq_len, c, global_batch_tokens, mfu, stack=stack)
        e = p.best
        if e is None:
            closest = min(p.rejected, key=lambda r: r.gpu["reserved"])
            over = (closest.gpu["reserved"] + closest.gpu["margin"]) / GiB - c.gpu.memory_gib
            out.append(f"| {label} | {where} | nothing fits (the closest is {over:.1f} GiB over) | | |")
            continue
        lo, hi = e.tokens_per_s_range
        out.append(
            f"| {label} | {where} | {e.layout.label()} | {e.tokens_per_s:,.0f} ({lo:,.0f}-{hi:,.0f}) | "
            f"{free_gib(p.cluster, e):.2f} GiB |"
        )
    return "\n".join(out)
