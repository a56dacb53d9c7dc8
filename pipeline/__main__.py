"""`python -m pipeline ...`: the same as the `pipeline` command."""

from pipeline.cli import main

main(prog_name="pipeline")
