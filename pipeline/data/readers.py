"""Streaming document readers: .jsonl, .txt, .parquet (each optionally .gz / .zst) and `save_to_disk` datasets.

Every reader yields `Record(line, text, error)`: exactly one of `text` / `error` is set, so bad records are
counted and reported by the caller with their file and line, never silently dropped.
"""

from __future__ import annotations

import codecs
import glob
import gzip
import io
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import IO, Any, cast

from pipeline.data.config import MAX_RECORD_BYTES
from pipeline.errors import PipelineError

TEXT_SUFFIXES = (".jsonl", ".txt", ".parquet")
TXT_BLOCK_BYTES = 1 << 20  # a .txt document is read in blocks of this size
COMPRESSIONS = ("", ".gz", ".zst")
SUPPORTED = tuple(s + c for s in TEXT_SUFFIXES for c in COMPRESSIONS)


@dataclass(frozen=True, slots=True)
class Record:
    line: int  # 1-based line for jsonl, row for parquet / datasets, 1 for txt
    text: str | None
    error: str | None = None
    reason: str | None = None  # short category for counting: malformed_json, missing_field, ...
    nbytes: int = 0  # raw bytes this record took in the input, for progress
    last: bool = True  # False: a block of a long document; the document goes on in the next record
    fields: dict[str, Any] | None = None  # the record's other fields (read_records(keep_fields=True)), e.g. id, url


@dataclass(frozen=True, slots=True)
class Source:
    path: Path
    kind: str  # "jsonl" | "txt" | "parquet" | "hf"


def _is_hf_dataset_dir(p: Path) -> bool:
    return p.is_dir() and ((p / "dataset_info.json").exists() or (p / "dataset_dict.json").exists())


def _kind(p: Path) -> str | None:
    name = p.name
    for c in (".gz", ".zst"):
        if name.endswith(c):
            name = name[: -len(c)]
    for s in TEXT_SUFFIXES:
        if name.endswith(s):
            return s[1:]
    return None


def resolve_inputs(inputs: list[str]) -> list[Source]:
    """Expand files, directories and globs into an ordered list of sources (input order, then sorted names)."""
    out: list[Source] = []
    for spec in inputs:
        matches = sorted(glob.glob(spec, recursive=True)) if glob.has_magic(spec) else [spec]
        if not matches or not all(os.path.exists(m) for m in matches):
            raise PipelineError(f"{spec}: no such file or directory")
        for m in matches:
            p = Path(m)
            if _is_hf_dataset_dir(p):
                out.append(Source(p, "hf"))
            elif p.is_dir():
                files = [f for f in sorted(p.rglob("*")) if f.is_file() and not _hidden(f.relative_to(p))]
                found = [Source(f, k) for f in files if (k := _kind(f))]
                if found and (others := [f for f in files if not _kind(f)]):
                    listed = ", ".join(str(f) for f in others[:5]) + (
                        f" and {len(others) - 5} more" if len(others) > 5 else ""
                    )
                    raise PipelineError(
                        f"{p}: {len(others)} file(s) of a type tokenize does not read would be left out: {listed} "
                        f"(it reads {', '.join(SUPPORTED)}); move them out, convert them, or name the files to read "
                        f"(e.g. '{p}/**/*.jsonl')"
                    )
                if not found:
                    raise PipelineError(
                        f"{p}: directory holds no {', '.join(TEXT_SUFFIXES)} files "
                        "(optionally .gz/.zst) and is not a datasets save_to_disk folder"
                    )
                out.extend(found)
            else:
                k = _kind(p)
                if k is None:
                    raise PipelineError(
                        f"{p}: unsupported input type; expected one of {', '.join(SUPPORTED)} "
                        "or a datasets save_to_disk folder"
                    )
                out.append(Source(p, k))
    _refuse_repeats(out)
    return out


def _refuse_repeats(sources: list[Source]) -> None:
    """A file named twice (directly and through a glob or its folder, by another path, through a symlink or a hard
    link) would have its documents tokenized twice without a word: refused, naming both."""
    seen: dict[tuple[int, int], Path] = {}
    for src in sources:
        st = src.path.stat()
        key = (st.st_dev, st.st_ino)
        if key in seen:
            first = seen[key]
            if str(first) == str(src.path):
                how = ""
            elif first.resolve() == src.path.resolve():
                how = ", by another path (a symlink, or another spelling of it)"
            else:
                how = ", through a hard link"
            raise PipelineError(
                f"{first} and {src.path} are the same {'folder' if src.path.is_dir() else 'file'}{how}: its documents "
                "would be read twice; give it once (to weigh a source, tokenize it alone and give "
                "`pipeline shard PREFIX:WEIGHT`)"
            )
        seen[key] = src.path


