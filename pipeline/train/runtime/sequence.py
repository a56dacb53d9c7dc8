"""Sequence parallelism: a group of N consecutive ranks trains one sample together (DeepSpeed's Ulysses for Hugging
Face models, from Arctic Long Sequence Training). Every rank of a group reads the same micro-batch; each keeps
seq_len / N of its tokens (`shard`), so each layer's activations on a rank are those of seq_len / N tokens; an
all-to-all before and after attention gives each rank every token of N-th of the heads (DeepSpeed's
UlyssesSPAttentionHF, which wraps the model's attention function: `register`). Ulysses drops every attention mask;
documents and sliding windows survive only on the varlen path, which reads the gathered positions
(pipeline.model.varlen decides before launch, and refuses what would silently train another model).

The loss of a rank is its tokens' summed loss over the whole sample's token count, so the group's losses add up to
the sample's mean, and ZeRO (which averages gradients over world / N and sums them within a group) applies the update
one rank would.

For the data, the batch arithmetic and resuming, a group is one data-parallel replica: ranks r and r + 1 of a
group of 2 are replica r // 2. So the token order is that of a world of world / N ranks, and a checkpoint resumes
on any world and any N."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from pipeline.train.runtime.ds_workarounds import SequenceGroups


@dataclass(frozen=True, slots=True)
class SequenceShard:
    """This rank's place: `size` ranks share a sample, this one holds the `index`-th of its seq_len / size pieces."""

    size: int = 1
    index: int = 0

    @classmethod
    def of(cls, size: int, rank: int) -> SequenceShard:
        return cls(size, rank % size)

    def shard(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Pure: this rank's piece of a micro-batch: input_ids and labels (B, T) -> (B, T / size), with the
        tokens' positions in the whole sample (RoPE needs them, and Ulysses gathers them to mask causally)."""
        if self.size == 1:
            return batch
        width = batch["input_ids"].size(1) // self.size
        lo, hi = self.index * width, (self.index + 1) * width
        positions = (
            batch["position_ids"][:, lo:hi]
            if "position_ids" in batch
            else torch.arange(lo, hi, dtype=torch.long).expand(batch["input_ids"].size(0), width)
        )
        ids, labels = batch["input_ids"][:, lo:hi], batch["labels"][:, lo:hi]
        return {"input_ids": ids, "labels": labels, "position_ids": positions}


def register(model: Any, size: int, micro_batch_size: int) -> Any:
    """Make `size` consecutive ranks share each sample: DeepSpeed's sequence-parallel process groups, and its
    Ulysses attention in place of transformers' SDPA function (every model of this process uses it from here on).
    Returns the groups' object that `deepspeed.initialize(mpu=...)` takes, so ZeRO partitions over the whole world
    and averages gradients over world / size (pipeline.train.runtime.ds_workarounds.SequenceGroups)."""
    import deepspeed.runtime.sequence_parallel.parallel_state_sp as groups
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

    if groups._SEQUENCE_PARALLEL_GROUP is None:  # else a second engine of this process (a rebuilt one) shares them
        UlyssesSPAttentionHF.register_with_transformers(
            model_name_or_path=model,
            # the model's own (SDPA, or the varlen path of pipeline.model.varlen): Ulysses wraps that function
            core_attn_implementation=model.config._attn_implementation,
            sequence_parallel_size=size,
            micro_batch_size=micro_batch_size,
            seq_length_is_variable=True,  # the shapes are read at each forward: training and validation alike
        )
    return SequenceGroups()
