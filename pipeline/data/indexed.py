"""Megatron-LM indexed dataset (`PREFIX.bin` + `PREFIX.idx`, "MMIDIDX" header), streaming writer and mmap reader.

The layout matches megatron-core's `IndexedDataset` exactly, so Megatron-LM and GPT-NeoX read our output unchanged:
    idx: b"MMIDIDX\\0\\0" | <Q version=1 | <B dtype code | <Q sequence count | <Q document count
         | int32 lengths[seq] | int64 byte pointers[seq] | int64 document indices[doc]
    bin: the tokens of every sequence, back to back, in the dtype named by the code.
One sequence per document here, so document indices are 0..n.
"""

from __future__ import annotations

import hashlib
import os
import struct
from pathlib import Path
from typing import BinaryIO

import numpy as np

from pipeline.atomic import sha256_file
from pipeline.errors import PipelineError

INDEX_HEADER = b"MMIDIDX\x00\x00"
_DTYPE_CODES: dict[np.dtype, int] = {
    np.dtype(np.uint8): 1,
    np.dtype(np.int8): 2,
    np.dtype(np.int16): 3,
    np.dtype(np.int32): 4,
    np.dtype(np.int64): 5,
    np.dtype(np.float64): 6,
    np.dtype(np.float32): 7,
    np.dtype(np.uint16): 8,
}
_CODE_DTYPES: dict[int, np.dtype] = {v: k for k, v in _DTYPE_CODES.items()}


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id fits with Megatron's margin (vocab < 65,500), else int32 (Megatron's rule)."""
    return np.dtype(np.uint16) if vocab_size < 65500 else np.dtype(np.int32)


class IndexedWriter:
    """Streams documents to `bin_path`; lengths are spooled to a side file so memory stays flat.

    Call `add(ids)` per document, then `finish(idx_path)`. Paths are the caller's (temporary) names. After
    `finish`, `files` holds each file's size and sha256 (the .bin hashed as it is written), for the manifest that
    lets a later stage tell the files were changed after they were written.
    """

    def __init__(self, bin_path: Path, dtype: np.dtype, count_ids: int = 0):
        """`count_ids`: the vocabulary size, to count each id's occurrences in `id_counts` as they are written."""
        self.dtype = np.dtype(dtype)
        self.id_counts = np.zeros(count_ids, dtype=np.int64)
        self.bin_path = Path(bin_path)
        self._bin: BinaryIO = open(self.bin_path, "wb")
        self._len_path = self.bin_path.with_name(self.bin_path.name + ".lengths")
        self._lens: BinaryIO = open(self._len_path, "wb")
        self.documents = 0
        self.tokens = 0
        self._open_doc = 0  # tokens of a document whose last piece has not come yet
        self._sha = hashlib.sha256()
        self.files: dict[str, dict[str, int | str]] = {}

    def _write(self, arr: np.ndarray) -> None:
        data = arr.tobytes()
        self._sha.update(data)
        if len(self.id_counts) and len(arr):
            self.id_counts += np.bincount(arr, minlength=len(self.id_counts))[: len(self.id_counts)]
        self._bin.write(data)

    def add(self, ids: np.ndarray) -> None:
        arr = np.asarray(ids)
        if arr.dtype != self.dtype:
            arr = arr.astype(self.dtype)
        self._write(arr)
        self._lens.write(struct.pack("<i", len(arr)))
        self.documents += 1
        self.tokens += len(arr)

    def add_pieces(self, lengths: np.ndarray, lasts: np.ndarray, flat_ids: np.ndarray) -> int:
        """Append pieces of documents: `flat_ids` is their concatenation, `lengths` their token counts, `lasts`
        whether each ends its document (a document's pieces may span several calls). Returns documents ended."""
        flat = np.asarray(flat_ids)
        if flat.dtype != self.dtype:
            flat = flat.astype(self.dtype)
        self._write(flat)
        ends = []
        for n, last in zip(lengths.tolist(), lasts.tolist(), strict=True):
            self._open_doc += n
            if last:
                if self._open_doc >= 2**31:
                    raise PipelineError(
                        f"a document of {self._open_doc:,} tokens: more than the index format's "
                        "int32 length; split such a file into several documents"
                    )
                ends.append(self._open_doc)
                self._open_doc = 0
        self._lens.write(np.asarray(ends, dtype="<i4").tobytes())
        self.documents += len(ends)
        self.tokens += len(flat)
        return len(ends)

    def add_many(self, lengths: np.ndarray, flat_ids: np.ndarray) -> None:
        """Append several documents at once: `flat_ids` is their concatenation, `lengths` their sizes."""
        flat = np.asarray(flat_ids)
        if flat.dtype != self.dtype:
            flat = flat.astype(self.dtype)
        self._write(flat)
        self._lens.write(np.asarray(lengths, dtype="<i4").tobytes())
        self.documents += len(lengths)
        self.tokens += len(flat)

    def finish(self, idx_path: Path, chunk: int = 1 << 20) -> None:
        self._bin.close()
        self._lens.close()
        itemsize = self.dtype.itemsize
        n = self.documents
        with open(idx_path, "wb") as out, open(self._len_path, "rb") as lens:
            out.write(INDEX_HEADER)
            out.write(struct.pack("<Q", 1))
            out.write(struct.pack("<B", _DTYPE_CODES[self.dtype]))
            out.write(struct.pack("<Q", n))
            out.write(struct.pack("<Q", n + 1))
            # lengths, then pointers, then document indices; each streamed in chunks.
            while block := lens.read(chunk * 4):
                out.write(block)
            lens.seek(0)
            offset = 0
            while block := lens.read(chunk * 4):
                lengths = np.frombuffer(block, dtype="<i4").astype(np.int64)
                pointers = np.empty_like(lengths)
                pointers[0] = offset
                np.cumsum(lengths[:-1] * itemsize, out=pointers[1:])
                pointers[1:] += offset
                offset = int(pointers[-1] + lengths[-1] * itemsize)
                out.write(pointers.astype("<i8").tobytes())
            for start in range(0, n + 1, chunk):
                out.write(np.arange(start, min(n + 1, start + chunk), dtype="<i8").tobytes())
            out.flush()
            os.fsync(out.fileno())
        os.unlink(self._len_path)
        self.files = {
            "bin": {"bytes": self.bin_path.stat().st_size, "sha256": self._sha.hexdigest()},
            "idx": {"bytes": Path(idx_path).stat().st_size, "sha256": sha256_file(idx_path)},
        }

    def abort(self) -> None:
        for f in (self._bin, self._lens):
            if not f.closed:
                f.close()
        self._len_path.unlink(missing_ok=True)


