"""Stage 4: evaluate a checkpoint and export it to a Hugging Face folder."""
