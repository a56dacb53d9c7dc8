"""Stage 1: raw text -> token ids in Megatron's indexed format (`PREFIX.bin/.idx`) plus `PREFIX.manifest.json`.

Reading happens in the main process, encoding in `workers` processes (inline when 1); chunks come back in
submission order, so the output is byte-identical for any worker count. At most `2 x workers` chunks are in
flight, so memory stays flat whatever the corpus size. Outputs are written under temporary names and renamed
at the end; the manifest, written last, marks a complete run.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import random
import time
from collections import Counter, deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from pipeline import __version__
from pipeline.atomic import sha256_file, tmp_path_for, write_json
from pipeline.data.config import TokenizeConfig
from pipeline.data.indexed import IndexedWriter, token_dtype
from pipeline.data.readers import Source, read_records, resolve_inputs
from pipeline.data.tokenizer import Tokenizer, tokenizer_sha256, train_sentencepiece
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


@dataclass
class TokenizeResult:
    prefix: Path
    manifest: dict[str, Any]

    @property
    def summary(self) -> str:
        t = self.manifest["totals"]
        lines = [f"wrote {self.prefix}.bin/.idx: {t['documents']:,} documents, {t['tokens']:,} tokens "
                 f"in {self.manifest['wall_time_s']:.1f}s ({self.manifest['throughput']['tokens_per_s']:,.0f} tok/s)"]
        if t["skipped"]:
            reasons = ", ".join(f"{k} {v}" for k, v in sorted(t["skipped_by_reason"].items()))
            lines.append(f"skipped {t['skipped']:,} records ({reasons}); first ones:")
            lines += [f"  {e}" for e in self.manifest["errors"]]
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
        self.by_reason[reason] += 1
        if len(self.listed) < MAX_LISTED_ERRORS:
            self.listed.append(where)


def _chunks(sources: list[Source], cfg: TokenizeConfig, stats: list[FileStats],
            sink: _ErrorSink) -> Iterator[tuple[int, list[str], int]]:
    """(source index, texts, raw bytes) chunks, in input order."""
    for i, src in enumerate(sources):
        texts: list[str] = []
        size = 0
        nbytes = 0
        for rec in read_records(src, cfg.text_key):
            nbytes += rec.nbytes
            if rec.text is None:
                sink.add(stats[i], rec.line, rec.error or "bad record", rec.reason or "other")
                continue
            texts.append(rec.text)
            size += len(rec.text)
            if size >= CHUNK_BYTES or len(texts) >= CHUNK_DOCS:
                yield i, texts, nbytes
                texts, size, nbytes = [], 0, 0
        if texts or nbytes:
            yield i, texts, nbytes


# Worker side: the tokenizer is loaded once per process.
_WORKER_TOKENIZER: Tokenizer | None = None


def _worker_init(path: str) -> None:
    global _WORKER_TOKENIZER
    _WORKER_TOKENIZER = Tokenizer(path)


def encode_chunk(tok: Tokenizer, texts: list[str], eos_id: int | None, dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
    """Pure: texts -> (lengths, concatenated ids), each document followed by `eos_id` when given."""
    arrays = tok.encode_batch(texts)
    if eos_id is not None:
        eos = np.array([eos_id], dtype=dtype)
        parts = [p for a in arrays for p in (a, eos)]
        lengths = np.fromiter((len(a) + 1 for a in arrays), dtype=np.int32, count=len(arrays))
    else:
        parts = list(arrays)
        lengths = np.fromiter((len(a) for a in arrays), dtype=np.int32, count=len(arrays))
    flat = np.concatenate(parts).astype(dtype, copy=False) if parts else np.zeros(0, dtype)
    return lengths, flat


def _worker_encode(texts: list[str], eos_id: int | None, dtype: str) -> tuple[np.ndarray, np.ndarray]:
    assert _WORKER_TOKENIZER is not None
    return encode_chunk(_WORKER_TOKENIZER, texts, eos_id, np.dtype(dtype))


def _sample_documents(sources: list[Source], cfg: TokenizeConfig) -> list[str]:
    """A seeded reservoir sample of `sample_docs` valid documents over all inputs."""
    rng = random.Random(cfg.seed)
    sample: list[str] = []
    seen = 0
    for src in sources:
        for rec in read_records(src, cfg.text_key):
            if rec.text is None:
                if cfg.on_error == "fail":
                    raise PipelineError(f"{src.path}:{rec.line}: {rec.error} (use --on-error skip to skip such records)")
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
    try:
        parent.mkdir(parents=True, exist_ok=True)  # as `shard --output` does
    except (FileExistsError, NotADirectoryError):
        raise PipelineError(f"--output-prefix {prefix}: {parent} is not a folder (a file is in the way); "
                            "choose another prefix") from None
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


def _tokenizer_path(cfg: TokenizeConfig, sources: list[Source], prefix: Path
                    ) -> tuple[Path, dict[str, Any] | None]:
    """The tokenizer to encode with: trained on a seeded sample of the inputs (saved as PREFIX.tokenizer.model,
    with its training settings returned for the manifest), or the one given."""
    if not cfg.train_tokenizer:
        assert cfg.tokenizer is not None
        return Path(cfg.tokenizer), None
    docs = _sample_documents(sources, cfg)
    tok_path = prefix.with_name(prefix.name + ".tokenizer.model")
    log.info("training a %s tokenizer (vocab %d) on %d documents", cfg.model_type, cfg.vocab_size, len(docs))
    train_sentencepiece(docs, tok_path, vocab_size=cfg.vocab_size, model_type=cfg.model_type,
                        seed=cfg.seed, threads=cfg.workers)
    return tok_path, {"vocab_size": cfg.vocab_size, "model_type": cfg.model_type, "sample_docs": cfg.sample_docs,
                      "seed": cfg.seed}


def _manifest(cfg: TokenizeConfig, sources: list[Source], stats: list[FileStats], sink: _ErrorSink,
              writer: IndexedWriter, tok: Tokenizer, tok_path: Path, trained: dict[str, Any] | None,
              dtype: np.dtype, wall: float) -> dict[str, Any]:
    """PREFIX.manifest.json of a finished run: tokenizer, inputs with their checksums, totals, errors, speed."""
    total_bytes = sum(_input_size(s) for s in sources)
    manifest = {
        "tool": "pipeline tokenize",
        "version": __version__,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "tokenizer": {"path": str(Path(tok_path).resolve()), "sha256": tok.sha256(), "kind": tok.kind,
                      "vocab_size": tok.vocab_size, "eos_id": tok.eos_id, "bos_id": tok.bos_id,
                      "pad_id": tok.pad_id, "trained": trained},
        "dtype": dtype.name,
        "append_eos": cfg.append_eos,
        "text_key": cfg.text_key,
        "inputs": [{"path": st.path, "kind": st.kind, "bytes": _input_size(src), "sha256": _input_sha256(src),
                    "documents": st.documents, "tokens": st.tokens, "skipped": dict(st.skipped)}
                   for st, src in zip(stats, sources, strict=True)],
        "totals": {"documents": writer.documents, "tokens": writer.tokens,
                   "skipped": sum(sink.by_reason.values()), "skipped_by_reason": dict(sink.by_reason),
                   "input_bytes": total_bytes},
        "errors": sink.listed,
        "wall_time_s": round(wall, 3),
        "throughput": {"docs_per_s": round(writer.documents / wall, 1), "tokens_per_s": round(writer.tokens / wall, 1),
                       "mb_per_s": round(total_bytes / 1e6 / wall, 3)},
    }
    return manifest


def run(cfg: TokenizeConfig) -> TokenizeResult:
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
    writer = IndexedWriter(bin_tmp, dtype)

    def consume(i: int, nbytes: int, lengths: np.ndarray, flat: np.ndarray) -> None:
        writer.add_many(lengths, flat)
        stats[i].documents += len(lengths)
        stats[i].tokens += len(flat)
        progress.update(nbytes, docs=len(lengths), tok=len(flat))

    pool = None
    try:
        if cfg.workers == 1:
            for i, texts, nbytes in _chunks(sources, cfg, stats, sink):
                consume(i, nbytes, *encode_chunk(tok, texts, eos_id, dtype))
        else:
            pool = mp.get_context("spawn").Pool(cfg.workers, initializer=_worker_init, initargs=(str(tok_path),))
            pending: deque = deque()
            for i, texts, nbytes in _chunks(sources, cfg, stats, sink):
                pending.append((i, nbytes, pool.apply_async(_worker_encode, (texts, eos_id, dtype.str))))
                while len(pending) > 2 * cfg.workers:
                    j, nb, res = pending.popleft()
                    consume(j, nb, *res.get())
            while pending:
                j, nb, res = pending.popleft()
                consume(j, nb, *res.get())
        writer.finish(idx_tmp)
        if writer.documents == 0:
            raise PipelineError("no valid documents in the input; nothing written "
                                f"({', '.join(f'{k} {v}' for k, v in sink.by_reason.items()) or 'inputs are empty'})")
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

    manifest = _manifest(cfg, sources, stats, sink, writer, tok, tok_path, trained, dtype,
                         time.perf_counter() - t0)
    write_json(prefix.with_name(prefix.name + ".manifest.json"), manifest)
    return TokenizeResult(prefix, manifest)
