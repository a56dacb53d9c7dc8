"""Attention that keeps packed documents apart and honours sliding windows from the tokens' positions alone, with no
(seq x seq) mask: FlashAttention-2's variable-length kernel (`flash_attn`, an optional extra for CUDA clusters), or,
where it cannot run (the CPU, where the project is tested), a reference of the same contract that computes each
document's attention apart. Both are one attention function registered with transformers (`VARLEN`), so the
model code, DeepSpeed's Ulysses sequence parallelism (which hands the core attention the whole sequence's
`position_ids` after its all-to-all, and drops every mask) and activation checkpointing use it unchanged.

Which path a run takes (`choose_documents`) and what under sequence parallelism would silently train another model
(`sequence_parallel_attention_problems`) are decided here, before launch, from the model's own transformers
config. No distributed code."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Any, Literal

from pipeline.model import ModelShape, model_config

VARLEN = "pipeline_varlen"
"""The attention implementation's name in transformers' registry (and in the model config)."""

DYNAMIC_ROPE = ("dynamic", "longrope")
"""RoPE variants whose frequencies transformers picks from the largest position in the call: under sequence
parallelism each rank sees only its share of the positions, so the ranks of one sample would rotate it with
different frequencies."""


# ---- what the model's attention is, read from its transformers config -------------------------------------------


@dataclass(frozen=True, slots=True)
class AttentionFacts:
    """What decides whether masks matter for a model: its sliding window (on any layer) and its RoPE variants."""

    sliding_window: int | None
    """The window of the layers that slide (None: every layer attends to the whole causal past)."""
    rope_types: tuple[str, ...]

    def window_applies(self, seq_len: int) -> bool:
        """A window as long as the sample masks nothing a causal mask does not."""
        return self.sliding_window is not None and self.sliding_window < seq_len


def attention_facts(shape: ModelShape) -> AttentionFacts:
    """The model's sliding window and RoPE variants as transformers builds it (Mistral's `sliding_window`; Qwen's
    `use_sliding_window` with `layer_types`; our presets' `model.rope`). A preset is a LlamaConfig without a window
    whose RoPE is its own `rope`: read without building a transformers config (no import on the planner's path)."""
    if shape.hf_config is None:
        return AttentionFacts(None, (str((shape.rope or {}).get("rope_type", "default")),))
    config = model_config(shape)
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if isinstance(layer_types, (list, tuple)) and "sliding_attention" not in layer_types:
        window = None
    return AttentionFacts(int(window) if window else None, tuple(sorted(_rope_types(config))))


def _rope_types(config: Any) -> set[str]:
    found: set[str] = set()

    def walk(params: Any) -> None:
        if isinstance(params, dict):
            kind = params.get("rope_type") or params.get("type")
            if isinstance(kind, str):
                found.add(kind)
            for value in params.values():
                if isinstance(value, dict):  # per layer type (sliding and full layers with their own RoPE)
                    walk(value)

    walk(getattr(config, "rope_parameters", None))
    walk(getattr(config, "rope_scaling", None))
    return found or {"default"}


# ---- the choice: varlen, or SDPA with transformers' dense mask ---------------------------------------------------

DocumentSetting = Literal["auto", "varlen", "dense"]


def varlen_available(device_type: str) -> bool:
    """FlashAttention-2's varlen kernel on a CUDA GPU (the 4090's sm_89 included: only FlashAttention-3 needs
    Hopper) where `flash_attn` is installed; the reference elsewhere (always)."""
    if device_type == "cuda":
        return importlib.util.find_spec("flash_attn") is not None
    return True


@dataclass(frozen=True, slots=True)
class DocumentAttention:
    kind: Literal["sdpa", "varlen", "dense"]
    """sdpa: no mask matters (plain causal SDPA); varlen: VARLEN, no mask; dense: SDPA with transformers' (seq x
    seq) mask (documents apart, or the sliding window)."""
    note: str
    """One line for the run's log: the path and what it costs."""

    @property
    def implementation(self) -> str:
        """transformers' attn_implementation for the model."""
        return VARLEN if self.kind == "varlen" else "sdpa"

    @property
    def dense_mask(self) -> bool:
        return self.kind == "dense"


NO_MASKS = DocumentAttention("sdpa", "attention masks: none needed (causal SDPA)")


def choose_documents(
    setting: DocumentSetting,
    *,
    whole_documents: bool,
    facts: AttentionFacts,
    seq_len: int,
    micro_batch_size: int,
    device_type: str,
) -> DocumentAttention:
    """`train.document_attention` resolved: where masks matter (whole-document shards, or a sliding window shorter
    than the sample) auto takes the varlen path where it is available and SDPA with the dense mask elsewhere."""
    why = [
        *(["documents apart (whole-document shards)"] if whole_documents else []),
        *([f"a sliding window of {facts.sliding_window}"] if facts.window_applies(seq_len) else []),
    ]
    if setting == "dense" or (setting == "auto" and why and not varlen_available(device_type)):
        if not why:
            return NO_MASKS
        mask = micro_batch_size * seq_len**2
        fallback = " (flash_attn is not installed: pip install -e '.[flash]' for the varlen path)"
        fallback = fallback if setting == "auto" else ""
        return DocumentAttention(
            "dense",
            f"attention masks: {' and '.join(why)} through SDPA with a dense mask{fallback}: a {_binary(mask)} "
            f"boolean mask per micro-batch, and SDPA's kernels other than flash take it as a {_binary(2 * mask)} "
            "additive bias per layer call",
        )
    if setting == "varlen" or why:
        if not varlen_available(device_type):
            return DocumentAttention(
                "dense",
                "attention masks: varlen asked for, but flash_attn is not installed on this CUDA machine (pip "
                "install -e '.[flash]'); SDPA with the dense mask instead",
            )
        kernel = (
            "FlashAttention-2's varlen kernel"
            if device_type == "cuda"
            else f"a per-document reference of FlashAttention-2 varlen's contract on {device_type}"
        )
        return DocumentAttention(
            "varlen",
            f"attention masks: {' and '.join(why) or 'none needed'}, kept from the tokens' positions by {kernel} "
            "(no (seq x seq) mask)",
        )
    return NO_MASKS


def _binary(n: float) -> str:
    """Bytes in the units GPU memory is counted in (GiB, MiB, KiB)."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n:.0f} bytes"


def sequence_parallel_attention_problems(
    size: int, facts: AttentionFacts, seq_len: int, whole_documents: bool, varlen: bool
) -> list[str]:
    """Why `size` ranks sharing a sample would train another model than one rank holding it (empty when they
    would not): DeepSpeed's Ulysses attention drops every mask (so documents and sliding windows survive only on
    the `varlen` path, which reads the gathered positions), and dynamic RoPE variants pick frequencies from each
    rank's own positions."""
    if size == 1:
        return []
    found = []
    field = f"train.sequence_parallel {size}"
    if dynamic := [t for t in facts.rope_types if t in DYNAMIC_ROPE]:
        found.append(
            f"{field}: the model's RoPE ({dynamic[0]}) picks its frequencies from the largest position in each call, "
            "and under sequence parallelism each rank sees only its share of the sample's positions, so one sample "
            "would be rotated with different frequencies; use a static scaling in model.rope (rope_type yarn, "
            "llama3 or linear) or sequence_parallel 1"
        )
    if not varlen:
        if whole_documents:
            found.append(
                f"{field}: the shards hold whole documents packed several to a sample (`pipeline shard "
                "--whole-documents`), and DeepSpeed's sequence-parallel attention over SDPA drops the mask that "
                "keeps them apart; install flash_attn for the varlen path (pip install -e '.[flash]'; "
                "train.document_attention auto or varlen), use sequence_parallel 1, or shard without "
                "--whole-documents"
            )
        if facts.window_applies(seq_len):
            found.append(
                f"{field}: the model attends within a sliding window of {facts.sliding_window} tokens (shorter than "
                f"the {seq_len}-token sample), and DeepSpeed's sequence-parallel attention over SDPA drops the "
                "window's mask, so it would train with full causal attention; install flash_attn for the varlen "
                "path (pip install -e '.[flash]'; train.document_attention auto or varlen), or use "
                "sequence_parallel 1"
            )
    return found


