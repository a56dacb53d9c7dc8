"""Loader and shard-stage throughput, side by side with their limits in the same run:
  - `ShardedDataset[i]` random access, one process, vs a raw np.memmap slice read of the same rows (the limit);
  - `pipeline shard` in MB/s of tokens, vs copying the same bytes through numpy (the limit).
Usage: python bench/data_bench.py [--tokens 100_000_000] [--seq-len 2048]"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np

from pipeline.atomic import write_json
from pipeline.data import shard as shard_stage
from pipeline.data.config import ShardConfig
from pipeline.data.indexed import IndexedWriter
from pipeline.data.loader import ShardedDataset


def synthetic_prefix(work: Path, tokens: int) -> Path:
    """A tokenize-stage output of random documents (lengths 200..4000), with a manifest."""
    rng = np.random.default_rng(0)
    prefix = work / "synthetic"
    w = IndexedWriter(Path(str(prefix) + ".bin"), np.dtype(np.uint16))
    written = 0
    while written < tokens:
        lengths = rng.integers(200, 4000, 1000).astype(np.int32)
        flat = rng.integers(4, 32000, int(lengths.sum())).astype(np.uint16)
        w.add_many(lengths, flat)
        written += len(flat)
    w.finish(Path(str(prefix) + ".idx"))
    write_json(
        str(prefix) + ".manifest.json",
        {
            "tokenizer": {
                "path": "synthetic",
                "sha256": "0" * 64,
                "kind": "none",
                "vocab_size": 32000,
                "eos_id": 2,
                "bos_id": 1,
                "pad_id": 3,
            },
            "dtype": "uint16",
            "totals": {"documents": w.documents, "tokens": w.tokens},
        },
    )
    return prefix


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=100_000_000)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--reads", type=int, default=200_000)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="databench-"))
    try:
        prefix = synthetic_prefix(work, args.tokens)
        nbytes = os.path.getsize(str(prefix) + ".bin")
        t = time.perf_counter()
        arr = np.fromfile(str(prefix) + ".bin", dtype=np.uint16)
        arr.tofile(work / "copy.bin")
        copy_mbs = nbytes / 1e6 / (time.perf_counter() - t)
        del arr
        t = time.perf_counter()
        shard_stage.run(
            ShardConfig(
                sources=((str(prefix), 1.0),),
                output=str(work / "shards"),
                seq_len=args.seq_len,
                split=(98.0, 1.0, 1.0),
                progress=False,
            )
        )
        shard_mbs = nbytes / 1e6 / (time.perf_counter() - t)

        dataset = ShardedDataset(work / "shards", "train")
        width = dataset.width
        f = dataset.manifest["splits"]["train"]["shards"][0]
        raw = np.memmap(work / "shards" / f["file"], dtype=np.uint16, mode="r")
        idx = np.random.default_rng(1).integers(0, min(len(dataset), f["samples"]), args.reads).tolist()
        for i in idx[:2000]:  # warm the page cache for both
            dataset[i]
        results = {}
        for name in ("raw", "ours", "raw", "ours"):  # interleaved, best of two
            t = time.perf_counter()
            if name == "raw":
                for i in idx:
                    np.array(raw[i * width : (i + 1) * width])
            else:
                for i in idx:
                    dataset[i]
            rate = args.reads * width / (time.perf_counter() - t)
            results[name] = max(results.get(name, 0.0), rate)
        t = time.perf_counter()
        ShardedDataset(work / "shards", "train")
        open_ms = (time.perf_counter() - t) * 1e3
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(
        f"machine: {platform.machine()}, {os.cpu_count()} cores; {args.tokens / 1e6:.0f}M tokens, seq_len "
        f"{args.seq_len}, {args.reads:,} random reads"
    )
    print("| what | throughput | ratio |")
    print("|---|---:|---:|")
    print(f"| raw np.memmap slice read (limit) | {results['raw'] / 1e6:,.1f} M tokens/s | 1.00 |")
    print(f"| `ShardedDataset[i]` | {results['ours'] / 1e6:,.1f} M tokens/s | {results['ours'] / results['raw']:.2f} |")
    print(f"| numpy read + write of the same bytes (limit) | {copy_mbs:,.0f} MB/s | 1.00 |")
    print(
        f"| `pipeline shard` (pack, split, shuffle, write, checksum) | {shard_mbs:,.0f} MB/s | "
        f"{shard_mbs / copy_mbs:.2f} |"
    )
    print(f"opening a ShardedDataset: {open_ms:.1f} ms")


if __name__ == "__main__":
    main()
