"""Stage 2: token ids -> packed, shuffled, split, blended fixed-length training shards plus `DIR/manifest.json`.

Order of work, all deterministic from the seed:
  1. each source's documents are shuffled and split by document into train/val/test (`split_documents`);
  2. each split's documents are packed into samples of seq_len + 1 tokens (`pack`, or `pack_whole` with
     --whole-documents), source by source; under --length-mix the train split's documents of each length bucket
     are packed apart;
  3. the train split is blended: source s contributes round(w_s x total) samples, repeating a small source
     (`blend_counts`), split over its length buckets by their weights (`bucket_counts`); then every split's
     samples are shuffled and written as shards of fixed-size rows.
Work happens in DIR/.tmp-*; shards are moved into DIR and manifest.json, written last, marks completion.

One job: the stage's run, in the order above; the pure parts (splitting, packing, blending, the manifest) are
pipeline.data.packing and pipeline.data.manifest, so what is here is the order of work and its files.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.atomic import (
    OneWriter,
    file_in_the_way,
    held_by,
    make_temp_dir,
    sealed,
    sha256_file,
    uninterrupted,
    write_json,
    writing_to,
)
from pipeline.data.config import ShardConfig
from pipeline.data.indexed import IndexedReader
from pipeline.data.leaks import LeakCount, count_leaks
from pipeline.data.manifest import (
    ShardManifest,
    TokenizeManifest,
    check_tokenized_files,
    manifest_header,
    padding_id,
    read_shard_manifest,
    read_tokenize_manifest,
)
from pipeline.data.packing import (
    SPLITS,
    blend_counts,
    bucket_counts,
    draw,
    length_buckets,
    pack,
    pack_whole,
    split_documents,
)
from pipeline.errors import PipelineError
from pipeline.progress import Progress

log = logging.getLogger(__name__)
FEW_HELD_OUT = 32
"""A val or test split with fewer samples than this is too small to compare checkpoints on: shard warns."""
_GATHER_ROWS = 8192


@dataclass(frozen=True)
class Packed:
    """One source's samples of one split (of one length bucket under --length-mix), in a temporary file."""

    rows: np.memmap | None
    lens: np.memmap | None
    source: int
    bucket: int
    samples: int


@dataclass
class ShardResult:
    output: Path
    manifest: dict[str, Any]
    skipped: bool = False


def _fingerprint(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]


def _row_dtype(manifests: list[TokenizeManifest]) -> np.dtype:
    return np.dtype(manifests[0]["dtype"])