# ---- the attention function ----------------------------------------------------------------------------------


def document_bounds(position_ids: Any, seq_len: int) -> tuple[Any, int]:
    """Pure: (B, T) positions -> the documents' start offsets in the flattened (B*T) tokens plus the end (int32, as
    FlashAttention's cu_seqlens) and the longest document. A document starts where the positions do not continue
    by one (they restart at each document of a whole-document sample) and at every row's start."""
    import torch

    flat = position_ids.reshape(-1)
    start = torch.ones_like(flat, dtype=torch.bool)
    start[1:] = flat[1:] != flat[:-1] + 1
    start[::seq_len] = True
    offsets = torch.nonzero(start).flatten()
    bounds = torch.cat([offsets, offsets.new_tensor([flat.numel()])]).to(torch.int32)
    return bounds, int((bounds[1:] - bounds[:-1]).max())


def varlen_attention(
    module: Any,
    query: Any,
    key: Any,
    value: Any,
    attention_mask: Any,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    position_ids: Any = None,
    **kwargs: Any,
) -> tuple[Any, None]:
    """transformers' attention contract: query (B, Hq, T, D), key and value (B, Hkv, T, D) -> (B, T, Hq, D).
    Causal within each document of `position_ids` (B, T), within `sliding_window` tokens where the layer slides;
    `attention_mask` is never read (transformers builds none for this implementation, Ulysses drops it)."""
    import torch

    batch, heads, seq_len, dim = query.shape
    if position_ids is None:
        position_ids = torch.arange(seq_len, device=query.device).expand(batch, seq_len)
    if position_ids.shape[0] != batch:
        position_ids = position_ids.expand(batch, -1)
    bounds, longest = document_bounds(position_ids, seq_len)
    p = dropout if module.training else 0.0
    if query.is_cuda:
        from flash_attn import flash_attn_varlen_func

        def tokens(t: Any) -> Any:  # (B, H, T, D) -> (B*T, H, D)
            return t.transpose(1, 2).reshape(batch * seq_len, t.shape[1], dim)

        bounds = bounds.to(query.device)
        out = flash_attn_varlen_func(
            tokens(query),
            tokens(key),
            tokens(value),
            bounds,
            bounds,
            longest,
            longest,
            dropout_p=p,
            softmax_scale=scaling,
            causal=True,
            window_size=(sliding_window - 1, 0) if sliding_window else (-1, -1),
        )
        return out.reshape(batch, seq_len, heads, dim), None
    return _per_document(query, key, value, bounds.tolist(), scaling, p, sliding_window), None


