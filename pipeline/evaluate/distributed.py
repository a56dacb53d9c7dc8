"""Evaluation of a checkpoint too large for one device: every rank of a `deepspeed` launch holds 1/W of the model
(ZeRO-3, bf16 on GPUs), evaluates its share of the batches, and rank 0 writes the same results file as the
one-process path. `pipeline evaluate --num-gpus N | --hostfile H` starts it; each rank runs `evaluate_on_rank`."""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from pipeline.data.manifest import model_token_ids
from pipeline.errors import PipelineError
from pipeline.evaluate.run import EvalConfig, Inputs, generate, open_inputs, perplexity, write_result
from pipeline.model import build_model, pretraining_class, transformers_helper
from pipeline.train import checkpoint as ckpt
from pipeline.train.setup import Dist, init_distributed
from pipeline.train.weights import fill_parameters, full_shape

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


def _mismatch(model: torch.nn.Module, state: dict[str, Any], where: str) -> str | None:
    """Rank 0's check of names and shapes before any collective gather (a raise inside one would hang the rest)."""
    params = {name: full_shape(p) for name, p in model.named_parameters()}
    if unexpected := sorted(set(state) - set(params)):
        return f"{where}: unexpected tensors {unexpected[:3]}; the checkpoint's model differs from its recorded shape"
    if missing := sorted(set(params) - set(state)):
        return f"{where}: {len(missing)} tensors missing, e.g. {missing[:3]}"
    for name, shape in params.items():
        if tuple(state[name].shape) != shape:
            return f"{where}: {name} has shape {tuple(state[name].shape)}, the model expects {shape}"
    return None


def load_partitioned(inputs: Inputs, env: Dist, ds: dict[str, Any]) -> Any:
    """The checkpoint's weights in a ZeRO-3 engine's module: built under `zero.Init` (no rank holds the whole
    model), filled from rank 0's streamed read of the checkpoint in gathered groups."""
    import deepspeed
    import torch.distributed as dist

    r = inputs.run
    pretraining_class(r.shape)  # transformers' model code is imported before zero.Init patches tensor creation
    with (
        transformers_helper("transformers.integrations.deepspeed", "prevent_arange_dtype_change")(),
        deepspeed.zero.Init(config_dict_or_path=ds),
    ):
        model = build_model(r.shape, skip_init=True, **model_token_ids(inputs.dataset.manifest["tokenizer"]))
    state = ckpt.consolidated_state(r.run_dir, r.tag, r.shape.tied_names()) if env.rank == 0 else {}
    problem = [_mismatch(model, state, f"{r.run_dir}/{r.tag}") if env.rank == 0 else None]
    dist.broadcast_object_list(problem, src=0)
    if problem[0]:
        raise PipelineError(problem[0])
    fill_parameters(
        model, (lambda i, name, shape: ckpt.materialize(state[name])) if env.rank == 0 else None, stage3=True
    )
    engine, _, _, _ = deepspeed.initialize(model=model, config=ds)
    return engine.module.eval()


def evaluate_on_rank(cfg: EvalConfig) -> dict[str, Any] | None:
    """One rank's part; returns the result on rank 0, None elsewhere."""
    t0 = time.perf_counter()
    env = init_distributed()
    inputs = open_inputs(cfg)  # every rank checks the same inputs, so a bad one fails on all of them alike
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
