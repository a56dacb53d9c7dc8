"""Evaluation's partitioned loading across two real ranks: a ZeRO-3 checkpoint streamed by rank 0 into a model
built under zero.Init gives the logits the one-process path gives."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.distributed.runner import run_distributed
from tests.multiproc import launch

pytestmark = pytest.mark.dist


def _save_then_load_partitioned(rank: int, world: int, config: str) -> Any:
    import torch

    from pipeline.atomic import write_text
    from pipeline.data.loader import ShardedDataset
    from pipeline.evaluate.distributed import load_partitioned, zero3_inference_config
    from pipeline.evaluate.inputs import EvalConfig, open_inputs
    from pipeline.train.checkpoint.checkpointer import Checkpointer
    from pipeline.train.engine import build_engine
    from pipeline.train.runtime.dist import Dist
    from pipeline.train.setup.config import dump, load
    from pipeline.train.setup.prepare import Run, prepare
    from pipeline.train.state import TrainState

    cfg = load(config)
    prepared = prepare(cfg, world)
    run = Run.on(prepared, Dist(rank, world, torch.device("cpu")))
    run.run_dir.mkdir(parents=True, exist_ok=True)
    saver = Checkpointer(run, data_fingerprint="fp")
    saver.resume(
        lambda ds: build_engine(cfg, ds, prepared.layout, prepared.shape, prepared.manifest["tokenizer"], rank)
    )
    saver.save(TrainState(3, 24))
    if rank == 0:
        write_text(run.run_dir / "config.yaml", dump(cfg))
    import deepspeed.comm as dist

    dist.barrier()
    inputs = open_inputs(EvalConfig(checkpoint=str(run.run_dir)))
    model = load_partitioned(inputs, run.dist, zero3_inference_config(2, world, bf16=False))
    ids = torch.from_numpy(ShardedDataset(cfg.data.path, "val")[0][:-1].astype("int64"))[None]
    with torch.no_grad():
        return model(input_ids=ids).logits.numpy()  # by value: a tensor would cross as a shared fd


def test_partitioned_loading_gives_the_one_process_logits(shards: Path, tmp_path: Path) -> None:
    import torch

    from pipeline.data.loader import ShardedDataset
    from pipeline.evaluate.inputs import load_model, open_run

    run_dir = tmp_path / "run"
    cfg = launch.write_config(tmp_path / "c.yaml", run_dir=run_dir, shards=shards, ds_config="zero3.json")
    partitioned = run_distributed(_save_then_load_partitioned, str(cfg), timeout=300)
    data = ShardedDataset(shards, "val")
    model = load_model(open_run(run_dir), torch.device("cpu"), data.manifest["tokenizer"])
    ids = torch.from_numpy(data[0][:-1].astype("int64"))[None]
    with torch.no_grad():
        one = model(input_ids=ids).logits
    for logits in partitioned:
        logits = torch.from_numpy(logits)
        assert torch.allclose(logits, one, rtol=1e-5, atol=1e-5), (logits - one).abs().max()
