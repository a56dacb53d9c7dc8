"""The two manifests that cross stages, typed: `PREFIX.manifest.json` of `pipeline tokenize` and
`DIR/manifest.json` of `pipeline shard`, with the one reader of each and the special-token rule.

TypedDicts rather than classes: the files are JSON that other tools read too, and the keys stay what they are on
disk; mypy checks every access."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, TypedDict

from pipeline import __version__
from pipeline.atomic import seal_broken, sha256_file
from pipeline.errors import PipelineError


class TokenizerInfo(TypedDict, total=False):
    path: str
    sha256: str
    kind: str
    """sentencepiece | hf"""
    vocab_size: int
    eos_id: int
    bos_id: int
    pad_id: int
    """-1 when the tokenizer has none."""
    trained: bool
    copy: str | None
    """Shard manifests only: the tokenizer file copied beside the shards."""


class ShardFile(TypedDict, total=False):
    file: str
    bytes: int
    samples: int
    sha256: str
    lengths_file: str
    lengths_sha256: str
    sources_file: str
    """Each sample's source (the index of its `pipeline shard` input) as uint16; absent before 2026-12-08."""
    sources_sha256: str


class SplitInfo(TypedDict, total=False):
    samples: int
    shards: list[ShardFile]
    tokens: int
    documents: int
    dropped_tokens: int
    sources: list[dict[str, Any]]


class TokenizeManifest(TypedDict, total=False):
    tool: str
    version: str
    tokenizer: TokenizerInfo
    dtype: str
    files: dict[str, dict[str, Any]]
    """bin and idx: the bytes and sha256 the run wrote (absent in manifests of versions before 2026-12-05)."""
    append_eos: bool
    totals: dict[str, Any]
    errors: list[str]
    wall_time_s: float
    throughput: dict[str, float]


class ShardManifest(TypedDict, total=False):
    tool: str
    version: str
    fingerprint: str
    args: dict[str, Any]
    seq_len: int
    sample_width: int
    dtype: str
    cross_document: bool
    document_masks: bool
    """Samples of whole documents (`--whole-documents`); absent in manifests before 2026-12-06."""
    length_mix: list[list[float]]
    pad_id: int
    seed: int
    split_ratios: list[float]
    tokenizer: TokenizerInfo
    splits: dict[str, SplitInfo]
    leak_check: dict[str, Any]
    """Held-out documents that are near duplicates of training ones (pipeline.data.leaks); absent before
    2026-12-06."""


def read_tokenize_manifest(prefix: str | Path) -> TokenizeManifest:
    """The manifest of a finished tokenize run; a clear error when the run is missing or incomplete."""
    path = Path(str(prefix) + ".manifest.json")
    return _read(
        path,
        f"{path}: not found; {prefix} is not a finished `pipeline tokenize` output (run it, or check the prefix)",
        "re-run `pipeline tokenize`",
    )  # type: ignore[return-value]


def check_tokenized_files(prefix: str | Path, manifest: TokenizeManifest) -> None:
    """Refuse a tokenize output whose .bin or .idx is not what the run wrote (its size, then its sha256): replaced
    by another run, cut short by a copy, edited. Such files can still be read, and would be sharded and trained on
    without a word."""
    for ext, wrote in (manifest.get("files") or {}).items():
        path = Path(f"{prefix}.{ext}")
        fix = f"re-run `pipeline tokenize` for {prefix}, or put back the file it wrote"
        if not path.exists():
            raise PipelineError(f"{path}: missing, though {prefix}.manifest.json lists it; {fix}")
        size = path.stat().st_size
        if size != wrote["bytes"]:
            raise PipelineError(
                f"{path}: {size:,} bytes, but `pipeline tokenize` wrote {wrote['bytes']:,} "
                f"({prefix}.manifest.json): it was changed after tokenizing; {fix}"
            )
        if sha256_file(path) != wrote["sha256"]:
            raise PipelineError(
                f"{path}: its content differs from what `pipeline tokenize` wrote (sha256 in {prefix}.manifest.json): "
                f"it was changed after tokenizing; {fix}"
            )


SHARD_MANIFEST_NEEDS = ("fingerprint", "seq_len", "sample_width", "dtype", "tokenizer", "splits")


def read_shard_manifest(path: str | Path) -> ShardManifest:
    """The manifest of a finished shard run; a clear error when there is none or it lacks what readers use."""
    file = Path(path) / "manifest.json"
    fix = "re-run `pipeline shard --overwrite`"
    if not Path(path).exists():
        where = "" if Path(path).is_absolute() else f" (a relative path, read from the working directory {Path.cwd()})"
        raise PipelineError(
            f"{path}: no such folder{where}; give the folder `pipeline shard --output` wrote, or an absolute path"
        )
    m = _read(
        file,
        f"{path}: no manifest.json; not a finished `pipeline shard` output (run `pipeline shard ... --output DIR`)",
        fix,
    )
    missing = [k for k in SHARD_MANIFEST_NEEDS if not isinstance(m, dict) or k not in m]
    if not missing and "vocab_size" not in (m["tokenizer"] or {}):
        missing = ["tokenizer.vocab_size"]
    if missing:
        raise PipelineError(f"{file}: lacks {', '.join(missing)}; not a manifest written by `pipeline shard`; {fix}")
    return m  # type: ignore[return-value]


def _read(path: Path, missing: str, fix: str) -> dict[str, Any]:
    """The manifest at `path`, refused when it is not what its stage wrote (pipeline.atomic.SEAL: every field)."""
    if not path.exists():
        raise PipelineError(missing)
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise PipelineError(f"{path}: not valid JSON ({e}); {fix}") from None
    if seal_broken(data):
        raise PipelineError(
            f"{path}: changed after it was written (a field edited by hand, or a copy mixed with another run's), so "
            f"it no longer vouches for the files beside it; {fix}"
        )
    return data  # type: ignore[no-any-return]


def model_token_ids(tok: TokenizerInfo | None) -> dict[str, Any]:
    """The special ids a model config takes from a tokenizer: bos falls back to 1 when the tokenizer has none
    (Llama's convention), pad is None when it has none. With no tokenizer at all, Llama's 1/2/3."""
    if tok is None:
        return {"bos_id": 1, "eos_id": 2, "pad_id": 3}
    pad = tok.get("pad_id", -1)
    return {"bos_id": max(tok.get("bos_id", 1), 0), "eos_id": tok["eos_id"], "pad_id": pad if pad >= 0 else None}


def padding_id(tok: TokenizerInfo) -> int:
    """The id that fills padded sample tails: the tokenizer's pad, else its eos (masked out of the loss anyway)."""
    return tok["pad_id"] if tok.get("pad_id", -1) >= 0 else tok["eos_id"]


def manifest_header(tool: str) -> dict[str, str]:
    """The fields every manifest of ours starts with: which command wrote it, in which version, when (UTC)."""

    return {"tool": tool, "version": __version__, "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
