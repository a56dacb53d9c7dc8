"""Stage 3: pretrain config, DeepSpeed config, engine, training loop, checkpoints."""