def _hidden(rel: Path) -> bool:
    """Dot files and folders (.git, .DS_Store): never inputs, never worth a refusal."""
    return any(part.startswith(".") for part in rel.parts)


MAGIC = {b"\x1f\x8b": ".gz", b"\x28\xb5\x2f\xfd": ".zst"}


def check_not_compressed(path: Path) -> None:
    """A compressed file whose name does not say so would be read as text and fail record by record as invalid
    UTF-8; say what it is instead."""
    if path.name.endswith((".gz", ".zst")) or path.is_dir():
        return
    with open(path, "rb") as f:
        head = f.read(4)
    for magic, suffix in MAGIC.items():
        if head.startswith(magic):
            raise PipelineError(
                f"{path}: the file is {suffix[1:]}-compressed but its name does not end in {suffix}; rename it "
                f"{path.name}{suffix} (tokenize reads compressed inputs) or decompress it"
            )


def _open_binary(path: Path) -> IO[bytes]:
    if path.name.endswith(".gz"):
        return cast(IO[bytes], gzip.open(path, "rb"))
    if path.name.endswith(".zst"):
        import zstandard

        return zstandard.ZstdDecompressor().stream_reader(open(path, "rb"), closefd=True)
    return open(path, "rb")


def _jsonl(
    path: Path, text_key: str, max_record_bytes: int = MAX_RECORD_BYTES, keep_fields: bool = False
) -> Iterator[Record]:
    with _open_binary(path) as raw:
        # zstd's stream reader has no line iteration of its own
        reader = raw if isinstance(raw, (io.BufferedReader, gzip.GzipFile)) else io.BufferedReader(cast(Any, raw))
        n = 0
        while line := reader.readline(max_record_bytes + 1):
            n += 1
            if len(line) > max_record_bytes and not line.endswith(b"\n"):
                size = len(line)
                while (rest := reader.readline(1 << 20)) and not rest.endswith(b"\n"):
                    size += len(rest)  # skip the rest of the record without holding it
                size += len(rest)
                yield Record(
                    n,
                    None,
                    f"record of {size:,} bytes is larger than --max-record-bytes "
                    f"{max_record_bytes:,} (a JSON line is parsed whole; raise the limit if the RAM allows)",
                    "record_too_large",
                    size,
                )
                continue
            if not line.strip():
                continue  # blank lines separate nothing in JSONL; not a document
            try:
                s = line.decode("utf-8")
            except UnicodeDecodeError as e:
                yield Record(n, None, f"invalid UTF-8 at byte {e.start}", "invalid_utf8", len(line))
                continue
            try:
                obj = json.loads(s)
            except json.JSONDecodeError as e:
                yield Record(
                    n,
                    None,
                    f"malformed JSON ({e.msg.removesuffix(' at')} at column {e.colno})",
                    "malformed_json",
                    len(line),
                )
                continue
            record = _check_text(
                n,
                obj.get(text_key) if isinstance(obj, dict) else None,
                text_key,
                isinstance(obj, dict) and text_key in obj,
                len(line),
            )
            if record.reason == "missing_field" and isinstance(obj, dict):
                record = replace(record, error=missing_field(text_key, list(obj)))
            if keep_fields and record.text is not None:
                record = replace(record, fields={k: v for k, v in obj.items() if k != text_key})
            yield record


def _check_text(n: int, text: object, text_key: str, present: bool, nbytes: int = -1) -> Record:
    if nbytes < 0:
        nbytes = len(text) if isinstance(text, str) else 0
    if not present:
        return Record(n, None, missing_field(text_key, None), "missing_field", nbytes)
    if not isinstance(text, str):
        return Record(n, None, f"field '{text_key}' is {type(text).__name__}, not a string", "not_a_string", nbytes)
    if not text.strip():
        return Record(n, None, "empty document", "empty_document", nbytes)
    return Record(n, text, None, None, nbytes)


