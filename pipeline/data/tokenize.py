"""Stage 1: raw text -> token ids in Megatron's indexed format (`PREFIX.bin/.idx`) plus `PREFIX.manifest.json`.

Reading happens in the main process, encoding in `workers` processes (inline when 1); chunks come back in
submission order, so the output is byte-identical for any worker count. At most `2 x workers` chunks are in
flight, and a long document is read and encoded in pieces (pipeline.data.pieces), so memory stays flat whatever
the corpus or document size. Outputs are written under temporary names and renamed
at the end; the manifest, written last, marks a complete run.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import random
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.atomic import (
    OneWriter,
    file_in_the_way,
    held_by,
    sealed,
    sha256_file,
    tmp_path_for,
    write_json,
    writing_to,
)
from pipeline.data.config import TokenizeConfig
from pipeline.data.encode import ErrorSink, FileStats, chunks, encode_all, refuse_lost_input, worker_init
from pipeline.data.indexed import IndexedWriter, token_dtype
from pipeline.data.manifest import manifest_header
from pipeline.data.pieces import safe_rules
from pipeline.data.readers import Source, read_records, resolve_inputs
from pipeline.data.tokenizer import Tokenizer, tokenizer_sha256, train_sentencepiece, vocabulary_notes
from pipeline.errors import PipelineError
from pipeline.progress import Progress

log = logging.getLogger(__name__)


@dataclass
class TokenizeResult:
    prefix: Path
    manifest: dict[str, Any]

    @property
    def summary(self) -> str:
        t = self.manifest["totals"]
        lines = [
            f"wrote {self.prefix}.bin/.idx: {t['documents']:,} documents, {t['tokens']:,} tokens "
            f"in {self.manifest['wall_time_s']:.1f}s ({self.manifest['throughput']['tokens_per_s']:,.0f} tok/s)"
        ]
        if t["skipped"]:
            reasons = ", ".join(f"{k} {v}" for k, v in sorted(t["skipped_by_reason"].items()))
            lines.append(f"skipped {t['skipped']:,} records ({reasons}); first ones:")
            lines += [f"  {e}" for e in self.manifest["errors"]]
            if t["skipped_by_reason"].get("invalid_utf8"):
                lines.append(
                    "  invalid UTF-8: a file saved in another encoding (Windows' cp1252, latin-1) is converted with "
                    "`iconv -f cp1252 -t utf-8 IN > OUT`; then tokenize again"
                )
        lines += [f"note: {n}" for n in self.manifest.get("notes", [])]
        return "\n".join(lines)


def _sample_documents(sources: list[Source], cfg: TokenizeConfig) -> list[str]:
    """A seeded reservoir sample of `sample_docs` valid documents over all inputs."""
    rng = random.Random(cfg.seed)
    sample: list[str] = []
    seen = 0
    for src in sources:
        for rec in read_records(src, cfg.text_key):
            if rec.text is None:
                if cfg.on_error == "fail":
                    raise PipelineError(
                        f"{src.path}:{rec.line}: {rec.error} (use --on-error skip to skip such records)"
                    )
                continue
            if seen < cfg.sample_docs:
                sample.append(rec.text)
            else:
                j = rng.randrange(seen + 1)
                if j < cfg.sample_docs:
                    sample[j] = rec.text
            seen += 1
    return sample


def _check_writable(prefix: Path) -> None:
    parent = prefix.parent if str(prefix.parent) else Path(".")
    if file_in_the_way(parent):
        raise PipelineError(
            f"--output-prefix {prefix}: {parent} is not a folder (a file is in the way); choose another prefix"
        )
    try:
        parent.mkdir(parents=True, exist_ok=True)  # as `shard --output` does
    except OSError as e:
        raise PipelineError(f"--output-prefix {prefix}: cannot create folder {parent} ({e.strerror})") from None
    if not os.access(parent, os.W_OK):
        raise PipelineError(f"--output-prefix {prefix}: folder {parent} is not writable")


def _input_size(src: Source) -> int:
    if src.path.is_dir():
        return sum(f.stat().st_size for f in src.path.rglob("*") if f.is_file())
    return src.path.stat().st_size


def _input_sha256(src: Source) -> str:
    return tokenizer_sha256(src.path) if src.path.is_dir() else sha256_file(src.path)


def _tokenizer_path(cfg: TokenizeConfig, sources: list[Source], prefix: Path) -> tuple[Path, dict[str, Any] | None]:
    """The tokenizer to encode with: trained on a seeded sample of the inputs (saved as PREFIX.tokenizer.model,
    with its training settings returned for the manifest), or the one given."""
    if not cfg.train_tokenizer:
        assert cfg.tokenizer is not None
        return Path(cfg.tokenizer), None
    docs = _sample_documents(sources, cfg)
    tok_path = prefix.with_name(prefix.name + ".tokenizer.model")
    log.info("training a %s tokenizer (vocab %d) on %d documents", cfg.model_type, cfg.vocab_size, len(docs))
    train_sentencepiece(
        docs, tok_path, vocab_size=cfg.vocab_size, model_type=cfg.model_type, seed=cfg.seed, threads=cfg.workers
    )
    return tok_path, {
        "vocab_size": cfg.vocab_size,
        "model_type": cfg.model_type,
        "sample_docs": cfg.sample_docs,
        "seed": cfg.seed,
    }


def _manifest(
    cfg: TokenizeConfig,
    sources: list[Source],
    stats: list[FileStats],
    sink: ErrorSink,
    writer: IndexedWriter,
    tok: Tokenizer,
    tok_path: Path,
    trained: dict[str, Any] | None,
    dtype: np.dtype,
    wall: float,
) -> dict[str, Any]:
    """PREFIX.manifest.json of a finished run: tokenizer, inputs with their checksums, totals, errors, speed."""
    total_bytes = sum(_input_size(s) for s in sources)
    manifest = {
        **manifest_header("pipeline tokenize"),
        "tokenizer": {
            "path": str(Path(tok_path).resolve()),
            "sha256": tok.sha256(),
            "kind": tok.kind,
            "vocab_size": tok.vocab_size,
            "eos_id": tok.eos_id,
            "bos_id": tok.bos_id,
            "pad_id": tok.pad_id,
            "trained": trained,
        },
        "dtype": dtype.name,
        "files": writer.files,  # what shard checks its input against: a file changed since is not this run's
        "append_eos": cfg.append_eos,
        "text_key": cfg.text_key,
        "inputs": [
            {
                "path": st.path,
                "kind": st.kind,
                "bytes": _input_size(src),
                "sha256": _input_sha256(src),
                "documents": st.documents,
                "tokens": st.tokens,
                "skipped": dict(st.skipped),
            }
            for st, src in zip(stats, sources, strict=True)
        ],
        "totals": {
            "documents": writer.documents,
            "tokens": writer.tokens,
            "skipped": sum(sink.by_reason.values()),
            "skipped_by_reason": dict(sink.by_reason),
            "input_bytes": total_bytes,
        },
        "errors": sink.listed,
        "wall_time_s": round(wall, 3),
        "throughput": {
            "docs_per_s": round(writer.documents / wall, 1),
            "tokens_per_s": round(writer.tokens / wall, 1),
            "mb_per_s": round(total_bytes / 1e6 / wall, 3),
        },
    }
    return manifest


def run(cfg: TokenizeConfig) -> TokenizeResult:
    """The stage, as the one live writer of its prefix; a write that the disk refuses names the output's folder
    (pipeline.atomic.writing_to)."""
    prefix = Path(cfg.output_prefix)
    _check_writable(prefix)

    def busy(who: dict[str, Any] | None) -> str:
        return (
            f"--output-prefix {prefix}: another `pipeline tokenize` is writing it{held_by(who)}; two at once "
            "would leave only one's documents. Wait for it to end, or give another --output-prefix"
        )

    with writing_to(prefix.absolute().parent), OneWriter(prefix.parent / f".{prefix.name}.lock", busy, remove=True):
        return _run(cfg)


def _run(cfg: TokenizeConfig) -> TokenizeResult:
    t0 = time.perf_counter()
    prefix = Path(cfg.output_prefix)
    _check_writable(prefix)
    sources = resolve_inputs(list(cfg.inputs))

    tok_path, trained = _tokenizer_path(cfg, sources, prefix)
    tok = Tokenizer(tok_path)
    dtype = token_dtype(tok.vocab_size)
    eos_id = tok.eos_id if cfg.append_eos else None

    stats = [FileStats(str(s.path), s.kind) for s in sources]
    sink = ErrorSink(cfg.on_error)
    progress = Progress(sum(_input_size(s) for s in sources), "tokenize", cfg.progress)
    rules = safe_rules(tok.encode)
    cut_stats: Counter = Counter()
    pool = None
    # the temporary files and the writer once made: a stop at any point from here removes what they hold
    temps: list[Path] = []
    made: list[IndexedWriter] = []

    def consume(i: int, nbytes: int, lengths: np.ndarray, lasts: np.ndarray, flat: np.ndarray) -> None:
        docs = made[0].add_pieces(lengths, lasts, flat)
        stats[i].documents += docs
        stats[i].tokens += len(flat)
        progress.update(nbytes, docs=docs, tok=len(flat))

    try:
        for name in (".bin", ".idx"):
            temps.append(tmp_path_for(prefix.with_name(prefix.name + name)))
        bin_tmp, idx_tmp = temps
        made.append(IndexedWriter(bin_tmp, dtype, count_ids=tok.vocab_size if trained else 0))
        writer = made[0]
        if cfg.workers > 1:
            pool = mp.get_context("spawn").Pool(cfg.workers, initializer=worker_init, initargs=(str(tok_path),))
        encode_all(chunks(sources, cfg, stats, sink, rules, cut_stats), tok, eos_id, dtype, pool, cfg.workers, consume)
        writer.finish(idx_tmp)
        refuse_lost_input(writer.documents, stats, sink)
        manifest_path = prefix.with_name(prefix.name + ".manifest.json")
        manifest_path.unlink(missing_ok=True)  # an old manifest must not vouch for half-replaced files
        os.replace(bin_tmp, prefix.with_name(prefix.name + ".bin"))
        os.replace(idx_tmp, prefix.with_name(prefix.name + ".idx"))
    except BaseException:
        if made:
            made[0].abort()
        for leftover in (*temps, *(t.with_name(t.name + ".lengths") for t in temps)):
            leftover.unlink(missing_ok=True)
        if pool is not None:
            pool.terminate()
        raise
    finally:
        progress.close()
        if pool is not None:
            pool.close()
            pool.join()

    manifest = _manifest(cfg, sources, stats, sink, writer, tok, tok_path, trained, dtype, time.perf_counter() - t0)
    manifest["long_documents"] = {
        "cut_rules": list(rules),
        "piece_chars": cfg.piece_chars,
        "documents_in_pieces": cut_stats["documents_in_pieces"],
        "unchecked_cuts": cut_stats["unchecked_cuts"],
    }
    manifest["notes"] = vocabulary_notes(writer.id_counts, cfg.vocab_size) if trained else []
    write_json(prefix.with_name(prefix.name + ".manifest.json"), sealed(manifest))
    return TokenizeResult(prefix, manifest)
