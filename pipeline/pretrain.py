#!/usr/bin/env python
"""Stage 3: the file users launch, `deepspeed [--hostfile H | --num_gpus N] pipeline/pretrain.py --config
CONFIG.yaml [--set key=value ...] [--dry-run]`. A thin script over `pipeline.train`; `pipeline pretrain` builds
the same command for you."""

import os
import sys

if __name__ == "__main__":
    # Run as a script, this file's folder would come first on sys.path and every sibling would shadow a
    # top-level name (STYLE.md's script-path trap). Drop it; import the package from the install (or checkout).
    _here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.getcwd()) != _here]
    if os.path.dirname(_here) not in sys.path:
        sys.path.append(os.path.dirname(_here))

    from pipeline.train.main import run_as_script

    run_as_script()
