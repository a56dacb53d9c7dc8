"""The planner: will a model fit a cluster, how fast will it train, and which DeepSpeed config gets there."""
