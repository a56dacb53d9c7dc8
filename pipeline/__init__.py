"""DeepSpeed-backed pretraining pipeline: tokenize -> shard -> pretrain -> evaluate, plus a planner."""

__version__ = "0.1.0"