class IndexedReader:
    """Read-only mmap view of a `PREFIX.bin/.idx` pair: `len(r)` documents, `r[i]` the ids of document i."""

    def __init__(self, prefix: str | Path):
        prefix = str(prefix)
        self.idx_path, self.bin_path = prefix + ".idx", prefix + ".bin"
        for p in (self.idx_path, self.bin_path):
            if not os.path.exists(p):
                raise PipelineError(f"{p}: not found; run `pipeline tokenize ... --output-prefix {prefix}` first")
        with open(self.idx_path, "rb") as f:
            header = f.read(9 + 8 + 1 + 8 + 8)
        if len(header) < 34 or header[:9] != INDEX_HEADER:
            raise PipelineError(f"{self.idx_path}: not a Megatron indexed dataset (bad MMIDIDX header)")
        version, code, n, ndocs = struct.unpack("<QBQQ", header[9:])
        if version != 1 or code not in _CODE_DTYPES:
            raise PipelineError(f"{self.idx_path}: unsupported version {version} or dtype code {code}")
        self.dtype = _CODE_DTYPES[code]
        idx = np.memmap(self.idx_path, mode="r", dtype=np.uint8)
        off = 34
        self.lengths = np.frombuffer(idx, dtype="<i4", count=n, offset=off)
        off += 4 * n
        self.pointers = np.frombuffer(idx, dtype="<i8", count=n, offset=off)
        off += 8 * n
        self.document_indices = np.frombuffer(idx, dtype="<i8", count=ndocs, offset=off)
        expected = int(self.lengths.sum(dtype=np.int64)) * self.dtype.itemsize
        actual = os.path.getsize(self.bin_path)
        if actual != expected:
            raise PipelineError(
                f"{self.bin_path}: {actual} bytes but the index says {expected}; "
                "the file is truncated or altered: re-run `pipeline tokenize`"
            )
        self.tokens = np.memmap(self.bin_path, mode="r", dtype=self.dtype) if actual else np.zeros(0, self.dtype)

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, i: int) -> np.ndarray:
        start = int(self.pointers[i]) // self.dtype.itemsize
        return self.tokens[start : start + int(self.lengths[i])]
