"""`pipeline probe`: this node's rates (pipeline.plan.probe) and, with a config, its model measured at small depths
through the trainer (pipeline.launch.slices), written where `pipeline plan` reads them."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from pipeline.errors import PipelineError
from pipeline.plan import probe as probing
from pipeline.plan.request import ProbeRequest
from pipeline.train.runtime.ops import use_project_cache


def probe(req: ProbeRequest, say: Callable[[str], None]) -> tuple[dict[str, Any], Path]:
    """Measure this node (and the config's slices), write the probe; (the probe, its file). `say`: progress."""
    use_project_cache()  # CPU Adam loads from the project's op cache (`make ops` builds it)
    slices = None
    gemm_shape = None
    if req.config:
        from pipeline.launch.command import Where
        from pipeline.launch.slices import measure

        try:
            depths = tuple(int(x) for x in req.slice_layers.split(","))
        except ValueError:
            raise PipelineError(f"--slice-layers {req.slice_layers}: expected depths such as 2,4") from None
        where = Where(num_gpus=req.num_gpus)
        where.check_local_gpus()
        ranks = where.resolved().world_size()[0]
        say(f"slices of {req.config} on this node ({ranks} rank(s)):")
        slices = measure(
            req.config,
            list(req.sets),
            num_gpus=ranks,
            layers=depths,
            steps=req.slice_steps,
            repeats=req.slice_repeats,
            say=say,
        )
        if not req.model:  # the config's own model at its own micro-step
            key = slices["key"]
            shape = key["shape"]
            gemm_shape = (shape["hidden_size"], shape["ffn_hidden_size"], key["seq_len"] * key["micro_batch_size"])
    if req.model:
        from pipeline.plan.search import planned_shape

        planned, _ = planned_shape(req.model, None, 32000, req.seq_len)
        gemm_shape = (planned.hidden_size, planned.ffn_hidden_size, req.seq_len * req.micro_batch_size)
    return probing.run(req.hostfile, req.out, gemm_shape=gemm_shape, quick=req.quick, slices=slices)