def _shard_ranges(n: int, row_bytes: int, cfg: ShardConfig) -> list[tuple[int, int]]:
    k = cfg.num_shards if cfg.num_shards else max(1, -(-n * row_bytes // cfg.shard_size_bytes))
    k = max(1, min(k, n)) if n else 1
    cuts = [n * i // k for i in range(k + 1)]
    return [(cuts[i], cuts[i + 1]) for i in range(k)]


def command(sources: tuple[str, ...], options: dict[str, Any], model_dir: str | None, cross_given: bool) -> str:
    """`pipeline shard`: its PREFIX[:WEIGHT] arguments and options (the fields of ShardConfig) as a run; what it
    printed. `model_dir`: refuse data whose tokenizer is not that model's; `cross_given`: --cross-document was
    typed (not its default), which --whole-documents cannot honour."""
    from pipeline.data.config import parse_sources
    from pipeline.data.tokenizer import check_model_tokenizer

    if not sources or not options.get("output") or not options.get("seq_len"):
        raise PipelineError("give PREFIX[:WEIGHT]..., --output DIR and --seq-len N (or --inspect DIR)")
    parsed, given = parse_sources(sources)
    if model_dir:
        check_model_tokenizer(model_dir, [prefix for prefix, _ in parsed])
    if options.get("whole_documents"):
        if options.get("cross_document") and cross_given:
            raise PipelineError(
                "--whole-documents and --cross-document: whole documents never cross a sample's end, which "
                "--cross-document asks for; drop one of them"
            )
        options = options | {"cross_document": False}
    fields = {k: v for k, v in options.items() if v is not None}
    result = run(ShardConfig(sources=parsed, weights_given=given, **fields))
    if result.skipped:
        return f"{options['output']}: shards are up to date (fingerprint {result.manifest['fingerprint']}); done"
    return describe(options["output"])


def run(cfg: ShardConfig) -> ShardResult:
    """The stage, as the one live writer of its folder; a write that the disk refuses names the folder
    (pipeline.atomic.writing_to)."""
    out = Path(cfg.output)
    if blocker := file_in_the_way(out):
        raise PipelineError(f"--output {out}: {blocker} is a file; give a folder for the shards")
    try:
        out.absolute().parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise PipelineError(f"--output {out}: cannot create folder {out.absolute().parent} ({e.strerror})") from None

    def busy(who: dict[str, Any] | None) -> str:
        return (
            f"--output {out}: another `pipeline shard` is writing it{held_by(who)}; two at once would leave only "
            "one's shards. Wait for it to end, or give another --output"
        )

    with writing_to(out.absolute()), OneWriter(out.absolute().parent / f".{out.name}.lock", busy, remove=True):
        return _run(cfg)


def _run(cfg: ShardConfig) -> ShardResult:
    t0 = time.perf_counter()
    out = Path(cfg.output)
    manifests = [read_tokenize_manifest(p) for p, _ in cfg.sources]
    for (prefix, _), m in zip(cfg.sources, manifests, strict=True):
        check_tokenized_files(prefix, m)
    shas = {m["tokenizer"]["sha256"] for m in manifests}
    if len(shas) > 1:
        listing = "; ".join(
            f"{p}: {m['tokenizer']['path']} ({m['tokenizer']['sha256'][:12]})"
            for (p, _), m in zip(cfg.sources, manifests, strict=True)
        )
        raise PipelineError(
            f"inputs were tokenized with different tokenizers ({listing}); re-tokenize them with one --tokenizer"
        )
    tok = manifests[0]["tokenizer"]
    dtype = _row_dtype(manifests)
    pad_id = padding_id(tok)
    weights = [w for _, w in cfg.sources] if cfg.weights_given else None
    args = {
        "sources": [
            {"prefix": str(Path(p).resolve()), "manifest_sha256": sha256_file(str(p) + ".manifest.json"), "weight": w}
            for p, w in cfg.sources
        ],
        "seq_len": cfg.seq_len,
        "split": list(cfg.split),
        "seed": cfg.seed,
        "weights_given": cfg.weights_given,
        "cross_document": cfg.cross_document,
        "num_shards": cfg.num_shards,
        "shard_size_bytes": None if cfg.num_shards else cfg.shard_size_bytes,
        "dtype": dtype.name,
    }
    if cfg.whole_documents or cfg.length_mix:  # only when used, so that older shard folders keep their fingerprint
        args |= {"whole_documents": cfg.whole_documents, "length_mix": [list(b) for b in cfg.length_mix]}
    if cfg.whole_documents and (
        plain := [p for (p, _), m in zip(cfg.sources, manifests, strict=True) if not m.get("append_eos", True)]
    ):
        raise PipelineError(
            f"--whole-documents tells documents apart by the EOS each ends with, but {', '.join(plain)} was "
            "tokenized without it (append_eos false): re-run `pipeline tokenize` with EOS appended (the default)"
        )
    fingerprint = _fingerprint(args)
    if (out / "manifest.json").exists():
        old = json.loads((out / "manifest.json").read_text())
        if old.get("fingerprint") == fingerprint and _shards_intact(out, old):
            return ShardResult(out, old, skipped=True)
        if not cfg.overwrite:
            raise PipelineError(
                f"{out} already holds shards made with other arguments or inputs "
                f"(fingerprint {old.get('fingerprint')} vs {fingerprint}); "
                "pass --overwrite to replace them, or choose another --output"
            )
    created = not out.exists()
    work: Path | None = None
    try:
        with uninterrupted():  # the work folder made and known, for the cleanup below
            out.mkdir(parents=True, exist_ok=True)
            work = make_temp_dir(out, ".tmp-")
        result = _build(cfg, out, work, manifests, dtype, pad_id, weights, args, fingerprint, t0)
    except BaseException:
        if work is not None:
            shutil.rmtree(work, ignore_errors=True)
        if created and out.is_dir() and not any(out.iterdir()):
            out.rmdir()  # leave nothing behind that we made
        raise
    shutil.rmtree(work, ignore_errors=True)
    return result


def _pack_sources(
    cfg: ShardConfig, work: Path, dtype: np.dtype, pad_id: int
) -> tuple[dict[str, list[Packed]], dict[str, dict[str, Any]], LeakCount]:
    """Split each source by document and pack each split into rows (a temporary file per source, split and length
    bucket); refuse a seq_len that leaves the train split empty, warn about empty val/test splits and about held-out
    documents that are near duplicates of training ones (pipeline.data.leaks, within each source)."""
    readers = [IndexedReader(p) for p, _ in cfg.sources]
    progress = Progress(sum(int(r.lengths.sum()) for r in readers) * dtype.itemsize, "shard", cfg.progress)
    packed: dict[str, list[Packed]] = {s: [] for s in SPLITS}
    split_stats: dict[str, dict[str, Any]] = {
        s: {"documents": 0, "tokens_in": 0, "dropped_tokens": 0, "per_source_samples": []} for s in SPLITS
    }
    leaks = LeakCount({"val": 0, "test": 0}, {"val": 0, "test": 0}, 0, 0)
    for si, reader in enumerate(readers):
        by_split = split_documents(len(reader), cfg.split, cfg.seed, si)
        leaks += count_leaks(reader, by_split, cfg.seed + si)
        for split, doc_ids in by_split.items():
            groups = [doc_ids]
            if split == "train" and cfg.length_mix:
                bucket = length_buckets(reader.lengths[doc_ids], cfg.length_mix)
                groups = [doc_ids[bucket == b] for b in range(len(cfg.length_mix) + 1)]
            for bi, ids in enumerate(groups):
                group, dropped = _pack_group(cfg, reader, ids, work / f"src{si}-{split}-{bi}", dtype, pad_id, progress)
                packed[split].append(replace(group, source=si, bucket=bi))
                split_stats[split]["dropped_tokens"] += dropped
            st = split_stats[split]
            st["documents"] += len(doc_ids)
            st["tokens_in"] += int(reader.lengths[doc_ids].sum()) if len(doc_ids) else 0
            st["per_source_samples"].append(sum(p.samples for p in packed[split] if p.source == si))
    progress.close()
    _check_splits(cfg, readers, split_stats)
    if warning := leaks.line():
        log.warning(warning)
    return packed, split_stats, leaks


def _pack_group(
    cfg: ShardConfig, reader: IndexedReader, ids: np.ndarray, stem: Path, dtype: np.dtype, pad_id: int, progress: Any
) -> tuple[Packed, int]:
    """Pack documents `ids` of one source into rows in STEM.rows (and their valid lengths in STEM.lens): the
    packed rows, mapped back (source and bucket 0, for the caller to set), and the tokens dropped."""
    width = cfg.seq_len + 1
    rows_path, lens_path = stem.with_name(stem.name + ".rows"), stem.with_name(stem.name + ".lens")
    n_rows = dropped_total = 0
    docs = (reader[int(d)] for d in ids)
    packing = (
        pack_whole(docs, cfg.seq_len, pad_id, dtype)
        if cfg.whole_documents
        else pack(docs, cfg.seq_len, cfg.cross_document, pad_id, dtype)
    )
    with open(rows_path, "wb") as fr, open(lens_path, "wb") as fl:
        for rows, lens, dropped in packing:
            fr.write(rows.tobytes())
            if lens is not None:
                fl.write(lens.tobytes())
            n_rows += len(rows)
            dropped_total += dropped
            progress.update(rows.nbytes, tok=rows.size)
    rows_mm = np.memmap(rows_path, dtype, "r", shape=(n_rows, width)) if n_rows else None
    lens_mm = np.memmap(lens_path, np.int32, "r", shape=(n_rows,)) if n_rows and not cfg.cross_document else None
    return Packed(rows_mm, lens_mm, 0, 0, n_rows), dropped_total


def _check_splits(cfg: ShardConfig, readers: list[IndexedReader], split_stats: dict[str, dict[str, Any]]) -> None:
    """Refuse a seq_len that leaves the train split empty; warn about missing, empty or tiny val/test splits."""
    width = cfg.seq_len + 1
    train = split_stats["train"]
    if sum(train["per_source_samples"]) == 0:
        longest = max((int(r.lengths.max()) for r in readers if len(r)), default=0)
        fix = (
            f"use a --seq-len below {longest}, the longest document"
            if not cfg.cross_document
            else f"use a --seq-len below {train['tokens_in']:,}"
        )
        raise PipelineError(
            f"--seq-len {cfg.seq_len}: the train split ({train['tokens_in']:,} tokens in "
            f"{train['documents']} documents) holds no whole sample of {width} tokens; {fix}"
        )
    if cfg.split[1] == 0:
        log.warning(
            "warning: --split %s leaves no validation split: training will run without validation, and "
            "`pipeline evaluate` needs --split test (or other held-out shards, --data DIR)",
            ",".join(f"{x:g}" for x in cfg.split),
        )
    for split, ratio in zip(SPLITS[1:], cfg.split[1:], strict=True):
        samples = sum(split_stats[split]["per_source_samples"])
        if ratio > 0 and samples == 0:
            log.warning(
                "warning: the %s split has 0 samples (%d documents of %s tokens); validation needs more "
                "documents there: raise its --split ratio or use a shorter --seq-len",
                split,
                split_stats[split]["documents"],
                f"{split_stats[split]['tokens_in']:,}",
            )
        elif 0 < samples < FEW_HELD_OUT:
            total = sum(cfg.split)
            held = [2 * x for x in cfg.split[1:]]
            larger = ",".join(f"{x:g}" for x in (total - sum(held), *held)) if sum(held) < total else None
            log.warning(
                "warning: the %s split has only %d samples (%d documents): its loss will move with which documents "
                "fell there more than with the model; %s",
                split,
                samples,
                split_stats[split]["documents"],
                f"give it a larger --split share than {','.join(f'{x:g}' for x in cfg.split)} (e.g. {larger}) on a "
                "corpus this small"
                if larger
                else "shard more text: the held-out shares cannot grow further",
            )


def _write_split(
    cfg: ShardConfig,
    work: Path,
    si_split: int,
    split: str,
    packed: list[Packed],
    st: dict[str, Any],
    weights: list[float] | None,
    dtype: np.dtype,
) -> dict[str, Any]:
    """Draw (blend) the split's samples from the packed sources, shuffle them, and write its shard files; returns
    the split's manifest entry."""
    width = cfg.seq_len + 1
    available = st["per_source_samples"]
    counts = blend_counts(available, weights) if split == "train" else list(available)
    drawn = _bucket_draws(cfg, packed, counts)
    rng = np.random.default_rng([cfg.seed, 1, si_split])
    picks = [(e, i) for e, p in enumerate(packed) for i in draw(p.samples, drawn[e], rng)]
    order = rng.permutation(len(picks)) if picks else np.zeros(0, np.int64)
    src_ids = np.array([p[0] for p in picks], np.int64)[order] if picks else np.zeros(0, np.int64)
    row_ids = np.array([p[1] for p in picks], np.int64)[order] if picks else np.zeros(0, np.int64)
    files = [
        _write_shard(cfg, work / f"{split}-{k:05d}", packed, src_ids[a:b], row_ids[a:b], dtype)
        for k, (a, b) in enumerate(_shard_ranges(len(order), width * dtype.itemsize, cfg))
    ]
    n = len(order)
    return {
        "samples": n,
        "tokens": n * width,
        "documents": st["documents"],
        "input_tokens": st["tokens_in"],
        "dropped_tokens": st["dropped_tokens"],
        "sources": [
            {
                "prefix": cfg.sources[s][0],
                "available_samples": available[s],
                "drawn_samples": counts[s],
                "effective_epochs": round(counts[s] / available[s], 4) if available[s] else 0.0,
                "weight": weights[s] if weights else None,
                **(
                    {"length_buckets": _buckets_of(cfg, packed, drawn, s)}
                    if cfg.length_mix and split == "train"
                    else {}
                ),
            }
            for s in range(len(available))
        ],
        "shards": files,
    }


def _write_shard(
    cfg: ShardConfig, stem: Path, packed: list[Packed], src_ids: np.ndarray, row_ids: np.ndarray, dtype: np.dtype
) -> dict[str, Any]:
    """One shard file STEM.bin (and its valid lengths, STEM.len, where samples are padded; each sample's source,
    the index of its `pipeline shard` input, in STEM.src as uint16): the rows named by (packed group, row) in
    order, gathered a block at a time; returns its manifest entry."""
    width = cfg.seq_len + 1
    name = stem.name
    sources = np.array([p.source for p in packed], np.uint16)
    with (
        open(stem.with_name(f"{name}.bin"), "wb") as fb,
        open(stem.with_name(f"{name}.len"), "wb") as fl,
        open(stem.with_name(f"{name}.src"), "wb") as fs,
    ):
        fs.write(sources[src_ids].tobytes())
        for c in range(0, len(src_ids), _GATHER_ROWS):
            s_ids, r_ids = src_ids[c : c + _GATHER_ROWS], row_ids[c : c + _GATHER_ROWS]
            block = np.empty((len(s_ids), width), dtype)
            lens = np.empty(len(s_ids), np.int32)
            for e in np.unique(s_ids):
                sel = s_ids == e
                block[sel] = packed[e].rows[r_ids[sel]]  # type: ignore[index]
                lens_mm = packed[e].lens
                lens[sel] = lens_mm[r_ids[sel]] if lens_mm is not None else width
            fb.write(block.tobytes())
            if not cfg.cross_document:
                fl.write(lens.tobytes())
    entry = {
        "file": f"{name}.bin",
        "samples": len(src_ids),
        "bytes": len(src_ids) * width * dtype.itemsize,
        "sha256": sha256_file(stem.with_name(f"{name}.bin")),
        "sources_file": f"{name}.src",
        "sources_sha256": sha256_file(stem.with_name(f"{name}.src")),
    }
    if cfg.cross_document:
        stem.with_name(f"{name}.len").unlink()
    else:
        entry["lengths_file"] = f"{name}.len"
        entry["lengths_sha256"] = sha256_file(stem.with_name(f"{name}.len"))
    return entry


def _bucket_weights(cfg: ShardConfig) -> list[float]:
    return [1.0] + [w for _, w in cfg.length_mix]


def _bucket_draws(cfg: ShardConfig, packed: list[Packed], counts: list[int]) -> list[int]:
    """Samples drawn from each packed group: each source's count split over its length buckets by their weights."""
    drawn: list[int] = []
    for s, count in enumerate(counts):
        mine = [p for p in packed if p.source == s]
        drawn += bucket_counts([p.samples for p in mine], [_bucket_weights(cfg)[p.bucket] for p in mine], count)
    return drawn


def _buckets_of(cfg: ShardConfig, packed: list[Packed], drawn: list[int], source: int) -> list[dict[str, Any]]:
    """The manifest's record of one source's length buckets: where each starts, its weight, available and drawn."""
    edges = [0] + [e for e, _ in cfg.length_mix]
    return [
        {
            "from_tokens": edges[p.bucket],
            "weight": _bucket_weights(cfg)[p.bucket],
            "available_samples": p.samples,
            "drawn_samples": drawn[e],
        }
        for e, p in enumerate(packed)
        if p.source == source
    ]


def _build(
    cfg: ShardConfig,
    out: Path,
    work: Path,
    manifests: list[TokenizeManifest],
    dtype: np.dtype,
    pad_id: int,
    weights: list[float] | None,
    args: dict[str, Any],
    fingerprint: str,
    t0: float,
) -> ShardResult:
    width = cfg.seq_len + 1
    packed, split_stats, leaks = _pack_sources(cfg, work, dtype, pad_id)
    shards = {
        split: _write_split(cfg, work, i, split, packed[split], split_stats[split], weights, dtype)
        for i, split in enumerate(SPLITS)
    }

    tok = manifests[0]["tokenizer"]
    tokenizer_copy = None
    if tok["kind"] == "sentencepiece" and Path(tok["path"]).exists():
        shutil.copyfile(tok["path"], work / "tokenizer.model")
        tokenizer_copy = "tokenizer.model"
    # Replace: drop the old manifest first so a crash mid-move never leaves a manifest vouching for new files; a
    # Ctrl-C or SIGTERM waits for the moves and the new manifest (a second), so the folder is the old or the new.
    with uninterrupted():
        (out / "manifest.json").unlink(missing_ok=True)
        for old in out.glob("*-[0-9][0-9][0-9][0-9][0-9].*"):
            old.unlink()
        for f in work.iterdir():
            if f.name.split("-")[0] in SPLITS or f.name == "tokenizer.model":
                os.replace(f, out / f.name)
        wall = time.perf_counter() - t0
        total_tokens = sum(int(m["totals"]["tokens"]) for m in manifests)
        manifest = {
            **manifest_header("pipeline shard"),
            "fingerprint": fingerprint,
            "args": args,
            "seq_len": cfg.seq_len,
            "sample_width": width,
            "dtype": dtype.name,
            "cross_document": cfg.cross_document,
            "document_masks": cfg.whole_documents,
            "length_mix": [list(b) for b in cfg.length_mix],
            "pad_id": pad_id,
            "seed": cfg.seed,
            "split_ratios": list(cfg.split),
            "tokenizer": {**tok, "copy": tokenizer_copy},
            "source_manifests": [
                {
                    "prefix": p,
                    "sha256": a["manifest_sha256"],
                    "documents": m["totals"]["documents"],
                    "tokens": m["totals"]["tokens"],
                }
                for (p, _), a, m in zip(cfg.sources, args["sources"], manifests, strict=True)
            ],
            "splits": shards,
            "leak_check": leaks.as_dict(),
            "wall_time_s": round(wall, 3),
            "throughput_mb_per_s": round(total_tokens * dtype.itemsize / 1e6 / wall, 2),
        }
        write_json(out / "manifest.json", sealed(manifest))
    return ShardResult(out, manifest)


def _shards_intact(out: Path, manifest: dict[str, Any]) -> bool:
    for split in manifest.get("splits", {}).values():
        for f in split["shards"]:
            p = out / f["file"]
            if not p.exists() or p.stat().st_size != f["bytes"]:
                return False
    return True


def _packing(m: ShardManifest) -> str:
    if m.get("document_masks"):
        kind = "whole documents, several to a sample (attention and loss masked at their boundaries)"
    else:
        kind = "cross-document packing" if m["cross_document"] else "no cross-document samples (padded, masked)"
    mix = ", ".join(f"documents of {e:,}+ tokens x{w:g}" for e, w in m.get("length_mix") or [])
    return kind + (f"; length mix: {mix}" if mix else "")


def describe(path: str | Path) -> str:
    """`pipeline shard --inspect`: the manifest as a readable summary."""
    m = read_shard_manifest(path)
    lines = [
        f"{path}: shards by pipeline {m['version']}, fingerprint {m['fingerprint']}",
        f"  seq_len {m['seq_len']} ({m['dtype']}), seed {m['seed']}, split {m['split_ratios']}, {_packing(m)}",
        f"  tokenizer {m['tokenizer']['path']} (vocab {m['tokenizer']['vocab_size']}, "
        f"sha256 {m['tokenizer']['sha256'][:12]})",
    ]
    for name, s in m["splits"].items():
        lines.append(
            f"  {name:5s}: {s['samples']:>10,} samples {s['tokens']:>14,} tokens in {len(s['shards'])} "
            f"shard(s); {s['documents']:,} documents, {s['dropped_tokens']:,} tail tokens dropped"
        )
        for src in s["sources"]:
            w = f", weight {src['weight']}" if src["weight"] is not None else ""
            lines.append(
                f"         {src['prefix']}: {src['drawn_samples']:,} of {src['available_samples']:,} "
                f"samples ({src['effective_epochs']} epochs{w})"
            )
            for b in src.get("length_buckets", []):
                lines.append(
                    f"           documents of {b['from_tokens']:,}+ tokens (x{b['weight']:g}): "
                    f"{b['drawn_samples']:,} of {b['available_samples']:,} samples"
                )
    if leak := m.get("leak_check"):
        found, held = leak["near_duplicates_of_train"], leak["held_out_checked"]
        lines.append(
            "  near duplicates of train documents: "
            + ", ".join(f"{found[s]:,} of {held[s]:,} {s}" for s in held)
            + f" (checked against {leak['train_checked']:,} of {leak['train_documents']:,} train documents)"
        )
    return "\n".join(lines)
