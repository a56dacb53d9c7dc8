"""Starting and supervising the ranks of a run: pipeline.launch.start (`pipeline pretrain` and `pipeline evaluate
--num-gpus | --hostfile`: every check first, then the launch), command (the deepspeed command line), supervise (the
process tree, signals, restarts), shrink (continuing on the hosts that answer), slices and probe (`pipeline
probe`)."""

from pipeline.launch.start import build_ops_ahead, evaluate, pretrain

__all__ = ["build_ops_ahead", "evaluate", "pretrain"]
