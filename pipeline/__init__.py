"""DeepSpeed-backed pretraining pipeline: tokenize -> shard -> pretrain -> evaluate, plus a planner."""

import logging

__version__ = "0.1.0"

KNOWN_NOISE = {
    "torchao": ("Failed to load ",),
    "torchao.kernel.intmm": ("Warning: Detected no triton",),
    "torch.utils._pytree": ("%s is an Enum subclass and is now natively supported",),
}
"""Warnings every command printed at import on a machine without CUDA kernels or Triton, none the user's to act
on: torchao's optional C++ kernels built for another Python or CUDA, its note that Triton is absent, and torch's
deprecation of torchao's own Enum registration. Dropped by logger and message (their other warnings still show)."""


class _DropKnownNoise(logging.Filter):
    def __init__(self, starts: tuple[str, ...]) -> None:
        super().__init__()
        self.starts = starts

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.starts)


for _name, _starts in KNOWN_NOISE.items():
    logging.getLogger(_name).addFilter(_DropKnownNoise(_starts))
