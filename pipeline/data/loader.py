"""Training data: `ShardedDataset` (mmap'd shards), the global sample order, and the rank-aware loader.

The order is a pure function of (seed, position): position p is sample perm(seed, p // n)[p % n], a fresh
permutation per epoch. Global batch g is positions [g*B, (g+1)*B); data-parallel rank r at micro-step t reads
positions p0 + t*m*W + r*m + [0, m). So the samples of every global batch are the same set for any world size
W, a run resumes at any `consumed_samples` without replaying, and no sample is lost or read twice.
This module imports neither `datasets` nor `deepspeed`.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.atomic import sha256_file
from pipeline.data.manifest import ShardManifest, read_shard_manifest
from pipeline.errors import PipelineError


class ShardedDataset:
    """`len(dataset)` samples of `seq_len + 1` ids; `dataset[i]` in O(1) through mmap; `dataset.loss_mask(i)` when
    padded."""

    def __init__(self, path: str | Path, split: str = "train"):
        self.path = Path(path)
        self.manifest: ShardManifest = read_shard_manifest(self.path)
        if split not in self.manifest["splits"]:
            raise PipelineError(f"{self.path}: no split '{split}' (have {', '.join(self.manifest['splits'])})")
        self.split = split
        self.seq_len: int = self.manifest["seq_len"]
        self.width = self.seq_len + 1
        self.dtype = np.dtype(self.manifest["dtype"])
        self.fingerprint: str = self.manifest["fingerprint"]
        self._files = self.manifest["splits"][split]["shards"]
        self._rows: list[np.ndarray] = []
        self._lens: list[np.ndarray | None] = []
        self._src: list[np.ndarray | None] = []
        self._starts: list[int] = []
        total = 0
        for f in self._files:
            p = self.path / f["file"]
            size = p.stat().st_size if p.exists() else -1
            if size != f["bytes"]:
                raise PipelineError(
                    f"{p}: {'missing' if size < 0 else f'{size} bytes'} but the manifest says "
                    f"{f['bytes']}; the shard is truncated or altered: re-run `pipeline shard "
                    "--overwrite`"
                )
            self._starts.append(total)
            total += f["samples"]
            self._rows.append(
                np.memmap(p, self.dtype, "r", shape=(f["samples"], self.width))
                if f["samples"]
                else np.zeros((0, self.width), self.dtype)
            )
            lens = f.get("lengths_file")
            self._lens.append(
                np.memmap(self.path / lens, np.int32, "r", shape=(f["samples"],)) if lens and f["samples"] else None
            )
            src = f.get("sources_file")
            self._src.append(
                np.memmap(self.path / src, np.uint16, "r", shape=(f["samples"],)) if src and f["samples"] else None
            )
        self._n = total
        self.has_loss_mask = not self.manifest["cross_document"]
        self.document_masks = bool(self.manifest.get("document_masks"))
        """Samples hold several whole documents (`pipeline shard --whole-documents`): the batches carry
        position_ids that restart at each document, so attention stays inside it."""
        self.eos_id = int(self.manifest["tokenizer"]["eos_id"])
        self._single = self._rows[0] if len(self._rows) == 1 else None

    def __len__(self) -> int:
        return self._n

    def _locate(self, i: int) -> tuple[int, int]:
        if not 0 <= i < self._n:
            raise IndexError(f"sample {i} out of range for {self._n} samples")
        k = bisect.bisect_right(self._starts, i) - 1
        return k, i - self._starts[k]

    def __getitem__(self, i: int) -> np.ndarray:
        if self._single is not None:
            return np.array(self._single[i])
        k, j = self._locate(i)
        return np.array(self._rows[k][j])

    def loss_mask(self, i: int) -> np.ndarray | None:
        """Per-token mask over the `seq_len + 1` ids (True = real token), or None when nothing is padded."""
        if not self.has_loss_mask:
            return None
        k, j = self._locate(i)
        lens = self._lens[k]
        valid = int(lens[j]) if lens is not None else self.width
        return np.arange(self.width) < valid

    @property
    def source_names(self) -> list[str]:
        """The names of the split's sources, by index: each `pipeline shard` input's file name (its whole prefix
        where two share a name)."""
        prefixes = [str(s["prefix"]) for s in self.manifest["splits"][self.split].get("sources", [])]
        names = [Path(p).name for p in prefixes]
        return prefixes if len(set(names)) < len(names) else names

    def sources_of(self, ids: list[int]) -> np.ndarray | None:
        """The source index of each sample of `ids` (None for shards written before samples recorded theirs, unless
        the shards have one source)."""
        out = np.empty(len(ids), np.int64)
        for n, i in enumerate(ids):
            k, j = self._locate(i)
            src = self._src[k]
            if src is None:
                if len(self.source_names) != 1:
                    return None
                out[n] = 0
            else:
                out[n] = int(src[j])
        return out

    def verify(self) -> None:
        """Checksums of every shard against the manifest (reads all bytes; sizes are checked at open)."""
        for f in self._files:
            checks = [(f["file"], f["sha256"])]
            if "lengths_file" in f:
                checks.append((f["lengths_file"], f["lengths_sha256"]))
            if "sources_file" in f:
                checks.append((f["sources_file"], f["sources_sha256"]))
            for name, expected in checks:
                if sha256_file(self.path / name) != expected:
                    raise PipelineError(
                        f"{self.path / name}: checksum differs from the manifest; the shard was "
                        "altered: re-run `pipeline shard --overwrite`"
                    )

    @property
    def tokenizer_path(self) -> Path | None:
        tok = self.manifest["tokenizer"]
        copy = tok.get("copy")
        if copy and (self.path / copy).exists():
            return self.path / copy
        return Path(tok["path"]) if Path(tok["path"]).exists() else None


def epoch_permutation(seed: int, epoch: int, n: int) -> np.ndarray:
    return np.random.default_rng([seed, 7, epoch]).permutation(n)


class GlobalOrder:
    """Position -> sample id over an endless sequence of seeded epoch permutations (one epoch cached)."""

    def __init__(self, n: int, seed: int):
        if n <= 0:
            raise PipelineError("the split has no samples; use a shorter --seq-len or more data")
        self.n, self.seed = n, seed
        self._epoch = -1
        self._perm = np.zeros(0, np.int64)

    def __getitem__(self, position: int) -> int:
        epoch, j = divmod(position, self.n)
        if epoch != self._epoch:
            self._epoch, self._perm = epoch, epoch_permutation(self.seed, epoch, self.n)
        return int(self._perm[j])


def rank_batches(
    n: int, seed: int, micro_batch_size: int, data_parallel_size: int, rank: int, consumed_samples: int = 0
) -> Iterator[list[int]]:
    """Endless micro-batches (lists of sample ids) for `rank`, starting after `consumed_samples`."""
    stride = micro_batch_size * data_parallel_size
    if consumed_samples % stride:
        raise PipelineError(
            f"consumed_samples {consumed_samples} is not a multiple of micro batch x data-parallel "
            f"size ({stride}); the global batch must be divisible by it"
        )
    order = GlobalOrder(n, seed)
    position = consumed_samples + rank * micro_batch_size
    while True:
        yield [order[position + j] for j in range(micro_batch_size)]
        position += stride


class _BatchSampler:
    def __init__(self, **kw: Any):
        self.kw = kw

    def __iter__(self) -> Iterator[list[int]]:
        return rank_batches(**self.kw)


def document_positions(input_ids: Any, eos_id: int) -> Any:
    """Pure: (B, T) ids of samples packed with whole documents, each ending with `eos_id` -> (B, T) positions
    that restart at 0 after every EOS. transformers reads positions that restart as separate sequences in one row
    (its packed-sequence masks), so a token attends only to its own document."""
    import torch

    idx = torch.arange(input_ids.size(1)).expand_as(input_ids)
    starts = torch.zeros_like(input_ids, dtype=torch.bool)
    starts[:, 1:] = input_ids[:, :-1] == eos_id
    return idx - torch.cummax(torch.where(starts, idx, torch.zeros_like(idx)), dim=1).values


class _Collate:
    """Sample ids -> {"input_ids": (B, T), "labels": (B, T)} int64; labels are -100 where the mask excludes. For
    samples of whole documents also "position_ids" (B, T), restarting at each document, and no label across a
    boundary (an EOS does not predict the next document's first token)."""

    def __init__(self, dataset: ShardedDataset):
        self.dataset = dataset
        self.eos_id = dataset.eos_id if dataset.document_masks else None

    def __call__(self, items: list[tuple[np.ndarray, np.ndarray | None]]) -> dict[str, Any]:
        import torch

        ids = torch.from_numpy(np.stack([a for a, _ in items]).astype(np.int64))  # (B, T+1)
        labels = ids[:, 1:].clone()
        if items[0][1] is not None:
            mask = torch.from_numpy(np.stack([m for _, m in items if m is not None]))[:, 1:]
            labels[~mask] = -100
        inputs = ids[:, :-1].contiguous()
        if self.eos_id is None:
            return {"input_ids": inputs, "labels": labels}
        labels[inputs == self.eos_id] = -100
        return {"input_ids": inputs, "labels": labels, "position_ids": document_positions(inputs, self.eos_id)}


class _WithMask:
    def __init__(self, dataset: ShardedDataset):
        self.dataset = dataset

    def __getitem__(self, i: int) -> tuple[np.ndarray, np.ndarray | None]:
        return self.dataset[i], self.dataset.loss_mask(i)

    def __len__(self) -> int:
        return len(self.dataset)


def _worker_init(_: int) -> None:
    # A launcher's SIGTERM reaches the whole process tree; workers must outlive it until the rank has saved its
    # checkpoint, so they ignore it and exit with their parent.
    import signal

    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def collate_samples(dataset: ShardedDataset, sample_ids: list[int]) -> dict[str, Any]:
    """The same batch the loader would give for these sample ids, without a DataLoader."""
    return _Collate(dataset)([_WithMask(dataset)[i] for i in sample_ids])


def build_loader(
    dataset: ShardedDataset,
    *,
    seed: int,
    micro_batch_size: int,
    data_parallel_size: int,
    rank: int,
    consumed_samples: int = 0,
    num_workers: int = 1,
    pin_memory: bool | None = None,
) -> Any:
    """A PyTorch DataLoader over this rank's micro-batches, from `consumed_samples` on (endless)."""
    import torch

    if pin_memory is None:
        pin_memory = torch.cuda.is_available()
    sampler = _BatchSampler(
        n=len(dataset),
        seed=seed,
        micro_batch_size=micro_batch_size,
        data_parallel_size=data_parallel_size,
        rank=rank,
        consumed_samples=consumed_samples,
    )
    return torch.utils.data.DataLoader(
        _WithMask(dataset),  # type: ignore[arg-type]
        batch_sampler=sampler,
        collate_fn=_Collate(dataset),
        num_workers=num_workers,
        pin_memory=pin_memory,
        worker_init_fn=_worker_init if num_workers > 0 else None,
        persistent_workers=num_workers > 0,
        prefetch_factor=4 if num_workers > 0 else None,
    )
