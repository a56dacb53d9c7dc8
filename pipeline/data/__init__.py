"""Stages 1 and 2 and the training data loader: readers, tokenizer, indexed format, tokenize, shard, loader, demo
corpus."""
