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
from collections import Counter, deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.atomic import OneWriter, file_in_the_way, held_by, sha256_file, tmp_path_for, write_json, writing_to
from pipeline.data.config import TokenizeConfig
from pipeline.data.indexed import IndexedWriter, token_dtype
from pipeline.data.manifest import manifest_header
from pipeline.data.pieces import Cutter, safe_rules
from pipeline.data.readers import Source, read_records, resolve_inputs
from pipeline.data.tokenizer import Tokenizer, tokenizer_sha256, train_sentencepiece, vocabulary_notes
from pipeline.errors import PipelineError
from pipeline.progress import Progress

log = logging.getLogger(__name__)
CHUNK_BYTES = 1 << 20
CHUNK_DOCS = 4096
MAX_LISTED_ERRORS = 10


@dataclass
class FileStats:
    path: str
    kind: str
    documents: int = 0
    tokens: int = 0
    skipped: Counter = field(default_factory=Counter)
    first_error: str = ""
    """`line: message` of the file's first skipped record."""


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


class _ErrorSink:
    """Counts bad records by reason, keeps the first few as `file:line: message`, or raises when on_error=fail."""

    def __init__(self, on_error: str):
        self.on_error = on_error
        self.listed: list[str] = []
        self.by_reason: Counter = Counter()

    def add(self, stats: FileStats, line: int, message: str, reason: str) -> None:
        where = f"{stats.path}:{line}: {message}"
        if self.on_error == "fail":
            raise PipelineError(where + " (use --on-error skip to count and skip such records)")
        stats.skipped[reason] += 1
        stats.first_error = stats.first_error or f"line {line}: {message}"
        self.by_reason[reason] += 1
        if len(self.listed) < MAX_LISTED_ERRORS:
            self.listed.append(where)


def _chunks(
    sources: list[Source],
    cfg: TokenizeConfig,
    stats: list[FileStats],
    sink: _ErrorSink,
    rules: tuple[str, ...],
    cut_stats: Counter,
) -> Iterator[tuple[int, list[tuple[str, bool]], int]]:
    """(source index, [(text, ends its document)], raw bytes) chunks, in input order. A document longer than a
    piece is cut into pieces (pipeline.data.pieces), so no chunk holds much more than CHUNK_BYTES of text."""
    for i, src in enumerate(sources):
        items: list[tuple[str, bool]] = []
        size = 0
        nbytes = 0
        cutter = Cutter(rules, cfg.piece_chars)
        in_pieces = False
        for rec in read_records(src, cfg.text_key, cfg.max_record_bytes):
            nbytes += rec.nbytes
            if rec.text is None:
                sink.add(stats[i], rec.line, rec.error or "bad record", rec.reason or "other")
                continue
            pieces = cutter.feed(rec.text)
            in_pieces = in_pieces or bool(pieces)  # a document read in blocks may be cut in any of them
            if rec.last:
                rest = cutter.end()
                cut_stats["unchecked_cuts"] += cutter.unchecked
                cutter.unchecked = 0
                pieces.append(rest)
                if in_pieces:
                    cut_stats["documents_in_pieces"] += 1
                in_pieces = False
            for k, piece in enumerate(pieces):
                items.append((piece, rec.last and k == len(pieces) - 1))
                size += len(piece)
                if size >= CHUNK_BYTES or len(items) >= CHUNK_DOCS:
                    yield i, items, nbytes
                    items, size, nbytes = [], 0, 0
        if items or nbytes:
            yield i, items, nbytes


# Worker side: the tokenizer is loaded once per process.
_WORKER_TOKENIZER: Tokenizer | None = None


def _worker_init(path: str) -> None:
    global _WORKER_TOKENIZER
    _WORKER_TOKENIZER = Tokenizer(path)