def missing_field(text_key: str, fields: list[str] | None) -> str:
    has = f"the record has {', '.join(fields[:8])}; " if fields else ""
    return f"missing field '{text_key}' ({has}set --text-key)"


def _txt(path: Path) -> Iterator[Record]:
    """One document per file, read in blocks (`last` False until its end), so that memory does not grow with the
    file. A first pass checks the UTF-8 and that there is text at all, so a bad file is one error record and no
    document is ever half written."""

    with _open_binary(path) as f:
        decoder = codecs.getincrementaldecoder("utf-8")()
        offset, lines, has_text = 0, 1, False
        while block := f.read(TXT_BLOCK_BYTES):
            try:
                text = decoder.decode(block)
            except UnicodeDecodeError as e:
                line = lines + block[: e.start].count(b"\n")
                yield Record(
                    line, None, f"invalid UTF-8 at byte {offset + e.start}", "invalid_utf8", offset + len(block)
                )
                return
            has_text = has_text or bool(text.strip())
            lines += block.count(b"\n")
            offset += len(block)
        try:
            decoder.decode(b"", final=True)
        except UnicodeDecodeError:
            yield Record(lines, None, f"invalid UTF-8 at byte {offset} (truncated at the end)", "invalid_utf8", offset)
            return
    if not has_text:
        yield Record(1, None, "empty document", "empty_document", offset)
        return
    with _open_binary(path) as f:
        decoder = codecs.getincrementaldecoder("utf-8")()
        block = f.read(TXT_BLOCK_BYTES)
        while block:
            following = f.read(TXT_BLOCK_BYTES)
            yield Record(1, decoder.decode(block, final=not following), None, None, len(block), last=not following)
            block = following


def _parquet(path: Path, text_key: str, keep_fields: bool = False) -> Iterator[Record]:
    import pyarrow.parquet as pq

    with _open_binary(path) as f:
        pf = pq.ParquetFile(f)
        if text_key not in pf.schema_arrow.names:
            raise PipelineError(
                f"{path}: no column '{text_key}' (columns: {', '.join(pf.schema_arrow.names)}); set --text-key"
            )
        row = 0
        for batch in pf.iter_batches(columns=None if keep_fields else [text_key], batch_size=1024):
            for record in batch.to_pylist():
                row += 1
                yield _with_fields(_check_text(row, record.pop(text_key), text_key, True), record, keep_fields)


def _with_fields(record: Record, others: dict[str, Any], keep: bool) -> Record:
    return replace(record, fields=others) if keep and record.text is not None else record


def _hf(path: Path, text_key: str, keep_fields: bool = False) -> Iterator[Record]:
    import datasets

    dataset = datasets.load_from_disk(str(path))
    if isinstance(dataset, datasets.DatasetDict):
        parts = [dataset[k] for k in sorted(dataset.keys())]
    else:
        parts = [dataset]
    row = 0
    for part in parts:
        if text_key not in part.column_names:
            raise PipelineError(
                f"{path}: no column '{text_key}' (columns: {', '.join(part.column_names)}); set --text-key"
            )
        columns = part.column_names if keep_fields else [text_key]
        for batch in part.select_columns(columns).iter(batch_size=1024):
            for i, value in enumerate(batch[text_key]):
                row += 1
                others = {k: batch[k][i] for k in columns if k != text_key}
                yield _with_fields(_check_text(row, value, text_key, True), others, keep_fields)


def read_records(
    src: Source, text_key: str = "text", max_record_bytes: int = MAX_RECORD_BYTES, keep_fields: bool = False
) -> Iterator[Record]:
    """The documents of one source, in order. `keep_fields`: each record also carries its other fields (a JSON
    line's other keys, a row's other columns; none for .txt)."""
    if src.kind in ("jsonl", "txt"):
        check_not_compressed(src.path)
    try:
        if src.kind == "jsonl":
            yield from _jsonl(src.path, text_key, max_record_bytes, keep_fields)
        elif src.kind == "txt":
            yield from _txt(src.path)
        elif src.kind == "parquet":
            yield from _parquet(src.path, text_key, keep_fields)
        else:
            yield from _hf(src.path, text_key, keep_fields)
    except PipelineError:
        raise
    except (OSError, EOFError, ValueError) as e:
        # gzip/zstd/parquet corruption surfaces here; name the file, keep it one line.
        raise PipelineError(f"{src.path}: cannot read ({type(e).__name__}: {e})") from None