def _per_document(
    query: Any, key: Any, value: Any, bounds: list[int], scaling: float | None, dropout: float, window: int | None
) -> Any:
    """The reference: SDPA over each document apart (causal; the window as a mask of that document's length)."""
    import torch
    import torch.nn.functional as F

    batch, heads, seq_len, dim = query.shape

    def flat(t: Any) -> Any:  # (B, H, T, D) -> (H, B*T, D)
        return t.transpose(0, 1).reshape(t.shape[1], batch * seq_len, dim)

    q, k, v = flat(query), flat(key), flat(value)
    pieces = []
    for lo, hi in zip(bounds[:-1], bounds[1:], strict=True):
        mask = None
        if window is not None and window < hi - lo:
            i = torch.arange(hi - lo, device=q.device)
            mask = (i[:, None] >= i[None, :]) & (i[:, None] - i[None, :] < window)
        pieces.append(
            F.scaled_dot_product_attention(
                q[:, lo:hi],
                k[:, lo:hi],
                v[:, lo:hi],
                attn_mask=mask,
                dropout_p=dropout,
                is_causal=mask is None,
                scale=scaling,
                enable_gqa=k.shape[0] != q.shape[0],
            )
        )
    out = torch.cat(pieces, dim=1)  # (H, B*T, D)
    return out.reshape(heads, batch, seq_len, dim).permute(1, 2, 0, 3)  # (B, T, H, D)


def register() -> None:
    """Make VARLEN an attention implementation transformers models can be built with. Once per process: Ulysses
    replaces the registered function by its wrapper around it, which a second registration would undo."""
    from transformers import AttentionInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if VARLEN not in ALL_ATTENTION_FUNCTIONS:
        AttentionInterface.register(VARLEN, varlen_attention)


def use(model: Any, documents: DocumentAttention) -> None:
    """Set the model's attention implementation to the chosen path, before Ulysses wraps it (it checks that the
    model and its core attention agree). transformers reads it at each forward: the mask it builds (none for
    VARLEN) and the function it calls."""
    if documents.kind != "varlen":
        return
    register()
    model.config._attn_implementation = VARLEN