def encode_chunk(
    tok: Tokenizer, items: list[tuple[str, bool]], eos_id: int | None, dtype: np.dtype
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Pure: [(text, ends its document)] -> (token count per item, ends-a-document flags, concatenated ids), each
    document's last piece followed by `eos_id` when given."""
    arrays = tok.encode_batch([t for t, _ in items])
    lasts = np.fromiter((last for _, last in items), dtype=bool, count=len(items))
    if eos_id is not None:
        eos = np.array([eos_id], dtype=dtype)
        parts = [p for a, last in zip(arrays, lasts, strict=True) for p in ((a, eos) if last else (a,))]
        lengths = np.fromiter(
            (len(a) + int(last) for a, last in zip(arrays, lasts, strict=True)), dtype=np.int64, count=len(arrays)
        )
    else:
        parts = list(arrays)
        lengths = np.fromiter((len(a) for a in arrays), dtype=np.int64, count=len(arrays))
    flat = np.concatenate(parts).astype(dtype, copy=False) if parts else np.zeros(0, dtype)
    return lengths, lasts, flat


def _worker_encode(
    items: list[tuple[str, bool]], eos_id: int | None, dtype: str
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    assert _WORKER_TOKENIZER is not None
    return encode_chunk(_WORKER_TOKENIZER, items, eos_id, np.dtype(dtype))


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
    sink: _ErrorSink,
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


def _encode_all(
    chunks: Iterator[tuple[int, list[tuple[str, bool]], int]],
    tok: Tokenizer,
    eos_id: int | None,
    dtype: np.dtype,
    pool: Any,
    workers: int,
    consume: Callable[..., None],
) -> None:
    """Each chunk encoded, here or by the `workers` of `pool` (at most two chunks per worker in flight, in input
    order), and handed to `consume(source index, bytes read, lengths, lasts, tokens)`."""
    if pool is None:
        for i, items, nbytes in chunks:
            consume(i, nbytes, *encode_chunk(tok, items, eos_id, dtype))
        return
    pending: deque = deque()
    for i, items, nbytes in chunks:
        pending.append((i, nbytes, pool.apply_async(_worker_encode, (items, eos_id, dtype.str))))
        while len(pending) > 2 * workers:
            j, nb, res = pending.popleft()
            consume(j, nb, *res.get())
    while pending:
        j, nb, res = pending.popleft()
        consume(j, nb, *res.get())


def _refuse_lost_input(documents: int, stats: list[FileStats], sink: _ErrorSink) -> None:
    """Nothing is written when no document was kept, or when every record of a file was skipped: a file of records
    lost whole is a mistake (a wrong --text-key, another format), not noise."""
    first = f"; first: {sink.listed[0]}" if sink.listed else ""
    if documents == 0:
        raise PipelineError(
            "no valid documents in the input; nothing written "
            f"({', '.join(f'{k} {v}' for k, v in sink.by_reason.items()) or 'inputs are empty'}){first}"
        )
    for st in stats:
        if st.documents == 0 and st.skipped and st.kind != "txt":  # (a .txt file is one document)
            reasons = ", ".join(f"{k} {v}" for k, v in sorted(st.skipped.items()))
            raise PipelineError(
                f"{st.path}: every record was skipped ({reasons}; first: {st.first_error}); nothing written. "
                "Fix the file or leave it out"
            )


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
    sink = _ErrorSink(cfg.on_error)
    progress = Progress(sum(_input_size(s) for s in sources), "tokenize", cfg.progress)
    bin_tmp = tmp_path_for(prefix.with_name(prefix.name + ".bin"))
    idx_tmp = tmp_path_for(prefix.with_name(prefix.name + ".idx"))
    writer = IndexedWriter(bin_tmp, dtype, count_ids=tok.vocab_size if trained else 0)

    def consume(i: int, nbytes: int, lengths: np.ndarray, lasts: np.ndarray, flat: np.ndarray) -> None:
        docs = writer.add_pieces(lengths, lasts, flat)
        stats[i].documents += docs
        stats[i].tokens += len(flat)
        progress.update(nbytes, docs=docs, tok=len(flat))

    rules = safe_rules(tok.encode)
    cut_stats: Counter = Counter()
    pool = None
    try:
        if cfg.workers > 1:
            pool = mp.get_context("spawn").Pool(cfg.workers, initializer=_worker_init, initargs=(str(tok_path),))
        _encode_all(
            _chunks(sources, cfg, stats, sink, rules, cut_stats), tok, eos_id, dtype, pool, cfg.workers, consume
        )
        writer.finish(idx_tmp)
        _refuse_lost_input(writer.documents, stats, sink)
        manifest_path = prefix.with_name(prefix.name + ".manifest.json")
        manifest_path.unlink(missing_ok=True)  # an old manifest must not vouch for half-replaced files
        os.replace(bin_tmp, prefix.with_name(prefix.name + ".bin"))
        os.replace(idx_tmp, prefix.with_name(prefix.name + ".idx"))
    except BaseException:
        writer.abort()
        bin_tmp.unlink(missing_ok=True)
        idx_tmp.unlink(missing_ok=True)
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
    write_json(prefix.with_name(prefix.name + ".manifest.json"), manifest)
    return TokenizeResult(prefix, manifest)
