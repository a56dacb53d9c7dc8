"""What a run is before it starts: the config, the optimizer table, the DeepSpeed JSON, the prepared run, the
learning-rate schedule, the run lock. Imports runtime/ only."""
