"""Evaluation of a checkpoint too large for one device: every rank of a `deepspeed` launch holds 1/W of the model
(ZeRO-3, bf16 on GPUs), evaluates its share of the batches, and rank 0 writes the same results file as the
one-process path. `pipeline evaluate --num-gpus N | --hostfile H` starts it; each rank runs `evaluate_on_rank`."""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from typing import Any

from pipeline.errors import PipelineError
from pipeline.evaluate.inputs import EvalConfig, Inputs, open_inputs
from pipeline.evaluate.run import generate, perplexity, write_result
from pipeline.model import loss_chunk_tokens
from pipeline.plan.memory import evaluation_batch
from pipeline.train.checkpoint.consolidate import materialize
from pipeline.train.engine import build_for
from pipeline.train.runtime.dist import Dist, init_distributed, on_rank0
from pipeline.train.runtime.weights import fill_parameters, parameter_shapes, weight_mismatch

log = logging.getLogger(__name__)


def zero3_inference_config(batch_size: int, world_size: int, bf16: bool) -> dict[str, Any]:
    """ZeRO-3 without an optimizer: DeepSpeed partitions the parameters and gathers each module for its forward."""
    return {
        "train_micro_batch_size_per_gpu": batch_size,
        "gradient_accumulation_steps": 1,
        "train_batch_size": batch_size * world_size,
        "zero_optimization": {"stage": 3},
        "bf16": {"enabled": bf16},
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }


def load_partitioned(inputs: Inputs, env: Dist, ds: dict[str, Any]) -> Any:
    """The checkpoint's weights in a ZeRO-3 engine's module: built under `zero.Init` (no rank holds the whole
    model), filled from rank 0's streamed read of the checkpoint in gathered groups."""
    import deepspeed

    r = inputs.run
    model = build_for(r.shape, ds, inputs.dataset.manifest["tokenizer"], stage=3)
    state = r.weights() if env.rank == 0 else {}

    def check() -> None:  # before any gather: a raise inside one would leave the other ranks waiting
        given = {name: tuple(value.shape) for name, value in state.items()}
        if problem := weight_mismatch(parameter_shapes(model), given, f"{r.run_dir}/{r.name}"):
            raise PipelineError(problem)

    on_rank0(check)
    fill_parameters(model, (lambda i, name, shape: materialize(state[name])) if env.rank == 0 else None, stage3=True)
    engine, _, _, _ = deepspeed.initialize(model=model, config=ds)
    return engine.module.eval()


def batch_that_fits(cfg: EvalConfig, inputs: Inputs, env: Dist) -> int:
    """--batch-size, or the largest half of it whose forward fits every rank's GPU next to its share of the model
    (pipeline.plan.memory.inference_bytes); the same on every rank (the batches are split by it). On the CPU the
    batch is as asked."""
    if env.device.type != "cuda":
        return cfg.batch_size
    import torch
    import torch.distributed as tdist

    shape, seq = inputs.run.shape, inputs.dataset.seq_len
    total = torch.cuda.get_device_properties(env.device).total_memory
    batch, need = evaluation_batch(
        shape,
        seq,
        cfg.batch_size,
        env.world_size,
        total,
        loss_chunk_tokens(shape.vocab_size),
        dense_mask=inputs.dataset.document_masks,
    )
    agreed = torch.tensor([batch], device=env.device)
    tdist.all_reduce(agreed, op=tdist.ReduceOp.MIN)
    batch = int(agreed.item())
    if batch == 0:
        raise PipelineError(
            f"the model split {env.world_size} ways needs {need / 2**30:.1f} GiB per rank at batch 1 (seq {seq}), "
            f"more than a {total / 2**30:.1f} GiB GPU holds with its margin: evaluate across more GPUs (--hostfile)"
        )
    if batch != cfg.batch_size and env.rank == 0:
        log.warning(
            "--batch-size %d does not fit a %.1f GiB GPU beside 1/%d of the model; evaluating with batch %d",
            cfg.batch_size,
            total / 2**30,
            env.world_size,
            batch,
        )
    return batch


def evaluate_on_rank(cfg: EvalConfig) -> dict[str, Any] | None:
    """One rank's part; returns the result on rank 0, None elsewhere."""
    t0 = time.perf_counter()
    env = init_distributed()
    inputs = open_inputs(cfg)  # every rank checks the same inputs, so a bad one fails on all of them alike
    cfg = replace(cfg, batch_size=batch_that_fits(cfg, inputs, env))
    ds = zero3_inference_config(cfg.batch_size, env.world_size, bf16=env.device.type == "cuda")
    model = load_partitioned(inputs, env, ds)
    metrics = perplexity(
        model,
        inputs.dataset,
        inputs.tokenizer,
        batch_size=cfg.batch_size,
        max_batches=cfg.max_batches,
        device=env.device,
        rank=env.rank,
        world_size=env.world_size,
    )
    samples = generate(
        model,
        inputs.tokenizer,
        inputs.prompts,
        seed=cfg.seed,
        max_new_tokens=cfg.max_new_tokens,
        device=env.device,
        synced=True,
    )
    if env.rank != 0:
        return None
    return write_result(cfg, inputs, metrics, samples, t0, ranks=env.world_size, zero_stage=3)
