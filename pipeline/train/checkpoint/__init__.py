"""Checkpoints: the files on disk (files), the checkpointer that saves and resumes (checkpointer), the rules of
what may be resumed (resume), and consolidation into one state dict (consolidate). Imports setup/ and runtime/."""
